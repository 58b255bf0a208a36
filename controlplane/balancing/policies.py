"""Pure balancing policies: endpoint loads in, integer EDS weights out.

Every policy has the shape `Policy = Callable[[Sequence[EndpointLoad], PolicyConfig],
dict[str, int]]`. A weight of 0 means "hold this endpoint out" (not ready); every ready
endpoint gets at least `floor`, at most `max_weight`, and if any endpoint is ready the
weights are never all zero. Smoothing across updates is a separate step (`smooth`).
A figure never read (None in the load) weighs as 0 (`counted`): unknown is told apart for
the operator, and the weights stay what they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from controlplane.signals.load import EndpointLoad, counted


@dataclass(frozen=True)
class PolicyConfig:
    max_weight: int = 100
    floor: int = 1
    waiting_saturation: float = 0.33  # waiting/running that halves the weight
    queue_outlier: float = 2.0  # like servers: a queue counts above this x the others' mean + a batch
    kv_saturation: float = 0.8  # KV use above which the endpoint counts as filling up (saturated at 1.0)
    error_penalty: float = 4.0  # weight divided by (1 + penalty * error rate * 10)
    stale_after_s: float = 5.0  # signals older than this start losing influence...
    stale_full_s: float = 30.0  # ...and have none left at this age (capacity only)
    slow_start_s: float = 30.0  # ramp from floor to full weight after becoming ready
    speed_tolerance: float = 0.1  # per-token latencies within this fraction of the best count as the best
    speed_exponent: float = 1.5  # how strongly fast GPUs are preferred, by time per output token...
    latency_speed_exponent: float = 1.0  # ...or, where that is not reported, by end-to-end latency
    preferred_bonus: float = 2.0  # model_aware: weight multiplier for a preferred GPU class


Policy = Callable[[Sequence[EndpointLoad], PolicyConfig], dict[str, int]]


def _scale(raw: Mapping[str, float], cfg: PolicyConfig) -> dict[str, int]:
    """Scale positive scores so the largest is max_weight; ready ones never below floor."""
    top = max((v for v in raw.values() if v > 0), default=0.0)
    out: dict[str, int] = {}
    for addr, v in raw.items():
        if v < 0:
            out[addr] = 0  # held out
        elif top <= 0:
            out[addr] = cfg.floor
        else:
            out[addr] = max(cfg.floor, min(cfg.max_weight, round(v / top * cfg.max_weight)))
    return out


def round_robin(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> dict[str, int]:
    """Equal weights for every ready endpoint."""
    return _scale({e.address: 1.0 if e.ready else -1.0 for e in loads}, cfg)


def least_connections(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> dict[str, int]:
    """Inverse to the requests in flight (running + waiting)."""
    return _scale(
        {
            e.address: 1.0 / (1.0 + counted(e.running) + counted(e.waiting)) if e.ready else -1.0
            for e in loads
        },
        cfg,
    )


def weighted_response_time(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> dict[str, int]:
    """Inverse to the mean latency; endpoints without one yet get the fleet's best."""
    known = [e.latency_s for e in loads if e.ready and e.latency_s]
    best = min(known, default=1.0)
    return _scale(
        {e.address: 1.0 / (e.latency_s or best) if e.ready else -1.0 for e in loads},
        cfg,
    )


def backlog_factor(e: EndpointLoad, cfg: PolicyConfig) -> float:
    """1 with no queue and KV below kv_saturation, falling as either grows.

    The queue counts relative to the running batch (a new request waits for about
    waiting/running of a service time), so 5 waiting is a lot for a batch of 4 and nothing
    for a batch of 200. KV use counts only above kv_saturation: below it the server admits
    new sequences at once, above it they soon queue or preempt.
    """
    return 1.0 / (1.0 + max(_queue_pressure(e, cfg), _kv_pressure(e, cfg)))


def _queue_pressure(e: EndpointLoad, cfg: PolicyConfig) -> float:
    return counted(e.waiting) / max(counted(e.running), 1.0) / cfg.waiting_saturation


def _kv_pressure(e: EndpointLoad, cfg: PolicyConfig) -> float:
    if cfg.kv_saturation >= 1.0:
        return 0.0
    return max(0.0, counted(e.kv_use) - cfg.kv_saturation) / (1.0 - cfg.kv_saturation)


