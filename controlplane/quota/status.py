"""`controlplane.v1.QuotaService` (protos/controlplane/v1/quota.proto), served by the
rate-limit service beside Envoy's protocol: the buckets in use, a page at a time, for
`cpctl quota status`. Needs the bearer token of the service's --token-file.

In memory a page is the next `page_size` buckets in (tenant, model, kind) order after the
last one given; on Redis, SCAN batches from the cursor given (nothing sorted, nothing kept
between pages), each page's levels read in one pipelined round trip. Either way one call does
a bounded amount of work and sends a bounded answer (MAX_PAGE_SIZE buckets of names of at most
MAX_NAME_BYTES), whatever the number of tenants.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import hmac
import json
import time
from collections.abc import Iterable
from typing import Any, Protocol

import grpc

from controlplane.quota.limiter import KINDS, MAX_NAME_BYTES, Key, Limiter, decision, needed
from controlplane.quota.redis_store import RedisStore, RedisUnavailable
from controlplane.v1 import quota_pb2, quota_pb2_grpc

DEFAULT_PAGE_SIZE = 500
MAX_PAGE_SIZE = 1000
MAX_TOKEN_CHARS = 8192  # a page token this service gives is well under this


class PageTokenInvalid(ValueError):
    pass


def encode_token(value: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(value, separators=(",", ":")).encode()).decode()


def decode_token(token: str) -> dict[str, Any]:
    """The page token's content; PageTokenInvalid if this service could not have given it."""
    if len(token) > MAX_TOKEN_CHARS:
        raise PageTokenInvalid(f"longer than {MAX_TOKEN_CHARS} characters")
    try:
        value = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (ValueError, binascii.Error, UnicodeError):
        raise PageTokenInvalid("not a token this service gave (pass next_page_token as it came)") from None
    if not isinstance(value, dict):
        raise PageTokenInvalid("not a token this service gave (pass next_page_token as it came)")
    return value


def memory_page(
    keys: Iterable[Key], tenant: str | None, after: Key | None, size: int
) -> tuple[list[Key], bool]:
    """The first `size` keys in order after `after` (of `tenant` only, if given), and whether
    more follow (pure)."""
    chosen = (k for k in keys if (tenant is None or k[0] == tenant) and (after is None or k > after))
    page = heapq.nsmallest(size + 1, chosen)
    return page[:size], len(page) > size


def _after(value: Any) -> Key:
    if (
        not isinstance(value, list)
        or len(value) != 3
        or not all(isinstance(v, str) and len(v.encode()) <= MAX_NAME_BYTES for v in value)
    ):
        raise PageTokenInvalid("not a token this service gave (pass next_page_token as it came)")
    return value[0], value[1], value[2]


class Buckets(Protocol):
    """What the status reads of the rate-limit service (quota/service.py's RateLimitService)."""

    limiter: Limiter  # the quotas, and the buckets in memory
    store: RedisStore | None  # or the buckets on Redis
    token: str | None  # the bearer token a status call must send


class QuotaStatus(quota_pb2_grpc.QuotaServiceServicer):
    """The status calls of one rate-limit service."""

    def __init__(self, service: Buckets) -> None:
        self.service = service

    async def Status(
        self, request: quota_pb2.QuotaStatusRequest, context: Any
    ) -> quota_pb2.QuotaStatusResponse:
        token = self.service.token
        if token is None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "status needs a token: start controlplane ratelimit with --token-file",
            )
        given = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a wrong or missing bearer token")
        if len(request.tenant.encode()) > MAX_NAME_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tenant: longer than {MAX_NAME_BYTES} bytes (such a key is counted as the tenant 'invalid')",
            )
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        try:
            start = decode_token(request.page_token) if request.page_token else {}
            rows, next_token = await self.page(request.tenant or None, size, start)
        except PageTokenInvalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page_token: {e}")
        except RedisUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"Redis: {str(e)[:300]}")
        return quota_pb2.QuotaStatusResponse(buckets=rows, next_page_token=next_token)

    async def page(
        self, tenant: str | None, size: int, start: dict[str, Any]
    ) -> tuple[list[quota_pb2.QuotaBucket], str]:
        """One page of rows from `start` (a decoded token, {} for the first), and the token
        of the next ("" for none)."""
        store = self.service.store
        rows: list[quota_pb2.QuotaBucket] = []
        if store is None:
            if "cursor" in start:
                raise PageTokenInvalid("a token of a service on Redis")
            after = _after(start["after"]) if "after" in start else None
            now = time.monotonic()
            keys, more = memory_page(self.service.limiter.buckets, tenant, after, size)
            for who, model, kind in keys:
                level = self.service.limiter.level(who, model, now, kind)
                limit = self.service.limiter.limit(who, model, KINDS[kind])
                if level is not None and limit is not None:
                    rows.append(_row(who, model, kind, limit, level))
            return rows, encode_token({"after": list(keys[-1])}) if more and keys else ""
        if "after" in start:
            raise PageTokenInvalid("a token of a service in memory")
        cursor = start.get("cursor", 0)
        if not isinstance(cursor, int) or isinstance(cursor, bool) or cursor < 0:
            raise PageTokenInvalid("not a token this service gave (pass next_page_token as it came)")
        found, cursor = await store.scan(cursor, tenant, size)
        wanted = []
        for kind, model, who in dict.fromkeys(found):
            limit = self.service.limiter.limit(who, model, KINDS[kind])
            if limit is not None:
                wanted.append((kind, model, who, limit))
        if wanted:
            levels = await store.levels(wanted)
            rows = [
                _row(who, model, kind, limit, level)
                for (kind, model, who, limit), level in zip(wanted, levels, strict=True)
            ]
        return rows, encode_token({"cursor": cursor}) if cursor else ""


def _row(tenant: str, model: str, kind: str, limit: int, level: float) -> quota_pb2.QuotaBucket:
    d = decision(kind, limit, level, level > 0, needed(kind, 1))
    return quota_pb2.QuotaBucket(
        tenant=tenant,
        model=model,
        kind=kind,
        limit_per_minute=limit,
        remaining=d.remaining,
        reset_seconds=round(d.reset_s, 3),
    )
