"""Desired replicas from demand, in the style of Knative's KPA (pure: no I/O, no clock).

Demand is the work a model has: requests running or waiting on its servers, plus requests
held for it while no server is ready (autoscaler.py adds them). Every round the controller hands a sample
to the model's `Scaler`, which keeps two sliding windows of them:

- the **stable** window (60 s): its mean over the target per replica, rounded up, is what
  the model wants in steady state, so a burst of a few seconds moves nothing;
- the **panic** window (6 s): when its mean asks for `panic_threshold` (2x) the replicas
  that are ready, the scaler panics, and for a stable window after the last such round it
  follows the panic window and never scales down (Knative's panic mode);
- one decision never goes below the ready replicas / `scale_down_rate`, nor above them x
  `scale_up_rate`;
- a forecast (predictive pre-warm, forecast.py) of the demand up to a cold start ahead is a
  floor under the answer, so replicas are warm when a predicted rise comes;
- `min` and `max` bound the result. With `min: 0` a model with no demand at all for
  `idle_grace` scales to zero (a panic ends too: no work is no burst); a single request
  wakes it (desired 1 at once).

`Decision` says why, for `explain`, the metrics and the logs.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from controlplane.autoscaling.forecast import Prediction
from controlplane.fleet.model import DEFAULT_TARGET_PER_REPLICA, ScalingPolicy


@dataclass(frozen=True)
class Decision:
    desired: int
    ready: int  # replicas serving when it was taken
    demand: float  # the sample just taken
    stable_demand: float  # mean over the stable window
    panic_demand: float  # mean over the panic window
    target: float  # demand one replica is meant to carry
    panicking: bool
    reason: str
    idle_s: float = 0.0  # since demand was last above zero
    # Predictive pre-warm (autoscaling/forecast.py): the demand forecast `lead_s` ahead (the
    # model's observed cold start) and the method chosen by backtest; None/"" when off or
    # not trusted yet. `desired` already includes it.
    predicted_demand: float | None = None
    forecast_method: str = ""
    lead_s: float = 0.0

    def active(self, policy: ScalingPolicy) -> bool:
        """Whether the model has had work within its idle grace: KEDA's IsActive."""
        return self.demand > 0 or self.idle_s < policy.idle_grace_s


class _Window:
    """Samples of one window; the mean is weighted by how long each sample stood."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float, span_s: float) -> None:
        self.samples.append((now, value))
        # Keep the newest sample older than the window: it stood at the window's start.
        while len(self.samples) > 1 and self.samples[1][0] <= now - span_s:
            self.samples.popleft()

    def mean(self, now: float, span_s: float) -> float:
        start = now - span_s
        total = weight = 0.0
        items = list(self.samples)
        for i, (t, v) in enumerate(items):
            end = items[i + 1][0] if i + 1 < len(items) else now
            begin = max(t, start)
            if end <= begin:
                continue
            total += v * (end - begin)
            weight += end - begin
        if weight == 0.0:
            return items[-1][1] if items else 0.0
        return total / weight


def target_of(policy: ScalingPolicy, slots: float | None) -> float:
    """Demand per replica: the configured target; else the servers' slots x utilization."""
    if policy.target_per_replica is not None:
        return policy.target_per_replica
    if slots:
        return max(1.0, slots * policy.target_utilization)
    return DEFAULT_TARGET_PER_REPLICA


class Scaler:
    """One model's (or version's) desired replicas over time."""

    def __init__(self) -> None:
        self._window = _Window()
        self._panic_until: float | None = None
        self._last_desired: int | None = None
        self._last_demand_at: float | None = None  # when demand was last above zero

    def decide(
        self,
        policy: ScalingPolicy,
        now: float,
        demand: float,
        ready: int,
        slots: float | None = None,
        predicted: Prediction | None = None,
    ) -> Decision:
        """Fold in a demand sample taken at `now` with `ready` replicas serving; decide.
        `predicted`: the demand forecast up to a cold start ahead (predictive pre-warm); the
        replicas it needs are a floor under the reactive answer."""
        demand = max(0.0, demand) if math.isfinite(demand) else 0.0
        self._window.add(now, demand, policy.stable_window_s)
        if demand > 0 or self._last_demand_at is None:
            self._last_demand_at = now
        target = target_of(policy, slots)
        stable = self._window.mean(now, policy.stable_window_s)
        panic = self._window.mean(now, policy.panic_window_s)
        want_stable = math.ceil(stable / target - 1e-9)
        want_panic = math.ceil(panic / target - 1e-9)
        base = max(ready, 1)
        floor = math.floor(base / policy.scale_down_rate)
        ceiling = math.ceil(base * policy.scale_up_rate)
        want_stable = min(max(want_stable, floor), ceiling)
        want_panic = min(max(want_panic, floor), ceiling)
        idle_for = now - self._last_demand_at
        idle = demand == 0 and idle_for >= policy.idle_grace_s
        if want_panic / base >= policy.panic_threshold and want_panic > ready:
            self._panic_until = now + policy.stable_window_s
        panicking = self._panic_until is not None and now < self._panic_until and not idle
        if not panicking:
            self._panic_until = None  # no work at all for the idle grace ends a panic too
        if panicking:
            desired = max(want_panic, self._last_desired or 0)
            reason = f"panic: the last {policy.panic_window_s:g}s want {want_panic} (ready {ready})"
        else:
            desired = want_stable
            reason = f"stable: the last {policy.stable_window_s:g}s want {want_stable}"
        if demand > 0 and desired == 0:
            desired, reason = 1, "woken: demand arrived"
        elif idle and policy.min_replicas == 0 and (desired > 0 or (self._last_desired or 0) > 0):
            # Once idle, zero until demand comes back: not the scale-down rate's floor over the
            # replicas still ready (they drain away one by one after this).
            desired, reason = 0, f"idle {idle_for:.0f}s (idle_grace {policy.idle_grace_s:g}s): scaled to zero"
        elif desired == 0 and policy.min_replicas == 0 and not idle:
            desired = 1 if (self._last_desired or 0) > 0 else 0
            if desired:
                reason = f"idle {idle_for:.0f}s of {policy.idle_grace_s:g}s before scaling to zero"
        if predicted is not None:
            ahead = math.ceil(predicted.demand / target - 1e-9)
            if ahead > desired:
                desired = ahead
                reason = (
                    f"pre-warm: {predicted.method} forecasts demand {predicted.demand:.1f} within "
                    f"{predicted.lead_s:.0f}s (the cold start); reactive: {reason}"
                )
        if desired < policy.min_replicas:
            desired, reason = policy.min_replicas, f"{reason}; raised to min {policy.min_replicas}"
        elif desired > policy.max_replicas:
            desired, reason = policy.max_replicas, f"{reason}; capped at max {policy.max_replicas}"
        self._last_desired = desired
        return Decision(
            desired,
            ready,
            demand,
            stable,
            panic,
            target,
            panicking,
            reason,
            idle_for,
            predicted.demand if predicted is not None else None,
            predicted.method if predicted is not None else "",
            predicted.lead_s if predicted is not None else 0.0,
        )