def speed_factor(own_s: float | None, best_s: float | None, exponent: float, cfg: PolicyConfig) -> float:
    """1 for the fleet's fastest latency (within speed_tolerance), falling as
    (best / own) ** exponent for slower endpoints; 1 when unknown.

    Capacity alone sends a slow GPU its throughput share, yet every request there takes
    longer; the speed factor moves traffic to the fast GPUs first, as a per-request picker
    does. Envoy's EDF shares traffic in proportion to the weights (over active + 1), so a
    slow GPU keeps a share while fast ones have room unless its weight is well below its
    capacity share: hence speed_exponent above 1 (1.5 was best across loads in
    bench/lb_quality/simulate.py; the backlog factor hands traffic back as fast GPUs queue).
    The tolerance keeps measurement noise on identical GPUs from making their weights
    differ, which would switch Envoy from power-of-two-choices to EDF.
    """
    if not own_s or not best_s:
        return 1.0
    relative = min(1.0, (1.0 + cfg.speed_tolerance) * best_s / own_s)
    return float(relative**exponent)


def speed_signal(
    loads: Sequence[EndpointLoad], cfg: PolicyConfig
) -> tuple[Callable[[EndpointLoad], float | None], float | None, float]:
    """Which latency tells the endpoints' speeds apart: (getter, fleet best, exponent).

    The time per output token when at least two fresh ready endpoints report it: it does
    not depend on request sizes or queueing. Otherwise the mean end-to-end latency, with a
    weaker exponent: it is noisier (request mix) and also counts queueing, which the
    backlog factor already does.
    """
    fresh = [e for e in loads if e.ready and freshness(e, cfg) > 0]
    tpot = [e.token_latency_s for e in fresh if e.token_latency_s]
    if len(tpot) >= 2:
        return (lambda e: e.token_latency_s), min(tpot), cfg.speed_exponent
    e2e = [e.latency_s for e in fresh if e.latency_s]
    return (lambda e: e.latency_s), min(e2e) if len(e2e) >= 2 else None, cfg.latency_speed_exponent


def freshness(e: EndpointLoad, cfg: PolicyConfig) -> float:
    """1 for fresh signals, falling linearly to 0 between stale_after_s and stale_full_s."""
    if e.age_s <= cfg.stale_after_s:
        return 1.0
    if e.age_s >= cfg.stale_full_s:
        return 0.0
    return 1.0 - (e.age_s - cfg.stale_after_s) / (cfg.stale_full_s - cfg.stale_after_s)


