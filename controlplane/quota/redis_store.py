"""Quota buckets on Redis, shared by every rate-limit service that points at it (so by every
control-plane replica's): the same buckets as quota/limiter.py's, each updated atomically by
one Lua script on the Redis server, with the server's clock (the services' clocks never meet).

A bucket is a hash {level, at} under `quota2:<kind>:<model>:<tenant>`, each name
percent-encoded (`bucket_key`: every byte but letters, digits and `-._~` is `%XX`), so no ':'
in a name can make two buckets one, and the status parses every key back exactly
(`parse_bucket_key`). It expires two minutes after its last use (a full bucket needs no key).
Keys of the old scheme (`quota:<kind>:<model>:<tenant>`, names joined raw) are neither read
nor listed; they expire on their own within two minutes of the upgrade. Redis unreachable or
slow past its timeout: the caller gets RedisUnavailable and answers as if no limit applied
(fail open), counted.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote, unquote

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from controlplane.quota.limiter import WINDOW_S

PREFIX = "quota2:"
KINDS = ("requests", "tokens")

# KEYS[1]: the bucket. ARGV: limit, hits, mode (take: requests; peek: is anything left;
# charge: take hits, down to -limit; read: the level now, nothing written), window seconds.
# Returns {allowed 0/1, level after}.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit = tonumber(ARGV[1])
local hits = tonumber(ARGV[2])
local mode = ARGV[3]
local window = tonumber(ARGV[4])
local v = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(v[1]) or limit
local at = tonumber(v[2]) or now
if now > at then
  level = math.min(limit, level + (now - at) * limit / window)
  at = now
end
local allowed = 1
if mode == 'read' then
  if level <= 0 then allowed = 0 end
  return {allowed, tostring(level)}
end
if mode == 'take' then
  if level >= hits then level = level - hits else allowed = 0 end
elseif mode == 'peek' then
  if level <= 0 then allowed = 0 end
else
  level = math.max(-limit, level - hits)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(at))
redis.call('EXPIRE', KEYS[1], math.ceil(2 * window))
return {allowed, tostring(level)}
"""

# The status's read of one page: KEYS, the buckets; ARGV[1] the window, ARGV[1 + i] the limit
# of KEYS[i]. Returns each level now (a bucket gone is full), nothing written.
_READ_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = tonumber(ARGV[1])
local out = {}
for i, key in ipairs(KEYS) do
  local limit = tonumber(ARGV[i + 1])
  local v = redis.call('HMGET', key, 'level', 'at')
  local level = tonumber(v[1]) or limit
  local at = tonumber(v[2]) or now
  if now > at then
    level = math.min(limit, level + (now - at) * limit / window)
  end
  out[i] = tostring(level)
end
return out
"""


def _encode(name: str) -> str:
    return quote(name, safe="", errors="surrogatepass")


def bucket_key(kind: str, model: str, tenant: str) -> str:
    """The Redis key of a bucket; a different (kind, model, tenant) never gives the same key."""
    return f"{PREFIX}{kind}:{_encode(model)}:{_encode(tenant)}"


_PLAIN = re.compile(r"[A-Za-z0-9._~-]*")  # a name `_encode` leaves as it is


def _decode(part: str) -> str | None:
    """The name `_encode` made `part` from; None if it made no such part (bytes left
    unencoded, lower-case or broken escapes, a name encoded twice)."""
    if _PLAIN.fullmatch(part):
        return part
    name = unquote(part, errors="surrogatepass")
    return name if _encode(name) == part else None


def parse_bucket_key(key: str) -> tuple[str, str, str] | None:
    """(kind, model, tenant) of a key `bucket_key` made; None for any other key."""
    if not key.startswith(PREFIX):
        return None
    parts = key[len(PREFIX) :].split(":")
    if len(parts) != 3 or parts[0] not in KINDS:
        return None
    model, tenant = _decode(parts[1]), _decode(parts[2])
    if model is None or tenant is None:
        return None
    return parts[0], model, tenant


class RedisUnavailable(Exception):
    """Redis did not answer (down, refused, slow past the timeout)."""


class RedisStore:
    """`timeout_s` bounds each decision's wait for Redis (a request waits on it);
    `status_timeout_s` each status page's (a SCAN batch, a pipelined read of a page)."""

    def __init__(self, url: str, timeout_s: float = 0.015, status_timeout_s: float = 2.0) -> None:
        self.url = url
        self.client: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        self.script = self.client.register_script(_SCRIPT)
        self.status_client: Any = aioredis.Redis.from_url(
            url,
            socket_timeout=status_timeout_s,
            socket_connect_timeout=status_timeout_s,
            decode_responses=True,
            max_connections=4,
        )
        self.read_script = self.status_client.register_script(_READ_SCRIPT)

    async def apply(
        self, kind: str, model: str, tenant: str, limit: int, hits: float, mode: str
    ) -> tuple[bool, float]:
        """One bucket operation: (allowed, level after)."""
        try:
            allowed, level = await self.script(
                keys=[bucket_key(kind, model, tenant)], args=[limit, hits, mode, WINDOW_S]
            )
        except (RedisError, OSError, TimeoutError) as e:
            raise RedisUnavailable(str(e)) from e
        return bool(int(allowed)), float(level)

    async def scan(
        self, cursor: int, tenant: str | None, want: int, max_calls: int = 64
    ) -> tuple[list[tuple[str, str, str]], int]:
        """One page of bucket names from SCAN `cursor`: SCAN calls (COUNT `want`) until at least
        `want` buckets or `max_calls` calls; (kind, model, tenant) each, and the cursor to go on
        from (0: the keyspace is done). SCAN may give a key twice across pages (Redis's rule);
        every key there throughout is given at least once."""
        match = f"{PREFIX}*" if tenant is None else f"{PREFIX}*:*:{_encode(tenant)}"
        out: list[tuple[str, str, str]] = []
        try:
            for _ in range(max_calls):
                cursor, keys = await self.status_client.scan(cursor=cursor, match=match, count=want)
                for key in keys:
                    parsed = parse_bucket_key(key)
                    if parsed is not None and (tenant is None or parsed[2] == tenant):
                        out.append(parsed)
                if cursor == 0 or len(out) >= want:
                    break
        except (RedisError, OSError, TimeoutError) as e:
            raise RedisUnavailable(str(e)) from e
        return out, int(cursor)

    async def levels(self, buckets: list[tuple[str, str, str, int]]) -> list[float]:
        """The level now of each (kind, model, tenant, limit), by Redis's clock, read in one
        script call (one round trip for the page), nothing written; a bucket gone is full."""
        if not buckets:
            return []
        keys = [bucket_key(kind, model, tenant) for kind, model, tenant, _ in buckets]
        try:
            got = await self.read_script(keys=keys, args=[WINDOW_S, *(limit for *_, limit in buckets)])
        except (RedisError, OSError, TimeoutError) as e:
            raise RedisUnavailable(str(e)) from e
        return [float(level) for level in got]

    async def buckets(self, tenant: str | None) -> list[tuple[str, str, str]]:
        """(kind, model, tenant) of every bucket in use, or of one tenant's (every page)."""
        out: set[tuple[str, str, str]] = set()
        cursor = 0
        while True:
            page, cursor = await self.scan(cursor, tenant, 1000)
            out.update(page)
            if cursor == 0:
                return sorted(out)

    async def close(self) -> None:
        await self.client.aclose()
        await self.status_client.aclose()
