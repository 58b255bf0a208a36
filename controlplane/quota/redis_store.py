"""Quota buckets on Redis, shared by every rate-limit service that points at it (so by every
control-plane replica's): the same buckets as quota/limiter.py's, each updated atomically by
one Lua script on the Redis server, with the server's clock (the services' clocks never meet).

A bucket is a hash {level, at} under `quota:<kind>:<model>:<tenant>`, expiring two minutes
after its last use (a full bucket needs no key). Redis unreachable or slow past its timeout:
the caller gets RedisUnavailable and answers as if no limit applied (fail open), counted.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from controlplane.quota.limiter import WINDOW_S

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


class RedisUnavailable(Exception):
    """Redis did not answer (down, refused, slow past the timeout)."""


class RedisStore:
    def __init__(self, url: str, timeout_s: float = 0.015) -> None:
        self.url = url
        self.client: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        self.script = self.client.register_script(_SCRIPT)

    async def apply(
        self, kind: str, model: str, tenant: str, limit: int, hits: float, mode: str
    ) -> tuple[bool, float]:
        """One bucket operation: (allowed, level after)."""
        key = f"quota:{kind}:{model}:{tenant}"
        try:
            allowed, level = await self.script(keys=[key], args=[limit, hits, mode, WINDOW_S])
        except (RedisError, OSError, TimeoutError) as e:
            raise RedisUnavailable(str(e)) from e
        return bool(int(allowed)), float(level)

    async def buckets(self, tenant: str | None) -> list[tuple[str, str, str]]:
        """(kind, model, tenant) of every bucket in use, or of one tenant's."""
        out = []
        try:
            async for key in self.client.scan_iter(match="quota:*", count=1000):
                parts = key.split(":", 3)
                if len(parts) == 4 and (tenant is None or parts[3] == tenant):
                    out.append((parts[1], parts[2], parts[3]))
        except (RedisError, OSError, TimeoutError) as e:
            raise RedisUnavailable(str(e)) from e
        return sorted(out)

    async def close(self) -> None:
        await self.client.aclose()
