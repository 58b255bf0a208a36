"""flow/queue.py: who leaves the queue next, who is shed, who waited too long (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.flow.queue import FlowQueue, Waiting


def w(
    id: int,
    rank: int = 1,
    tenant: str = "a",
    at: float = 0.0,
    wait: float = 10.0,
    size: int = 0,
    tokens: int = 0,
) -> Waiting:
    return Waiting(id, rank, tenant, at, at + wait, size, tokens)


def drain(q: FlowQueue) -> list[int]:
    out = []
    while (x := q.pop()) is not None:
        out.append(x.id)
    return out


def test_a_higher_class_leaves_first_then_arrival() -> None:
    q = FlowQueue()
    for i, rank in enumerate([2, 1, 0, 1, 0, 2]):
        assert q.push(w(i, rank, at=float(i))) == []
    assert drain(q) == [2, 4, 1, 3, 0, 5]


def test_tenants_of_a_class_share_by_the_tokens_they_were_served() -> None:
    q = FlowQueue()
    # heavy sends ten requests, then light sends one: light does not wait behind all ten
    for i in range(10):
        q.push(w(i, tenant="heavy", at=float(i), tokens=100))
    q.push(w(10, tenant="light", at=10.0, tokens=100))
    first = [q.pop().id for _ in range(3)]  # type: ignore[union-attr]
    assert 10 in first[:2], first
    # a tenant charged more (its output) waits behind one charged less
    q = FlowQueue()
    q.push(w(0, tenant="a", tokens=10))
    q.push(w(1, tenant="b", tokens=10))
    q.charge("a", 1000)
    assert q.pop().id == 1  # type: ignore[union-attr]


def test_idleness_banks_no_credit() -> None:
    q = FlowQueue()
    for i in range(5):  # busy serves 5 x 100 tokens while idle sends nothing
        q.push(w(i, tenant="busy", tokens=100))
        assert q.pop().tenant == "busy"  # type: ignore[union-attr]
    # idle comes back with a burst: it is lifted to the counter last served, not left at 0,
    # so it takes turns with busy instead of going 5 times in a row
    for i in range(5):
        q.push(w(10 + i, tenant="idle", at=1.0, tokens=100))
        q.push(w(20 + i, tenant="busy", at=1.0, tokens=100))
    order = [q.pop().tenant for _ in range(4)]  # type: ignore[union-attr]
    assert order.count("idle") == 2, order


def test_a_full_queue_sheds_the_newest_of_the_lowest_class() -> None:
    q = FlowQueue(max_requests=3)
    q.push(w(0, rank=2, at=0.0))
    q.push(w(1, rank=2, at=1.0))
    q.push(w(2, rank=1, at=2.0))
    assert q.push(w(3, rank=0, at=3.0)) == [w(1, rank=2, at=1.0)]  # premium in, the newest batch out
    assert q.push(w(4, rank=2, at=4.0)) == [w(4, rank=2, at=4.0)]  # batch into a full queue: itself
    assert q.push(w(5, rank=1, at=5.0)) == [w(0, rank=2, at=0.0)]
    assert q.push(w(6, rank=1, at=6.0)) == [w(6, rank=1, at=6.0)]  # only its class or higher wait
    assert drain(q) == [3, 2, 5]


def test_the_byte_bound_and_a_request_larger_than_it() -> None:
    q = FlowQueue(max_bytes=100)
    assert q.push(w(0, rank=2, size=60)) == []
    assert q.push(w(1, rank=1, size=101)) == [w(1, rank=1, size=101)]
    assert q.push(w(2, rank=1, size=50)) == [w(0, rank=2, size=60)]
    assert q.bytes == 50
    # shedding every lower request would not make room: nothing else is shed
    q.push(w(3, rank=2, size=10))
    assert q.push(w(4, rank=1, size=70)) == [w(4, rank=1, size=70)]
    assert len(q) == 2 and q.bytes == 60


def test_deadlines_and_removal() -> None:
    q = FlowQueue()
    q.push(w(0, at=0.0, wait=5.0))
    q.push(w(1, at=0.0, wait=1.0))
    q.push(w(2, at=0.0, wait=3.0))
    assert q.next_deadline() == 1.0
    assert [x.id for x in q.expired(3.0)] == [1, 2]
    assert q.remove(0) is not None and q.remove(0) is None
    assert q.next_deadline() is None and len(q) == 0 and q.pop() is None
    with pytest.raises(ValueError, match="already waiting"):
        q.push(w(7))
        q.push(w(7))


def test_a_request_that_may_not_go_yet_lets_those_behind_it_go_in_their_order() -> None:
    """`accept`: the servers of a request that may go only to some are full; those behind it
    that may go leave first, in the queue's own order, and it stays first for later."""
    q = FlowQueue()
    for i, (rank, tenant) in enumerate([(1, "a"), (1, "a"), (1, "b"), (0, "c"), (1, "a")]):
        q.push(w(i, rank, tenant, at=float(i)))
    not_3_or_0 = q.pop(lambda x: x.id not in (0, 3))
    assert not_3_or_0 is not None and not_3_or_0.id in (1, 2)  # the lower class, 3, may not go
    assert q.pop(lambda x: False) is None and len(q) == 4
    assert [x for x in drain(q)][:2] == [3, 0]  # then each in its turn again


