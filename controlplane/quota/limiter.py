"""Pure: per-tenant, per-model request and token quotas as buckets, and the answer a client gets.

Each (tenant, model, kind) has a bucket of `limit` units that refills continuously at
limit / 60 per second: a tenant that keeps to its per-minute limit is never refused, one that
bursts gets the whole minute's allowance at once and then the refill rate. A request takes
one unit; without one it is over the limit. The answer carries what OpenAI's API sends with
every response (`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
`x-ratelimit-reset-requests`: the time until the bucket is full again) and, over the limit,
`retry-after`: the time until one unit is back.

The buckets in memory are bounded in count and in bytes, and a bucket is dropped only when it
is full anyway (a full bucket and no bucket are the same thing): pressure from other tenants
can never hand a spent tenant a fresh allowance. At the bound, with no full bucket to drop, a
new bucket is refused (`Decision.crowded`): the request is over the limit until the earliest
bucket is full again. A tenant the fleet file names, on a model the fleet has, always gets its
bucket (those are bounded by the file).

A request without the key header is the tenant "" (anonymous): the default limits apply, as
to every tenant the fleet does not name. A model or tenant name longer than MAX_NAME_BYTES is
the one name INVALID (`bounded_name`). Nothing here does I/O; quota/service.py answers Envoy's
rate-limit calls with it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from controlplane.fleet.model import QuotaSpec

WINDOW_S = 60.0
MAX_BUCKETS = 100_000  # buckets kept in memory (each (tenant, model, kind) in use)
MAX_BUCKET_BYTES = 64 * 1024 * 1024  # and their bytes, as BUCKET_BASE_BYTES + the names' bytes
BUCKET_BASE_BYTES = (
    512  # a bucket's own objects: its key, its state, its dict and heap slots (measured: ~480)
)
MAX_NAME_BYTES = 256  # a longer model or tenant name is not a name: it is counted as INVALID
INVALID = "invalid"

Key = tuple[str, str, str]  # (tenant, model, kind): a tuple, so no two names can collide


def bounded_name(value: str) -> tuple[str, bool]:
    """`value`, or INVALID when it is longer than MAX_NAME_BYTES in UTF-8; and whether it was
    (the caller counts it). Every name the service keeps, labels or stores went through here."""
    if len(value) > MAX_NAME_BYTES or len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return INVALID, True
    return value, False


@dataclass(slots=True)
class Bucket:
    level: float
    at: float
    cost: int = 0  # the bytes it is counted for
    seq: int = 0  # which heap entry is its current one

    def refill(self, limit: int, now: float) -> None:
        if now > self.at:
            self.level = min(float(limit), self.level + (now - self.at) * limit / WINDOW_S)
            self.at = now

    def full_at(self, limit: int) -> float:
        """When the refill makes it whole (now or earlier: it is full)."""
        if limit <= 0 or self.level >= limit:
            return self.at
        return self.at + (limit - self.level) * WINDOW_S / limit


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
    crowded: bool = False  # refused: no room for a new bucket (MAX_BUCKETS or MAX_BUCKET_BYTES)

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


def crowded(kind: str, limit: int, wait_s: float) -> Decision:
    """The answer when there is no room for the request's bucket: over the limit until the
    earliest bucket in memory is full again (`wait_s`), which makes room."""
    wait = min(max(wait_s, 1.0), WINDOW_S)
    return Decision(False, limit, remaining=0, reset_s=wait, retry_after_s=wait, kind=kind, crowded=True)


@dataclass
class Limiter:
    """The buckets of every (tenant, model, kind) in use, in memory.

    Requests are taken before a request goes (one each; none left: refused). Tokens are
    known only when the response ends: a request is let through while the tenant's token
    bucket is not empty, and its tokens are charged when it ends (`charge`), which may take
    the bucket below zero; the debt is repaid by the refill before the next request goes, so
    over a window a tenant gets its limit plus at most one response's tokens. The debt is
    bounded by one minute's allowance.

    At most `max_buckets` buckets and `max_bytes` bytes: a full bucket is dropped to make room
    (a min-heap of the times buckets are whole again finds one), a spent one never is."""

    spec: QuotaSpec
    models: frozenset[str] = frozenset()  # the fleet's models: a named tenant on one always gets room
    # The adapters quotas.models names, each to its base model (routing/quotas.limited_adapters):
    # buckets of their own, under the adapter's name, with the adapter's own limits only.
    adapters: Mapping[str, str] = field(default_factory=dict)
    max_buckets: int = MAX_BUCKETS
    max_bytes: int = MAX_BUCKET_BYTES
    buckets: dict[Key, Bucket] = field(default_factory=dict)
    bytes: int = 0  # of the buckets, as counted
    evicted: int = 0  # full buckets dropped to make room
    refused: int = 0  # new buckets refused for want of room
    _heap: list[tuple[float, int, Key]] = field(default_factory=list)
    _seq: int = 0

    def limit(self, tenant: str, model: str, kind: str) -> int | None:
        """The per-minute limit of `kind` for `tenant` on `model` (QuotaSpec.limit); on an
        adapter with limits of its own, its own levels only (its tenant, then its default):
        the base model's limits are its base model's descriptor's, never counted twice."""
        if model not in self.adapters:
            return self.spec.limit(tenant, model, kind)
        adapter_default, adapter_tenants = self.spec.models.get(model, (None, {}))
        for level in (adapter_tenants.get(tenant), adapter_default):
            if level is not None and getattr(level, kind) is not None:
                return int(getattr(level, kind))
        return None

    # ---- the bound ----------------------------------------------------------------------------

    def _push(self, key: Key, bucket: Bucket, limit: int) -> None:
        """Record when `bucket` is whole again; its earlier entries go stale."""
        self._seq += 1
        bucket.seq = self._seq
        heapq.heappush(self._heap, (bucket.full_at(limit), self._seq, key))
        if len(self._heap) > 2 * len(self.buckets) + 1024:  # stale entries: rebuild, amortised O(1)
            self._heap = [(t, s, k) for t, s, k in self._heap if (b := self.buckets.get(k)) and b.seq == s]
            heapq.heapify(self._heap)

    def _earliest(self) -> tuple[float, int, Key] | None:
        """The current heap entry of the bucket that is whole first, stale ones dropped."""
        while self._heap:
            at, seq, key = self._heap[0]
            bucket = self.buckets.get(key)
            if bucket is not None and bucket.seq == seq:
                return at, seq, key
            heapq.heappop(self._heap)
        return None

    def _evict_one(self, now: float) -> bool:
        """Drop one bucket that is full at `now`, if there is one."""
        while (top := self._earliest()) is not None and top[0] <= now:
            heapq.heappop(self._heap)
            key = top[2]
            bucket = self.buckets[key]
            limit = self.limit(key[0], key[1], KINDS[key[2]])
            if limit is not None:
                bucket.refill(limit, now)
                if bucket.level < limit:  # its limit was raised since: not full yet
                    self._push(key, bucket, limit)
                    continue
            del self.buckets[key]
            self.bytes -= bucket.cost
            self.evicted += 1
            return True
        return False

    def room_in(self, now: float) -> float:
        """Seconds until the earliest bucket is full again (and could make room)."""
        top = self._earliest()
        return WINDOW_S if top is None else max(0.0, top[0] - now)

    def named(self, tenant: str, model: str) -> bool:
        """A tenant the fleet file names, on a model the fleet has: bounded by the file, always
        given a bucket."""
        if model not in self.models and model not in self.adapters:
            return False
        if tenant in self.spec.tenants:
            return True
        return model in self.spec.models and tenant in self.spec.models[model][1]

    def _bucket(self, tenant: str, model: str, kind: str, limit: int, now: float) -> Bucket | None:
        """The bucket, refilled to `now`; a new one (full) if there is room, else None."""
        key = (tenant, model, kind)
        bucket = self.buckets.get(key)
        if bucket is not None:
            bucket.refill(limit, now)
            return bucket
        cost = BUCKET_BASE_BYTES + len(tenant.encode("utf-8", "surrogatepass")) + len(model.encode())
        while len(self.buckets) >= self.max_buckets or self.bytes + cost > self.max_bytes:
            if not self._evict_one(now):
                if not self.named(tenant, model):
                    self.refused += 1
                    return None
                break
        bucket = self.buckets[key] = Bucket(float(limit), now, cost)
        self.bytes += cost
        self._push(key, bucket, limit)
        return bucket

    # ---- decisions ----------------------------------------------------------------------------

    def check(
        self, tenant: str, model: str, now: float, hits: int = 1, kind: str = "requests", take: bool = True
    ) -> Decision:
        """Requests: take `hits` from the bucket of `tenant` on `model` at `now`, if it has them
        (`take` false: only whether it has them, nothing taken, no bucket made). Tokens:
        allowed while the bucket is above zero; nothing is taken (see charge). No room for a
        new bucket: refused (`crowded`)."""
        limit = self.limit(tenant, model, KINDS[kind])
        if limit is None:
            return Decision(True, None, kind=kind)
        if not take:
            level = self.level(tenant, model, now, kind)
            assert level is not None
            need = needed(kind, hits)
            return decision(kind, limit, level, level >= need, need)
        bucket = self._bucket(tenant, model, kind, limit, now)
        if bucket is None:
            return crowded(kind, limit, self.room_in(now))
        need = needed(kind, hits)
        allowed = bucket.level >= need
        if allowed and kind == "requests":
            bucket.level -= hits
            self._push((tenant, model, kind), bucket, limit)
        return decision(kind, limit, bucket.level, allowed, need)

    def charge(self, tenant: str, model: str, tokens: int, now: float) -> int | None:
        """Take `tokens` (a response's usage) from the token bucket of `tenant` on `model`;
        the level after. None when no token limit applies, or when there is no room for the
        bucket (the request's own check made it: it was dropped only if full, and the charge
        found the store crowded since; the service counts it)."""
        limit = self.limit(tenant, model, "tokens_per_minute")
        if limit is None:
            return None
        bucket = self._bucket(tenant, model, "tokens", limit, now)
        if bucket is None:
            return None
        bucket.level = max(-float(limit), bucket.level - max(0, tokens))
        self._push((tenant, model, "tokens"), bucket, limit)
        return math.floor(bucket.level)

    def use(self, tenant: str, model: str, now: float, kind: str = "requests") -> tuple[int, int] | None:
        """(remaining, limit) of `tenant` on `model` at `now` without taking any, None when no
        limit applies."""
        level = self.level(tenant, model, now, kind)
        limit = self.limit(tenant, model, KINDS[kind])
        if level is None or limit is None:
            return None
        return max(0, math.floor(level)), limit

    def level(self, tenant: str, model: str, now: float, kind: str = "requests") -> float | None:
        """The bucket's level at `now` (a bucket not kept is full), without changing it; None
        when no limit applies."""
        limit = self.limit(tenant, model, KINDS[kind])
        if limit is None:
            return None
        bucket = self.buckets.get((tenant, model, kind))
        if bucket is None:
            return float(limit)
        probe = Bucket(bucket.level, bucket.at)
        probe.refill(limit, now)
        return probe.level
