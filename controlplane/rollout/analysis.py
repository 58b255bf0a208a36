"""A rollout step's analysis: canary against stable since the step began (pure).

The controller reads each endpoint's cumulative counters (signals.store.EndpointCounters)
when a step begins and at every tick; the difference is what the version did during the
step. Two sources count requests and errors, and the larger of each is used:

- the server's own counters (TGI and Triton count failures; vLLM and SGLang only successes),
- the proxies' load reports (Envoy counts every 5xx as an error, and resets too).

The p99 comes from the server's latency histogram (vLLM, SGLang, TGI), interpolated within
its bucket as Prometheus' histogram_quantile does. A counter that went backwards (a server
restarted) counts from zero.

The figures also say what could have been seen: whether a load report for the endpoints
arrived in the window (its counts moved, or a newer report came, even one of zeros), and
which servers count no failures. machine.inconclusive judges from that.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from controlplane.rollout.machine import UNSCRAPED, Analysis
from controlplane.signals.store import EndpointCounters


@dataclass(frozen=True)
class VersionFigures:
    requests: float
    errors: float
    p99_s: float | None
    load_reports: bool = False  # a proxy's load report for these endpoints arrived in the window
    uncounted: tuple[str, ...] = ()  # dialects (or UNSCRAPED) of servers that count no failures

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def _delta(now: float, base: float) -> float:
    return now - base if now >= base else now


def _bucket_delta(
    now: tuple[tuple[float, float], ...], base: tuple[tuple[float, float], ...]
) -> dict[float, float]:
    before = dict(base)
    reset = any(c < before.get(le, 0.0) for le, c in now)
    return {le: c if reset else c - before.get(le, 0.0) for le, c in now}


def quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram ({upper bound: count}), or None if empty."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if le == float("inf"):
                return prev_le  # beyond the last finite bound: the best we can say
            span = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / span if span else 1.0)
        prev_le, prev_count = le, count
    return prev_le


def figures(
    now: Mapping[str, EndpointCounters], base: Mapping[str, EndpointCounters], addresses: Iterable[str]
) -> VersionFigures:
    """What the endpoints at `addresses` did between the `base` and `now` readings."""
    requests = errors = 0.0
    buckets: dict[float, float] = {}
    reported = False
    uncounted: set[str] = set()
    for a in addresses:
        n = now.get(a, EndpointCounters())
        b = base.get(a, EndpointCounters())
        s_ok = _delta(n.server_ok, b.server_ok)
        s_fail = _delta(n.server_failed, b.server_failed)
        l_ok = _delta(n.lrs_ok, b.lrs_ok)
        l_fail = _delta(n.lrs_failed, b.lrs_failed)
        requests += max(s_ok + s_fail, l_ok + l_fail)
        errors += max(s_fail, l_fail)
        for le, c in _bucket_delta(n.buckets, b.buckets).items():
            buckets[le] = buckets.get(le, 0.0) + c
        reported = reported or l_ok + l_fail > 0 or _newer(n.lrs_reported_at, b.lrs_reported_at)
        if not n.server_counts_failures:
            uncounted.add(n.dialect or UNSCRAPED)
    return VersionFigures(requests, errors, quantile(buckets, 0.99), reported, tuple(sorted(uncounted)))


def _newer(now: float | None, base: float | None) -> bool:
    return now is not None and (base is None or now > base)


def with_peer_reports(local: EndpointCounters, peers: EndpointCounters) -> EndpointCounters:
    """The endpoint's counters with the load reports other control-plane replicas received
    (HA: a proxy's load reports may go to another replica than the leader)."""
    at = [t for t in (local.lrs_reported_at, peers.lrs_reported_at) if t is not None]
    return replace(
        local,
        lrs_ok=local.lrs_ok + peers.lrs_ok,
        lrs_failed=local.lrs_failed + peers.lrs_failed,
        lrs_reported_at=max(at) if at else None,
    )


def analysis(canary: VersionFigures, stable: VersionFigures, window_s: float = math.inf) -> Analysis:
    """The machine's view of one step so far, watched for `window_s` seconds."""
    return Analysis(
        canary_requests=int(canary.requests),
        canary_error_rate=canary.error_rate,
        stable_error_rate=stable.error_rate,
        canary_p99_s=canary.p99_s,
        stable_p99_s=stable.p99_s,
        stable_requests=int(stable.requests),
        # Proxies that report the stable version would report the canary's requests too:
        # Envoy leaves an endpoint that served nothing out of its report.
        load_reports=canary.load_reports or stable.load_reports,
        canary_uncounted=canary.uncounted,
        window_s=window_s,
    )
