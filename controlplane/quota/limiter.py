"""Pure: per-tenant, per-model request and token quotas as buckets, and the answer a client gets.

Each (tenant, model, kind) has a bucket of `limit` units that refills continuously at
limit / 60 per second: a tenant that keeps to its per-minute limit is never refused, one that
bursts gets the whole minute's allowance at once and then the refill rate. A request takes
one unit; without one it is over the limit. The answer carries what OpenAI's API sends with
every response (`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
`x-ratelimit-reset-requests`: the time until the bucket is full again) and, over the limit,
`retry-after`: the time until one unit is back.

A request without the key header is the tenant "" (anonymous): the default limits apply, as
to every tenant the fleet does not name. Nothing here does I/O; quota/service.py answers
Envoy's rate-limit calls with it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from controlplane.fleet.model import QuotaSpec

WINDOW_S = 60.0
MAX_BUCKETS = 100_000  # (tenant, model) pairs kept; the least recently used dropped (it refills)


@dataclass
class Bucket:
    level: float
    at: float

    def refill(self, limit: int, now: float) -> None:
        if now > self.at:
            self.level = min(float(limit), self.level + (now - self.at) * limit / WINDOW_S)
            self.at = now


@dataclass(frozen=True)
class Decision:
    """The answer for one request on one kind (requests, tokens): allowed or not, and the
    headers the client gets."""

    allowed: bool
    limit: int | None  # None: no limit applies
    remaining: int = 0
    reset_s: float = 0.0
    retry_after_s: float = 0.0
    kind: str = "requests"

    def headers(self) -> dict[str, str]:
        if self.limit is None:
            return {}
        out = {
            f"x-ratelimit-limit-{self.kind}": str(self.limit),
            f"x-ratelimit-remaining-{self.kind}": str(self.remaining),
            f"x-ratelimit-reset-{self.kind}": duration(self.reset_s),
        }
        if not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


def duration(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 20ms."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


KINDS = {"requests": "requests_per_minute", "tokens": "tokens_per_minute"}


def needed(kind: str, hits: int) -> float:
    """What a bucket must hold for a request to go: `hits` requests; tokens: anything at all."""
    return float(hits) if kind == "requests" else 1e-9


def decision(kind: str, limit: int, level: float, allowed: bool, need: float) -> Decision:
    """The answer, from the bucket's level after the request (taken or not) and its limit."""
    rate = limit / WINDOW_S
    reset = (limit - level) / rate if rate > 0 else math.inf
    retry = 0.0 if allowed else ((need - level) / rate if rate > 0 else WINDOW_S)
    return Decision(
        allowed,
        limit,
        remaining=max(0, math.floor(level)),
        reset_s=min(reset, WINDOW_S),
        retry_after_s=min(retry, WINDOW_S) if rate > 0 else WINDOW_S,
        kind=kind,
    )


@dataclass
class Limiter:
    """The buckets of every (tenant, model, kind) in use, in memory.

    Requests are taken before a request goes (one each; none left: refused). Tokens are
    known only when the response ends: a request is let through while the tenant's token
    bucket is not empty, and its tokens are charged when it ends (`charge`), which may take
    the bucket below zero; the debt is repaid by the refill before the next request goes, so
    over a window a tenant gets its limit plus at most one response's tokens. The debt is
    bounded by one minute's allowance."""

    spec: QuotaSpec
    buckets: OrderedDict[tuple[str, str, str], Bucket] = field(default_factory=OrderedDict)

    def _bucket(self, tenant: str, model: str, kind: str, limit: int, now: float) -> Bucket:
        key = (tenant, model, kind)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket(float(limit), now)
            while len(self.buckets) > MAX_BUCKETS:
                self.buckets.popitem(last=False)
        self.buckets.move_to_end(key)
        bucket.refill(limit, now)
        return bucket

    def check(self, tenant: str, model: str, now: float, hits: int = 1, kind: str = "requests") -> Decision:
        """Requests: take `hits` from the bucket of `tenant` on `model` at `now`, if it has them.
        Tokens: allowed while the bucket is above zero; nothing is taken (see charge)."""
        limit = self.spec.limit(tenant, model, KINDS[kind])
        if limit is None:
            return Decision(True, None, kind=kind)
        bucket = self._bucket(tenant, model, kind, limit, now)
        need = needed(kind, hits)
        allowed = bucket.level >= need
        if allowed and kind == "requests":
            bucket.level -= hits
        return decision(kind, limit, bucket.level, allowed, need)

    def charge(self, tenant: str, model: str, tokens: int, now: float) -> int | None:
        """Take `tokens` (a response's usage) from the token bucket of `tenant` on `model`;
        the level after, None when no token limit applies."""
        limit = self.spec.limit(tenant, model, "tokens_per_minute")
        if limit is None:
            return None
        bucket = self._bucket(tenant, model, "tokens", limit, now)
        bucket.level = max(-float(limit), bucket.level - max(0, tokens))
        return math.floor(bucket.level)

    def use(self, tenant: str, model: str, now: float, kind: str = "requests") -> tuple[int, int] | None:
        """(remaining, limit) of `tenant` on `model` at `now` without taking any, None when no
        limit applies."""
        limit = self.spec.limit(tenant, model, KINDS[kind])
        if limit is None:
            return None
        bucket = self.buckets.get((tenant, model, kind))
        if bucket is None:
            return limit, limit
        probe = Bucket(bucket.level, bucket.at)
        probe.refill(limit, now)
        return max(0, math.floor(probe.level)), limit
