"""Simulation of a model's replicas under an autoscaling policy (pure, seeded).

What `bench/autoscaling_surge.py` compares: no autoscaling, the reactive scaler, and the
reactive scaler with predictive pre-warm, on one trace. The scalers are the real ones
(`autoscaling/kpa.py` Scaler, `autoscaling/forecast.py` Forecaster), fed every round (1 s)
with what the control plane would see; the servers are the emulator's service model
(`sim/service.py`: continuous batching with slots, FIFO wait).

- **Trace**: Poisson arrivals at `base_rps` x a daily shape (quiet nights, a rise to
  `peak` x at mid-day) repeating every `season_s`, x `burst_factor` during one burst in the
  measured season at a time no season before had one. Every policy gets the same requests.
- **Replicas**: a started replica takes `cold_start_s` to be ready and costs GPU-seconds from
  its start until it is stopped (warming included). A replica to remove takes no new
  requests and stops once its last one finishes (a drain).
- **Routing**: each request goes to the ready, not draining replica with the fewest
  requests (Envoy's least request with one proxy). With none ready it is held (the holding
  service), up to `hold_max`; beyond that it is refused. Held requests go out as soon as a
  replica is ready.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from controlplane.autoscaling.forecast import Forecaster, Settings
from controlplane.autoscaling.kpa import Scaler
from controlplane.fleet.model import ScalingPolicy
from controlplane.sim.service import BatchingServer, ServerSpec

POLICIES = ("none", "reactive", "predictive")


@dataclass(frozen=True)
class Trace:
    season_s: float = 600.0
    seasons: int = 4  # the last one is measured
    base_rps: float = 2.0
    peak: float = 5.0  # mid-day rate over the night's
    rise_at: float = 0.3  # the share of the season where the rise starts
    rise_s: float = 30.0  # how long the rise takes
    fall_at: float = 0.7
    burst_factor: float = 5.0
    burst_at: float = 0.85  # the burst in the measured season (share of the season)
    burst_s: float = 30.0
    work_s: float = 4.0  # mean service time of a request (exponential)
    surge_tail_s: float = 60.0  # the surge window: the rise and this long after it
    seed: int = 1

    def shape(self, t: float) -> float:
        """The daily factor at time t (1 at night, `peak` at mid-day, linear ramps)."""
        s = self.season_s
        phase = t % s
        up, down = self.rise_at * s, self.fall_at * s
        if phase < up or phase >= down + self.rise_s:
            return 1.0
        if phase < up + self.rise_s:
            return 1.0 + (self.peak - 1.0) * (phase - up) / self.rise_s
        if phase < down:
            return self.peak
        return self.peak - (self.peak - 1.0) * (phase - down) / self.rise_s

    def measured_from(self) -> float:
        return (self.seasons - 1) * self.season_s

    def burst(self) -> tuple[float, float]:
        start = self.measured_from() + self.burst_at * self.season_s
        return start, start + self.burst_s

    def surge(self) -> tuple[float, float]:
        """The measured season's daily rise and `surge_tail_s` after it (the predictable surge)."""
        start = self.measured_from() + self.rise_at * self.season_s
        return start, start + self.rise_s + self.surge_tail_s

    def rate(self, t: float) -> float:
        b0, b1 = self.burst()
        return self.base_rps * self.shape(t) * (self.burst_factor if b0 <= t < b1 else 1.0)

    def arrivals(self) -> list[tuple[float, float]]:
        """(time, service seconds) of every request, by thinning a Poisson process."""
        rng = random.Random(self.seed)
        top = self.base_rps * self.peak * self.burst_factor
        end = self.seasons * self.season_s
        out: list[tuple[float, float]] = []
        t = 0.0
        while True:
            t += rng.expovariate(top)
            if t >= end:
                return out
            if rng.random() < self.rate(t) / top:
                out.append((t, rng.expovariate(1.0 / self.work_s)))


@dataclass
class _Replica:
    server: BatchingServer
    started: float
    ready_at: float
    stopped: float | None = None
    draining: bool = False

    def load(self) -> int:
        return len(self.server.running) + len(self.server.waiting)


@dataclass
class Result:
    policy: str
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (sent, seconds)
    held: int = 0
    refused: int = 0
    gpu_s: float = 0.0  # in the measured season
    max_replicas: int = 0
    prewarm_rounds: int = 0  # rounds in which the forecast raised the count
    unfinished: int = 0  # still waiting at the end (counted with the time waited so far)

    def p90(self, start: float = -math.inf, end: float = math.inf) -> float:
        xs = sorted(x for t, x in self.latencies if start <= t < end)
        if not xs:
            return math.nan
        return xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]


