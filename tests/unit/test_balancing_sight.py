"""Fail static on loss of sight (balancing/sight.py): the decision table, case by case and
as properties over any cluster."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controlplane.balancing.policies import POLICIES, PolicyConfig
from controlplane.balancing.sight import judge_sight
from controlplane.signals.load import EndpointLoad


def ep(i: int, *, ready: bool = True, seen: bool = True) -> EndpointLoad:
    return EndpointLoad(address=f"127.0.0.{i + 1}:8000", ready=ready, in_sight=seen)


def held_out(loads: tuple[EndpointLoad, ...]) -> list[int]:
    return [i for i, e in enumerate(loads) if not e.ready]


def test_all_in_sight_changes_nothing() -> None:
    loads = [ep(0), ep(1, ready=False), ep(2)]
    v = judge_sight(loads)
    assert v.loads == tuple(loads) and (v.out_of_sight, v.held_out, v.kept) == (0, 0, 0)


def test_a_minority_out_of_sight_is_held_out_while_the_rest_vouch() -> None:
    v = judge_sight([ep(0), ep(1), ep(2, seen=False)])
    assert held_out(v.loads) == [2] and (v.held_out, v.kept) == (1, 0)


def test_half_out_of_sight_is_held_out_but_not_more() -> None:
    assert held_out(judge_sight([ep(0), ep(1, seen=False)]).loads) == [1]
    v = judge_sight([ep(0), ep(1, seen=False), ep(2, seen=False)])
    assert held_out(v.loads) == [] and v.kept == 2


def test_the_whole_cluster_out_of_sight_keeps_serving() -> None:
    v = judge_sight([ep(0, seen=False), ep(1, seen=False), ep(2, seen=False)])
    assert held_out(v.loads) == [] and (v.out_of_sight, v.kept) == (3, 3)
    assert held_out(judge_sight([ep(0, seen=False)]).loads) == []


def test_the_rest_cannot_vouch_when_one_of_them_is_not_ready() -> None:
    v = judge_sight([ep(0), ep(1, ready=False), ep(2), ep(3, seen=False)])
    assert held_out(v.loads) == [1] and v.kept == 1


def test_a_last_verdict_of_not_ready_stands_out_of_sight() -> None:
    v = judge_sight([ep(0, ready=False, seen=False), ep(1, seen=False)])
    assert held_out(v.loads) == [0]


clusters = st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=12).map(
    lambda flags: [ep(i, ready=r, seen=s) for i, (r, s) in enumerate(flags)]
)


@given(clusters)
def test_properties(loads: list[EndpointLoad]) -> None:
    v = judge_sight(loads)
    unseen = [i for i, e in enumerate(loads) if not e.in_sight]
    newly = [i for i in held_out(v.loads) if loads[i].ready]
    # Only endpoints out of sight are ever newly held out, never more than half the cluster,
    # and only when every endpoint in sight is ready.
    assert set(newly) <= set(unseen)
    assert 2 * len(newly) <= len(loads)
    if newly:
        assert all(e.ready for e in loads if e.in_sight) and len(unseen) < len(loads)
    # Losing sight never takes away the last ready endpoint the server's own word allowed.
    if any(e.ready for e in loads):
        assert any(e.ready for e in v.loads)
        weights = POLICIES["adaptive"](v.loads, PolicyConfig())
        assert any(w > 0 for w in weights.values())
    assert v.held_out + v.kept == v.out_of_sight == len(unseen)
