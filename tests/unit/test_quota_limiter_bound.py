"""The memory store's bound (quota/limiter.py, pure): at most MAX_BUCKETS buckets and
MAX_BUCKET_BYTES bytes, and only a bucket that is full anyway is dropped to make room, so
pressure from other tenants never hands a spent tenant a refill (issue 41, finding 2); with no
full bucket to drop a new tenant is refused (`crowded`), and a tenant the fleet names, on a
model it has, always gets its bucket."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.fleet.model import QuotaLimit, QuotaSpec
from controlplane.quota.limiter import (
    BUCKET_BASE_BYTES,
    INVALID,
    MAX_BUCKETS,
    MAX_NAME_BYTES,
    Limiter,
    bounded_name,
)

SERVICE = (("127.0.0.1", 1),)


def spec(default: int = 1000, tokens: int | None = None, **tenants: int) -> QuotaSpec:
    return QuotaSpec(
        default=QuotaLimit(requests_per_minute=default, tokens_per_minute=tokens),
        tenants={t: QuotaLimit(requests_per_minute=n) for t, n in tenants.items()},
        endpoints=SERVICE,
    )


def test_a_flood_of_105000_tenants_does_not_refill_a_spent_bucket() -> None:
    """The finding, in the pure limiter at its real bound: acme spends its 6, then 105,000
    other tenants each take one request (their buckets full again 0.06 s later). Before, the
    least recently used bucket went first, acme's among them, and came back full."""
    limiter = Limiter(spec(acme=6))
    assert [limiter.check("acme", "chat", now=0.0).allowed for _ in range(7)] == [True] * 6 + [False]
    now = 0.0
    for i in range(105_000):
        now += 0.0001  # 10.5 s in all: acme refills 1 of its 6 in 10 s
        assert limiter.check(f"t{i}", "chat", now=now).allowed
    assert len(limiter.buckets) <= MAX_BUCKETS
    assert limiter.evicted >= 5_000 and limiter.refused == 0
    after = limiter.check("acme", "chat", now=now)
    assert after.remaining == 0 and after.allowed  # one back from the refill, not six
    assert not limiter.check("acme", "chat", now=now).allowed


def test_with_no_full_bucket_a_new_tenant_is_refused_until_one_is_whole() -> None:
    limiter = Limiter(spec(default=1, globex=5), models=frozenset({"chat"}), max_buckets=3)
    assert all(limiter.check(t, "chat", now=0.0).allowed for t in ("a", "b", "c"))  # each spent for 60 s
    got = limiter.check("d", "chat", now=1.0)
    assert not got.allowed and got.crowded and got.limit == 1
    assert got.headers()["retry-after"] == "59"  # a's bucket is whole at 60 s
    assert limiter.refused == 1 and ("d", "chat", "requests") not in limiter.buckets
    assert limiter.check("globex", "chat", now=1.0).allowed  # named, on a model the fleet has
    assert not limiter.check("globex", "model-x", now=1.0).allowed  # named, but not a fleet model
    assert len(limiter.buckets) == 4  # the named tenant's beyond the bound
    got = limiter.check("d", "chat", now=60.0)  # a's is full (and globex's): dropped for d's
    assert got.allowed and limiter.evicted == 2
    assert set(limiter.buckets) == {
        ("b", "chat", "requests"),
        ("c", "chat", "requests"),
        ("d", "chat", "requests"),
    }


def test_the_bound_is_in_bytes_too() -> None:
    long_name = "t" * MAX_NAME_BYTES
    per_bucket = BUCKET_BASE_BYTES + MAX_NAME_BYTES + len("chat")
    limiter = Limiter(spec(default=1), max_bytes=10 * per_bucket)
    for i in range(12):
        limiter.check(f"{i:03d}{long_name[3:]}", "chat", now=0.0)
    assert len(limiter.buckets) == 10 and limiter.bytes <= 10 * per_bucket
    assert limiter.refused == 2
    short = Limiter(spec(default=1), max_bytes=10 * per_bucket)
    for i in range(12):
        short.check(f"t{i}", "chat", now=0.0)
    assert len(short.buckets) == 12  # the same bytes hold more short names