def simulate(
    trace: Trace,
    policy_name: str,
    scaling: ScalingPolicy,
    *,
    slots: int = 4,
    cold_start_s: float = 30.0,
    fixed_replicas: int = 2,
    hold_max: int = 100,
    bucket_s: float = 10.0,
) -> Result:
    """Run the trace under one policy ("none": `fixed_replicas` always on)."""
    if policy_name not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy_name!r}")
    spec = ServerSpec(slots=slots, prefill_s_per_token=0.0, decode_s_per_token=1.0)
    arrivals = trace.arrivals()
    end = trace.seasons * trace.season_s
    measured = trace.measured_from()
    replicas: list[_Replica] = []
    held: list[tuple[float, float]] = []
    result = Result(policy_name)
    scaler = Scaler()
    forecaster = Forecaster(refits_per_round=1)
    settings = Settings(bucket_s, trace.season_s, "auto", cold_start_s)
    rid = 0

    def start_replica(now: float, ready_now: bool = False) -> None:
        r = _Replica(BatchingServer(spec), now, now if ready_now else now + cold_start_s)
        r.server.advance(now)
        replicas.append(r)

    sent_at: dict[int, float] = {}

    def collect(r: _Replica, now: float) -> None:
        for c in r.server.advance(now):
            sent = sent_at.pop(c.request_id)
            result.latencies.append((sent, c.finished - sent))  # held time included

    def serving(now: float) -> list[_Replica]:
        return [r for r in replicas if r.stopped is None and not r.draining and r.ready_at <= now]

    def send(sent: float, work: float, now: float) -> None:
        nonlocal rid
        best = min(serving(now), key=lambda r: r.load())
        collect(best, now)
        sent_at[rid] = sent
        best.server.submit(rid, 0, max(1, round(work)), now)  # 1 s per output token
        rid += 1

    for _ in range(fixed_replicas if policy_name == "none" else max(1, scaling.min_replicas)):
        start_replica(0.0, ready_now=True)

    i = 0
    completed_before = 0
    for second in range(int(end)):
        now = float(second)
        # Arrivals within this second, each at its own time.
        while i < len(arrivals) and arrivals[i][0] < now + 1:
            t, work = arrivals[i]
            i += 1
            for r in replicas:
                if r.stopped is None:
                    collect(r, t)
            if serving(t):
                send(t, work, t)
            elif policy_name != "none" and len(held) < hold_max:
                held.append((t, work))
                if t >= measured:
                    result.held += 1
            else:
                if t >= measured:
                    result.refused += 1
        tick = now + 1
        for r in replicas:
            if r.stopped is None:
                collect(r, tick)
            if r.draining and r.stopped is None and r.load() == 0:
                r.stopped = tick
        while held and serving(tick):
            t, work = held.pop(0)
            send(t, work, tick)
        if policy_name == "none":
            continue
        # The control plane's round.
        live = [r for r in replicas if r.stopped is None and not r.draining]
        ready = [r for r in live if r.ready_at <= tick]
        demand = sum(r.load() for r in replicas if r.stopped is None) + len(held)
        running = sum(len(r.server.running) for r in replicas if r.stopped is None)
        completed = len(result.latencies) - completed_before
        completed_before = len(result.latencies)
        prediction = None
        if policy_name == "predictive":
            forecaster.record("m", settings, tick, demand, running, completed)
            forecaster.refit({"m": settings})
            prediction = forecaster.predict("m", settings, tick)
        d = scaler.decide(scaling, tick, demand, len(ready), float(slots), prediction)
        if d.reason.startswith("pre-warm"):
            result.prewarm_rounds += 1
        want = d.desired
        if want > len(live):
            for _ in range(want - len(live)):
                start_replica(tick)
                if policy_name == "predictive":
                    forecaster.cold_starts.observe("m", cold_start_s)
        elif want < len(live):
            excess = len(live) - want
            warming = sorted((r for r in live if r.ready_at > tick), key=lambda r: -r.started)
            for r in warming[:excess]:
                r.stopped = tick
            excess -= min(excess, len(warming))
            for r in sorted(ready, key=lambda r: r.load())[:excess]:
                r.draining = True
                if r.load() == 0:
                    r.stopped = tick
        result.max_replicas = max(result.max_replicas, len([r for r in replicas if r.stopped is None]))
    # Requests still waiting or held at the end count with the time they have waited so far
    # (a lower bound): an overloaded policy must not look fast by never finishing.
    result.unfinished = len(sent_at) + len(held)
    result.latencies += [(t, end - t) for t in sent_at.values()] + [(t, end - t) for t, _ in held]
    for r in replicas:
        stop = r.stopped if r.stopped is not None else end
        result.gpu_s += max(0.0, stop - max(r.started, measured))
    return result
