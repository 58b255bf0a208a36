"""Quota buckets on a real redis-server (controlplane/quota/redis_store.py): every mode of the
Lua script (take, peek, charge, read), the refill by Redis's own clock, and `buckets`. The
server is started by the test on a free loopback port; without redis-server the tests skip
(they fail under CONTROLPLANE_REQUIRE_REDIS=1, as in CI)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterator

import pytest

from controlplane.quota.limiter import WINDOW_S
from controlplane.quota.redis_store import RedisStore, RedisUnavailable, bucket_key
from tests.integration.test_quotas import RedisServer
from tests.ports import free_port

# The store's own default (15 ms) is a production budget; a test on a busy 2-core machine
# must not read a slow answer as Redis being down.
TIMEOUT_S = 2.0
EPS = 1e-9  # float slack on exact bucket arithmetic


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


Body = Callable[[RedisStore], Awaitable[None]]


def on_redis(url: str, body: Body) -> None:
    """Run `body` with a store on an empty database, in its own event loop."""

    async def main() -> None:
        store = RedisStore(url, timeout_s=TIMEOUT_S)
        try:
            await store.client.flushdb()
            await body(store)
        finally:
            await store.client.flushdb()
            await store.close()

    asyncio.run(main())


async def redis_now(store: RedisStore) -> float:
    """Redis's clock (TIME), the one the script refills by."""
    seconds, micros = await store.client.time()
    return float(seconds) + float(micros) / 1e6


async def refill_since(store: RedisStore, since: float, limit: int) -> float:
    """The most a bucket of `limit` can have refilled since Redis's time `since`."""
    return (await redis_now(store) - since) * limit / WINDOW_S + EPS


def key(kind: str, model: str, tenant: str) -> str:
    return bucket_key(kind, model, tenant)


def test_peek_allows_while_the_level_is_above_zero_and_takes_nothing(redis_url: str) -> None:
    async def body(store: RedisStore) -> None:
        t0 = await redis_now(store)
        # A fresh bucket is full; a peek of 5 leaves it full (exactly: no time to refill).
        assert await store.apply("tokens", "chat", "acme", 10, 5, "peek") == (True, 10.0)
        assert await store.apply("tokens", "chat", "acme", 10, 5, "peek") == (True, 10.0)
        # Down to 0.5 (a charge): a peek of 5 is still allowed, and takes none of it.
        assert await store.apply("tokens", "chat", "acme", 10, 9.5, "charge") == (True, 0.5)
        for _ in range(3):
            allowed, level = await store.apply("tokens", "chat", "acme", 10, 5, "peek")
            assert allowed and 0.5 <= level <= 0.5 + await refill_since(store, t0, 10), level
        # Below zero: refused, and the peek does not take it lower.
        allowed, level = await store.apply("tokens", "chat", "acme", 10, 5, "charge")
        assert allowed and -4.5 <= level <= -4.5 + await refill_since(store, t0, 10), level
        allowed, peeked = await store.apply("tokens", "chat", "acme", 10, 5, "peek")
        assert not allowed and level <= peeked <= -4.5 + await refill_since(store, t0, 10), peeked
        stored = float(await store.client.hget(key("tokens", "chat", "acme"), "level"))
        assert stored == peeked

    on_redis(redis_url, body)


def test_charge_takes_down_to_minus_the_limit_and_no_further(redis_url: str) -> None:
    async def body(store: RedisStore) -> None:
        # Exact: each charge here is clamped, or the first on a fresh (full) bucket.
        assert await store.apply("tokens", "chat", "acme", 10, 4, "charge") == (True, 6.0)
        assert await store.apply("tokens", "chat", "acme", 10, 25, "charge") == (True, -10.0)
        assert await store.apply("tokens", "chat", "acme", 10, 1, "charge") == (True, -10.0)
        assert await store.apply("tokens", "chat", "acme", 10, 1000, "charge") == (True, -10.0)
        assert float(await store.client.hget(key("tokens", "chat", "acme"), "level")) == -10.0
        # In debt: nothing goes until the refill has paid it back.
        assert (await store.apply("tokens", "chat", "acme", 10, 1, "peek"))[0] is False
        assert (await store.apply("tokens", "chat", "acme", 10, 1, "take"))[0] is False
        # Another tenant's bucket is its own.
        assert await store.apply("tokens", "chat", "globex", 10, 3, "charge") == (True, 7.0)

    on_redis(redis_url, body)


def test_read_returns_the_level_and_writes_nothing(redis_url: str) -> None:
    async def body(store: RedisStore) -> None:
        # An unused bucket reads full, and reading it creates no key.
        assert await store.apply("tokens", "chat", "acme", 10, 0, "read") == (True, 10.0)
        assert await store.apply("requests", "chat", "acme", 6, 0, "read") == (True, 6.0)
        assert await store.client.dbsize() == 0
        t0 = await redis_now(store)
        assert await store.apply("requests", "chat", "acme", 10, 3, "take") == (True, 7.0)
        k = key("requests", "chat", "acme")
        # Let the expiry run down a little, so that a read setting it anew would show.
        full_ttl = math.ceil(2 * WINDOW_S) * 1000
        while (ttl := await store.client.pttl(k)) > full_ttl - 20:
            await asyncio.sleep(0.005)
        fields = await store.client.hgetall(k)
        for _ in range(3):
            allowed, level = await store.apply("requests", "chat", "acme", 10, 5, "read")
            assert allowed and 7.0 <= level <= 7.0 + await refill_since(store, t0, 10), level
        # Nothing written: not the level, not the time, not the expiry (a write sets it anew).
        assert await store.client.hgetall(k) == fields
        assert await store.client.pttl(k) <= ttl
        assert await store.client.dbsize() == 1
        # In debt, a read says so.
        await store.apply("tokens", "chat", "acme", 10, 25, "charge")
        allowed, level = await store.apply("tokens", "chat", "acme", 10, 0, "read")
        assert not allowed and -10.0 <= level < -9.0, level

    on_redis(redis_url, body)