def test_tenant_counters_are_bounded() -> None:
    q = FlowQueue(max_tenants=10)
    for i in range(100):
        q.push(w(i, tenant=f"t{i}", tokens=5))
        q.pop()
    assert len(q._counters) == 10


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"), st.integers(0, 2), st.sampled_from("abc"), st.integers(0, 40), st.integers(0, 50)
        ),
        st.tuples(st.just("pop")),
        st.tuples(st.just("pop_if"), st.integers(0, 1)),  # only ids of this parity may leave
        st.tuples(st.just("expire"), st.floats(0, 100)),
        st.tuples(st.just("remove"), st.integers(0, 60)),
        st.tuples(st.just("charge"), st.sampled_from("abc"), st.integers(-5, 500)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_request_comes_out_once_and_the_order_and_bounds_hold(program: list[tuple]) -> None:  # type: ignore[type-arg]
    q = FlowQueue(max_requests=8, max_bytes=120)
    pushed: dict[int, Waiting] = {}
    out: list[int] = []
    now = 0.0
    for i, op in enumerate(program):
        now += 1.0
        if op[0] == "push":
            x = Waiting(i, op[1], op[2], now, now + op[3], op[4], 10)
            pushed[i] = x
            shed = q.push(x)
            assert all(s.rank >= x.rank for s in shed)  # never a higher class for a lower one
            assert x in shed or i in q
            out += [s.id for s in shed]
        elif op[0] == "pop":
            waiting = {r for (r, _), n in q.waiting().items() if n}
            got = q.pop()
            if got is None:
                assert not waiting
                continue
            assert got.rank == min(waiting)  # no lower class leaves while a higher one waits
            out.append(got.id)
        elif op[0] == "pop_if":
            ok = {j: pushed[j].rank for j in pushed if j in q and j % 2 == op[1]}
            got = q.pop(lambda x, p=op[1]: x.id % 2 == p)  # type: ignore[misc]
            if got is None:
                assert not ok  # None only when no request it accepts waits
                continue
            assert got.id % 2 == op[1] and got.rank == min(ok.values())
            out.append(got.id)
        elif op[0] == "expire":
            gone = q.expired(op[1])
            assert all(g.deadline <= op[1] for g in gone)
            out += [g.id for g in gone]
        elif op[0] == "remove":
            if (g := q.remove(op[1])) is not None:
                out.append(g.id)
        else:
            q.charge(op[1], op[2])
        assert len(q) <= 8 and 0 <= q.bytes <= 120
        assert q.bytes == sum(pushed[j].size for j in pushed if j in q)
    out += drain(q)
    assert sorted(out) == sorted(pushed)  # every one exactly once