def adaptive(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> dict[str, int]:
    """capacity x speed x backlog x error penalty, with stale signals fading to capacity
    only, and a slow-start ramp for endpoints that just became ready.

    Where everything but the queues is equal (a fleet of like GPUs, none failing, ramping or
    short of KV cache), the weights stay equal and the queues are left to Envoy (but for a
    queue that stands out from the others', `queue_outliers`): equal
    weights keep its least request on a full scan of each proxy's own requests in flight,
    which sees a queue at the next request, where a weight pushed from a scrape sees it a
    second late and switches Envoy to its EDF schedule (1.13x the p90 of plain least request
    on 8 like servers at 85% load, bench/lb_quality/simulate.py --fleet
    real_bench_homogeneous). KV pressure still counts: requests in flight do not show it."""
    latency_of, best, exponent = speed_signal(loads, cfg)
    raw: dict[str, float] = {}
    steady: dict[str, float] = {}  # the same, without the queues
    for e in loads:
        if not e.ready:
            raw[e.address] = steady[e.address] = -1.0
            continue
        base = speed_factor(latency_of(e), best, exponent, cfg) / (
            1.0 + cfg.error_penalty * 10.0 * counted(e.error_rate)
        )
        trust = freshness(e, cfg)
        # An endpoint whose metrics cannot be read is neither zeroed nor trusted blindly.
        score = e.capacity * (trust * base * backlog_factor(e, cfg) + (1.0 - trust) * 1.0)
        calm = e.capacity * (trust * base / (1.0 + _kv_pressure(e, cfg)) + (1.0 - trust) * 1.0)
        if e.ready_for_s < cfg.slow_start_s:
            ramp = max(0.05, e.ready_for_s / cfg.slow_start_s)
            score, calm = score * ramp, calm * ramp
        raw[e.address], steady[e.address] = score, calm
    alike = [v for v in steady.values() if v > 0]
    if alike and max(alike) <= min(alike) * (1.0 + cfg.speed_tolerance):
        stuck = queue_outliers(loads, cfg)
        return _scale(
            {a: (raw[a] / v if a in stuck else 1.0) if v > 0 else v for a, v in steady.items()}, cfg
        )
    return _scale(raw, cfg)


def queue_outliers(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> set[str]:
    """Ready endpoints whose queue stands out from their peers': more waiting than
    `queue_outlier` times the others' mean plus a batch of its own. A queue the proxies'
    own counts cannot explain (a server slowing down, or loaded by other clients); the
    ordinary queues of a busy fleet are alike and stay Envoy's business."""
    ready = [e for e in loads if e.ready]
    total = sum(counted(e.waiting) for e in ready)
    out = set()
    for e in ready:
        waiting = counted(e.waiting)
        others = (total - waiting) / (len(ready) - 1) if len(ready) > 1 else 0.0
        if waiting > cfg.queue_outlier * others + max(counted(e.running), 1.0):
            out.add(e.address)
    return out


def least_request(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> dict[str, int]:
    """Equal weights, like round_robin, but the cluster keeps Envoy's least request
    (power of two choices on each proxy's own in-flight counts): plain Envoy, no signals."""
    return round_robin(loads, cfg)


def capacity(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> dict[str, int]:
    """In proportion to each ready endpoint's capacity (declared, else learnt), with Envoy's
    least request on each proxy's own in-flight counts: capacity-weighted least request,
    the static baseline `adaptive` is measured against. No load signal but readiness."""
    return _scale({e.address: e.capacity if e.ready else -1.0 for e in loads}, cfg)


def model_aware(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> dict[str, int]:
    """The seed's model-aware scheduling: an endpoint whose GPU memory cannot hold the model
    is held out; the rest weigh capacity x a bonus for a preferred GPU class x headroom
    (backlog factor x free KV cache), with stale signals fading to capacity only."""
    raw: dict[str, float] = {}
    for e in loads:
        if not e.ready or not e.fits:
            raw[e.address] = -1.0
            continue
        headroom = backlog_factor(e, cfg) * max(0.05, 1.0 - counted(e.kv_use))
        trust = freshness(e, cfg)
        score = e.capacity * (cfg.preferred_bonus if e.preferred else 1.0)
        score *= trust * headroom + (1.0 - trust)
        if e.ready_for_s < cfg.slow_start_s:
            score *= max(0.05, e.ready_for_s / cfg.slow_start_s)
        raw[e.address] = score
    return _scale(raw, cfg)


POLICIES: dict[str, Policy] = {  # the names are fleet.model.POLICY_NAMES (a test checks)
    "adaptive": adaptive,
    "round_robin": round_robin,
    "least_request": least_request,
    "capacity": capacity,
    "least_connections": least_connections,
    "weighted_response_time": weighted_response_time,
    "model_aware": model_aware,
    "picker": adaptive,  # the weights a proxy falls back to when the picker cannot answer
}


@dataclass(frozen=True)
class SmoothingConfig:
    alpha: float = 0.5  # EWMA weight of the new target
    hysteresis: float = 0.1  # relative change below which the old weight is kept
    max_step: float = 2.0  # a weight may at most double or halve per update


def smooth(previous: Mapping[str, int], target: Mapping[str, int], cfg: SmoothingConfig) -> dict[str, int]:
    """Move from previous weights towards target ones: EWMA, bounded steps, hysteresis.
    Held-out endpoints (0) and new endpoints take their target at once; when the targets
    are all equal, unequal weights within the hysteresis band snap to them."""
    out: dict[str, int] = {}
    # Equal weights make Envoy's least request use power-of-two-choices; unequal ones switch
    # it to EDF. When the targets are all equal and the weights are not, a change within the
    # hysteresis band goes straight to the target, or the band would leave a weight short
    # and Envoy in EDF for good.
    live = [addr for addr, w in target.items() if w > 0]
    snap = len({target[a] for a in live}) == 1 and len({previous.get(a) for a in live}) > 1
    for addr, want in target.items():
        old = previous.get(addr)
        if old is None or old == 0 or want == 0:
            out[addr] = want
            continue
        mixed = old + cfg.alpha * (want - old)
        mixed = min(max(mixed, old / cfg.max_step), old * cfg.max_step)
        if abs(mixed - old) < cfg.hysteresis * old:
            out[addr] = round(min(max(want, old / cfg.max_step), old * cfg.max_step)) if snap else old
        else:
            step = round(mixed)
            if step == old:  # rounding would stall short of the target (2 -> 1.5 -> 2)
                step += 1 if want > old else -1
            out[addr] = max(1, step)
    return out