def test_take_takes_whole_hits_or_none(redis_url: str) -> None:
    async def body(store: RedisStore) -> None:
        t0 = await redis_now(store)
        assert await store.apply("requests", "chat", "acme", 3, 2, "take") == (True, 1.0)
        allowed, level = await store.apply("requests", "chat", "acme", 3, 2, "take")
        assert not allowed and 1.0 <= level <= 1.0 + await refill_since(store, t0, 3), level
        allowed, level = await store.apply("requests", "chat", "acme", 3, 1, "take")
        assert allowed and 0.0 <= level <= await refill_since(store, t0, 3), level

    on_redis(redis_url, body)


def test_buckets_refill_by_redis_clock_at_the_limit_per_window(redis_url: str) -> None:
    """Emptied, a bucket of 60,000 a minute refills 1,000 a second: each read lies within what
    Redis's clock allows around it (no long sleep: the reads poll until it has risen by 100),
    and the refill stops at the limit."""
    limit = 60_000
    rate = limit / WINDOW_S

    async def body(store: RedisStore) -> None:
        before_take = await redis_now(store)
        assert await store.apply("requests", "chat", "acme", limit, limit, "take") == (True, 0.0)
        after_take = await redis_now(store)
        seen: list[float] = []
        deadline = asyncio.get_running_loop().time() + 10
        while not seen or seen[-1] < 100:  # 0.1 s of refill
            assert asyncio.get_running_loop().time() < deadline, seen[-5:]
            before_read = await redis_now(store)
            allowed, level = await store.apply("requests", "chat", "acme", limit, 0, "read")
            after_read = await redis_now(store)
            assert (before_read - after_take) * rate - 1e-6 <= level, (level, seen)
            assert level <= (after_read - before_take) * rate + 1e-6, (level, seen)
            assert allowed == (level > 0)
            seen.append(level)
            await asyncio.sleep(0.005)
        assert seen == sorted(seen), seen  # only ever up
        # A full bucket taken from is whole again 1 ms per hit later, and never fuller.
        assert await store.apply("requests", "chat", "globex", limit, 50, "take") == (True, limit - 50.0)
        deadline = asyncio.get_running_loop().time() + 10
        while (level := (await store.apply("requests", "chat", "globex", limit, 0, "read"))[1]) < limit:
            assert asyncio.get_running_loop().time() < deadline, level
            await asyncio.sleep(0.005)
        assert level == float(limit)
        assert await store.apply("requests", "chat", "globex", limit, 0, "peek") == (True, float(limit))
        # A written bucket expires two windows after its last write (full again by then).
        ttl = await store.client.pttl(key("requests", "chat", "globex"))
        assert 2 * WINDOW_S * 1000 - 5000 < ttl <= math.ceil(2 * WINDOW_S) * 1000, ttl

    on_redis(redis_url, body)


def test_buckets_lists_every_bucket_and_filters_by_tenant(redis_url: str) -> None:
    async def body(store: RedisStore) -> None:
        assert await store.buckets(None) == []
        await store.apply("requests", "chat", "acme", 6, 1, "take")
        await store.apply("tokens", "chat", "acme", 100, 10, "peek")
        await store.apply("tokens", "big", "acme", 100, 10, "charge")
        await store.apply("requests", "chat", "acme2", 6, 1, "take")  # not acme's
        await store.apply("requests", "chat", "team:a", 6, 1, "take")  # a tenant with colons
        await store.apply("requests", "chat", "initech", 6, 0, "read")  # read: no bucket
        await store.client.set("other:key", "x")  # not a bucket
        acme = [("requests", "chat", "acme"), ("tokens", "big", "acme"), ("tokens", "chat", "acme")]
        assert await store.buckets("acme") == acme
        assert await store.buckets("team:a") == [("requests", "chat", "team:a")]
        assert await store.buckets("initech") == []
        assert await store.buckets(None) == sorted(
            [*acme, ("requests", "chat", "acme2"), ("requests", "chat", "team:a")]
        )
        # More buckets than one SCAN page (1000): every one is listed.
        many = [f"t{i:04d}" for i in range(2500)]
        for i in range(0, len(many), 100):  # within the client's connection pool
            await asyncio.gather(
                *(store.apply("requests", "chat", t, 6, 1, "take") for t in many[i : i + 100])
            )
        listed = await store.buckets(None)
        assert len(listed) == 2500 + 5
        assert {t for _, _, t in listed} >= set(many)
        assert await store.buckets("t1234") == [("requests", "chat", "t1234")]

    on_redis(redis_url, body)


def test_redis_unreachable_is_redis_unavailable() -> None:
    async def body() -> None:
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=TIMEOUT_S)
        try:
            with pytest.raises(RedisUnavailable):
                await store.apply("requests", "chat", "acme", 6, 1, "take")
            with pytest.raises(RedisUnavailable):
                await store.buckets(None)
        finally:
            await store.close()

    asyncio.run(body())
