"""Pure balancing policies: endpoint loads in, integer EDS weights out.

Every policy has the shape `Policy = Callable[[Sequence[EndpointLoad], PolicyConfig],
dict[str, int]]`. A weight of 0 means "hold this endpoint out" (not ready); every ready
endpoint gets at least `floor`, at most `max_weight`, and if any endpoint is ready the
weights are never all zero. Smoothing across updates is a separate step (`smooth`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EndpointLoad:
    """What the signals know about one endpoint right now."""

    address: str
    ready: bool = True
    running: float = 0.0
    waiting: float = 0.0
    kv_use: float = 0.0  # 0-1
    latency_s: float | None = None  # smoothed mean latency
    error_rate: float = 0.0  # 0-1
    age_s: float = 0.0  # age of the newest signal
    capacity: float = 1.0  # relative throughput (GPU class or learnt)
    ready_for_s: float = math.inf  # seconds since it became ready (slow start)


@dataclass(frozen=True)
class PolicyConfig:
    max_weight: int = 100
    floor: int = 1
    waiting_saturation: float = 5.0  # queue length that counts as saturated
    kv_saturation: float = 0.8  # KV use that counts as saturated
    error_penalty: float = 4.0  # weight divided by (1 + penalty * error rate * 10)
    stale_after_s: float = 5.0  # signals older than this start losing influence...
    stale_full_s: float = 30.0  # ...and have none left at this age (capacity only)
    slow_start_s: float = 30.0  # ramp from floor to full weight after becoming ready


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
    return _scale({e.address: 1.0 / (1.0 + e.running + e.waiting) if e.ready else -1.0 for e in loads}, cfg)


def weighted_response_time(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> dict[str, int]:
    """Inverse to the mean latency; endpoints without one yet get the fleet's best."""
    known = [e.latency_s for e in loads if e.ready and e.latency_s]
    best = min(known, default=1.0)
    return _scale(
        {e.address: 1.0 / (e.latency_s or best) if e.ready else -1.0 for e in loads},
        cfg,
    )


def backlog_factor(e: EndpointLoad, cfg: PolicyConfig) -> float:
    """1 when idle, falling as the roofline saturation max(waiting/W, kv/K) grows."""
    saturation = max(e.waiting / cfg.waiting_saturation, e.kv_use / cfg.kv_saturation)
    return 1.0 / (1.0 + saturation)


def freshness(e: EndpointLoad, cfg: PolicyConfig) -> float:
    """1 for fresh signals, falling linearly to 0 between stale_after_s and stale_full_s."""
    if e.age_s <= cfg.stale_after_s:
        return 1.0
    if e.age_s >= cfg.stale_full_s:
        return 0.0
    return 1.0 - (e.age_s - cfg.stale_after_s) / (cfg.stale_full_s - cfg.stale_after_s)


def adaptive(loads: Sequence[EndpointLoad], cfg: PolicyConfig) -> dict[str, int]:
    """capacity x backlog x error penalty, with stale signals fading to capacity only,
    and a slow-start ramp for endpoints that just became ready."""
    raw: dict[str, float] = {}
    for e in loads:
        if not e.ready:
            raw[e.address] = -1.0
            continue
        signal = backlog_factor(e, cfg) / (1.0 + cfg.error_penalty * 10.0 * e.error_rate)
        trust = freshness(e, cfg)
        # An endpoint whose metrics cannot be read is neither zeroed nor trusted blindly.
        score = e.capacity * (trust * signal + (1.0 - trust) * 1.0)
        if e.ready_for_s < cfg.slow_start_s:
            score *= max(0.05, e.ready_for_s / cfg.slow_start_s)
        raw[e.address] = score
    return _scale(raw, cfg)


POLICIES: dict[str, Policy] = {
    "round_robin": round_robin,
    "least_connections": least_connections,
    "weighted_response_time": weighted_response_time,
    "adaptive": adaptive,
}


@dataclass(frozen=True)
class SmoothingConfig:
    alpha: float = 0.5  # EWMA weight of the new target
    hysteresis: float = 0.1  # relative change below which the old weight is kept
    max_step: float = 2.0  # a weight may at most double or halve per update


def smooth(previous: Mapping[str, int], target: Mapping[str, int], cfg: SmoothingConfig) -> dict[str, int]:
    """Move from previous weights towards target ones: EWMA, bounded steps, hysteresis.
    Held-out endpoints (0) and new endpoints take their target at once."""
    out: dict[str, int] = {}
    for addr, want in target.items():
        old = previous.get(addr)
        if old is None or old == 0 or want == 0:
            out[addr] = want
            continue
        mixed = old + cfg.alpha * (want - old)
        mixed = min(max(mixed, old / cfg.max_step), old * cfg.max_step)
        if abs(mixed - old) < cfg.hysteresis * old:
            out[addr] = old
        else:
            out[addr] = max(1, round(mixed))
    return out
