"""The autoscaling simulation (sim/scalesim.py) behind bench/autoscaling/simulate.py: the
trace has its shape, no request goes unaccounted, and on a repeating surge the predictive
scaler is ready before the rise where the reactive one is a cold start late."""

from __future__ import annotations

import pytest

from controlplane.fleet.model import ScalingPolicy
from controlplane.sim.scalesim import Trace, simulate

TRACE = Trace(season_s=300.0, seasons=4, rise_s=20.0, burst_s=20.0, seed=3)
POLICY = ScalingPolicy(min_replicas=1, max_replicas=30, target_per_replica=3.0)


def test_the_trace_is_quiet_at_night_peaks_at_mid_day_and_bursts_once() -> None:
    s = TRACE.season_s
    assert TRACE.shape(0.1 * s) == 1.0 and TRACE.shape(0.5 * s) == TRACE.peak
    b0, _ = TRACE.burst()
    assert TRACE.rate(b0 + 1) == TRACE.base_rps * TRACE.burst_factor * TRACE.shape(b0 + 1)
    assert TRACE.rate(b0 - 3 * s + 1) == TRACE.base_rps * TRACE.shape(b0 + 1)  # no burst before
    assert TRACE.arrivals() == TRACE.arrivals()  # seeded


@pytest.mark.parametrize("policy", ["none", "reactive", "predictive"])
def test_every_request_is_answered_held_refused_or_counted_unfinished(policy: str) -> None:
    r = simulate(TRACE, policy, POLICY, fixed_replicas=3, cold_start_s=20.0)
    assert len(r.latencies) + r.refused >= len(TRACE.arrivals()) - 1
    assert all(x >= 0 for _, x in r.latencies)
    assert r.gpu_s > 0


def test_predictive_is_ready_for_the_repeating_surge_the_reactive_scaler_is_late_for() -> None:
    reactive = simulate(TRACE, "reactive", POLICY, cold_start_s=20.0)
    predictive = simulate(TRACE, "predictive", POLICY, cold_start_s=20.0)
    s0, s1 = TRACE.surge()
    assert predictive.prewarm_rounds > 0 and reactive.prewarm_rounds == 0
    fast, slow = predictive.p90(s0, s1), reactive.p90(s0, s1)
    assert fast <= 0.6 * slow, (fast, slow)
    assert predictive.gpu_s <= 1.1 * reactive.gpu_s