def test_a_raised_limit_makes_a_bucket_not_full_and_it_is_kept() -> None:
    limiter = Limiter(spec(default=2), max_buckets=1)
    limiter.check("a", "chat", now=0.0)  # 1 of 2: whole at 30 s
    limiter.spec = spec(default=100)  # a reload: 1 of 100, whole at 59.4 s
    got = limiter.check("b", "chat", now=31.0)
    assert got.crowded and ("a", "chat", "requests") in limiter.buckets  # not full under the new limit
    level = limiter.level("a", "chat", now=31.0)
    assert level is not None and 50.0 < level < 100.0
    assert math.isclose(limiter.room_in(31.0), 59.4 - 31.0)
    assert limiter.check("b", "chat", now=59.5).allowed and limiter.evicted == 1


def test_charges_and_token_checks_keep_to_the_bound() -> None:
    limiter = Limiter(spec(default=100, tokens=1000), max_buckets=2)
    assert limiter.check("a", "chat", now=0.0, kind="tokens").allowed
    assert limiter.charge("a", "chat", 5000, now=0.1) == -1000  # in debt, down to -limit
    assert limiter.check("b", "chat", now=0.2).allowed
    assert limiter.charge("c", "chat", 10, now=0.3) is None  # no room: not recorded (the service counts it)
    assert limiter.check("c", "chat", now=0.3, kind="tokens").crowded


def test_names_past_the_cap_are_one_name() -> None:
    assert bounded_name("acme") == ("acme", False)
    assert bounded_name("a" * MAX_NAME_BYTES) == ("a" * MAX_NAME_BYTES, False)
    assert bounded_name("a" * (MAX_NAME_BYTES + 1)) == (INVALID, True)
    assert bounded_name("é" * (MAX_NAME_BYTES // 2 + 1)) == (INVALID, True)  # bytes, not characters
    assert bounded_name("\ud800" * 300) == (INVALID, True)  # a lone surrogate is no crash


Op = tuple[str, int, float, int]  # (what, tenant, gap, tokens)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(
        st.tuples(
            st.sampled_from(["request", "tokens", "charge"]),
            st.integers(0, 9),
            st.floats(0, 30),
            st.integers(0, 50),
        ),
        min_size=1,
        max_size=120,
    ),
)
def test_bounded_answers_are_the_unbounded_ones_or_a_crowded_refusal(bound: int, ops: list[Op]) -> None:
    """Against a limiter without a bound: every answer is the same, except a `crowded` refusal;
    after one the tenant's bucket is as the unbounded one's would be had that call not come
    (the reference is kept in step by not making it). No bucket ever holds more than its
    unbounded twin: an eviction never refills anything."""
    q = spec(default=4, tokens=40)
    bounded = Limiter(q, max_buckets=bound)
    free = Limiter(q, max_buckets=10**9)
    now = 0.0
    for what, who, gap, tokens in ops:
        now += gap
        tenant = f"t{who}"
        if what == "charge":
            got = bounded.charge(tenant, "chat", tokens, now)
            if got is not None:
                assert got == free.charge(tenant, "chat", tokens, now)
            continue
        kind = "requests" if what == "request" else "tokens"
        mine = bounded.check(tenant, "chat", now, kind=kind)
        if mine.crowded:
            assert len(bounded.buckets) >= bound and not mine.allowed
            continue
        theirs = free.check(tenant, "chat", now, kind=kind)
        assert (mine.allowed, mine.remaining) == (theirs.allowed, theirs.remaining)
        assert len(bounded.buckets) <= bound
    for key in bounded.buckets:
        level = bounded.level(key[0], key[1], now, key[2])
        twin = free.level(key[0], key[1], now, key[2])
        assert level is not None and twin is not None and math.isclose(level, twin, abs_tol=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0, 5)), min_size=1, max_size=300))
def test_counted_bytes_are_the_sum_of_the_buckets_and_never_over_the_bound(
    ops: list[tuple[int, float]],
) -> None:
    limiter = Limiter(spec(default=2), max_buckets=10**6, max_bytes=8 * (BUCKET_BASE_BYTES + 8))
    now = 0.0
    for who, gap in ops:
        now += gap
        limiter.check(f"tenant{who}", "chat", now)
        assert limiter.bytes == sum(b.cost for b in limiter.buckets.values())
        assert limiter.bytes <= limiter.max_bytes
