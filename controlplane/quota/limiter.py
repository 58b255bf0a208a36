"""Pure: per-tenant, per-model request quotas as token buckets, and the answer a client gets.

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
    """The answer for one request: allowed or not, and the headers the client gets."""

    allowed: bool
    limit: int | None  # None: no limit applies
    remaining: int = 0
    reset_s: float = 0.0
    retry_after_s: float = 0.0

    def headers(self) -> dict[str, str]:
        if self.limit is None:
            return {}
        out = {
            "x-ratelimit-limit-requests": str(self.limit),
            "x-ratelimit-remaining-requests": str(self.remaining),
            "x-ratelimit-reset-requests": duration(self.reset_s),
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


@dataclass
class Limiter:
    """The request buckets of every (tenant, model) in use, in memory."""

    spec: QuotaSpec
    buckets: OrderedDict[tuple[str, str], Bucket] = field(default_factory=OrderedDict)

    def check(self, tenant: str, model: str, now: float, hits: int = 1) -> Decision:
        """Take `hits` requests from the bucket of `tenant` on `model` at `now`, if it has them."""
        limit = self.spec.limit(tenant, model, "requests_per_minute")
        if limit is None:
            return Decision(True, None)
        key = (tenant, model)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket(float(limit), now)
            while len(self.buckets) > MAX_BUCKETS:
                self.buckets.popitem(last=False)
        self.buckets.move_to_end(key)
        bucket.refill(limit, now)
        rate = limit / WINDOW_S
        allowed = bucket.level >= hits
        if allowed:
            bucket.level -= hits
        reset = (limit - bucket.level) / rate if rate > 0 else math.inf
        retry = 0.0 if allowed else ((hits - bucket.level) / rate if rate > 0 else WINDOW_S)
        return Decision(
            allowed,
            limit,
            remaining=max(0, math.floor(bucket.level)),
            reset_s=min(reset, WINDOW_S),
            retry_after_s=min(retry, WINDOW_S) if rate > 0 else WINDOW_S,
        )

    def use(self, tenant: str, model: str, now: float) -> tuple[int, int] | None:
        """(remaining, limit) of `tenant` on `model` at `now` without taking any, None when no
        limit applies."""
        limit = self.spec.limit(tenant, model, "requests_per_minute")
        if limit is None:
            return None
        bucket = self.buckets.get((tenant, model))
        if bucket is None:
            return limit, limit
        probe = Bucket(bucket.level, bucket.at)
        probe.refill(limit, now)
        return max(0, math.floor(probe.level)), limit
