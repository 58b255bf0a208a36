"""Scale-down that never drops a request: drain before stop, in a sensible order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controlplane.autoscaling.scale_down import DRAINED, DRAINING, READY, STARTING, Plan, Replica, plan


def test_scale_up_starts_the_missing_replicas() -> None:
    assert plan(3, [Replica("a", READY)]) == Plan(start=2)


def test_scale_down_drains_non_preferred_then_least_loaded_never_stops_a_ready_one() -> None:
    replicas = [
        Replica("busy", READY, load=9),
        Replica("idle", READY, load=0),
        Replica("l4", READY, load=5, preferred=False),
    ]
    p = plan(1, replicas)
    assert p.drain == ("l4", "idle") and p.stop == () and p.start == 0


def test_a_not_yet_ready_replica_goes_first_and_at_once() -> None:
    p = plan(1, [Replica("a", READY), Replica("cold", STARTING, started_at=5)])
    assert p == Plan(stop=("cold",))


def test_drained_replicas_are_stopped_and_a_rise_takes_draining_ones_back() -> None:
    replicas = [Replica("a", READY), Replica("d1", DRAINING, started_at=1), Replica("gone", DRAINED)]
    assert plan(1, replicas) == Plan(stop=("gone",))
    assert plan(2, replicas) == Plan(stop=("gone",), undrain=("d1",))
    assert plan(4, replicas) == Plan(start=2, stop=("gone",), undrain=("d1",))


states = st.sampled_from([STARTING, READY, DRAINING, DRAINED])


@given(
    st.integers(0, 10),
    st.lists(st.tuples(states, st.floats(0, 50), st.booleans(), st.floats(0, 100)), max_size=10),
)
def test_every_plan_keeps_the_rules(want: int, rows: list[tuple[str, float, bool, float]]) -> None:
    replicas = [Replica(f"r{i}", s, load, pref, t) for i, (s, load, pref, t) in enumerate(rows)]
    by = {r.address: r for r in replicas}
    p = plan(want, replicas)
    assert all(by[a].state in (STARTING, DRAINED) for a in p.stop)  # a ready one is never cut
    assert all(by[a].state == READY for a in p.drain)
    assert all(by[a].state == DRAINING for a in p.undrain)
    serving = sum(1 for r in replicas if r.state in (STARTING, READY))
    after = serving + p.start + len(p.undrain) - len(p.drain) - sum(by[a].state == STARTING for a in p.stop)
    assert after == want
