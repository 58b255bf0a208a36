"""picker/choose.py: what the picker may pick from, and in which order (pure)."""

from __future__ import annotations

from collections import Counter

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given
from hypothesis import strategies as st

from controlplane.fleet import parse_fleet
from controlplane.picker.choose import (
    FALLBACKS,
    LOAD_MAX_AGE_S,
    Candidate,
    PickerState,
    ServerLoad,
    candidates,
    rank,
)
from controlplane.routing.translate import ENDPOINT, translate
from tests.fleets import BASIC


def _cla(name: str, servers: list[tuple[str, int, int]]) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    for address, weight, health in servers:
        host, _, port = address.rpartition(":")
        lb = cla.endpoints.add().lb_endpoints.add()
        lb.endpoint.address.socket_address.address = host.strip("[]")
        lb.endpoint.address.socket_address.port_value = int(port)
        lb.load_balancing_weight.value = weight
        lb.health_status = health
    return cla


def test_held_out_and_draining_servers_are_never_eligible() -> None:
    cla = _cla(
        "m@v1",
        [
            ("127.0.0.1:1", 5, health_check_pb2.UNKNOWN),
            ("127.0.0.1:2", 5, health_check_pb2.UNHEALTHY),
            ("127.0.0.1:3", 5, health_check_pb2.DRAINING),
            ("127.0.0.1:4", 5, health_check_pb2.HEALTHY),
            ("[::1]:5", 5, health_check_pb2.DEGRADED),
        ],
    )
    got = candidates(cla)
    assert [c.address for c in got] == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4", "[::1]:5"]
    assert [c.eligible for c in got] == [True, False, False, True, False]
    assert rank(got, {}) == ["127.0.0.1:1", "127.0.0.1:4"]


def test_the_control_planes_own_assignments_read_back() -> None:
    """What translate sends (held out: UNHEALTHY at weight 1) is what the picker reads."""
    fleet = parse_fleet(BASIC)
    desired = translate(fleet, {"llama-3-8b@v1": {"127.0.0.1:8101": 30, "127.0.0.1:8102": 0}})
    cla = desired.by_type[ENDPOINT]["llama-3-8b@v1"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    got = {c.address: c for c in candidates(cla)}
    assert got["127.0.0.1:8101"] == Candidate("127.0.0.1:8101", 30, True)
    assert got["127.0.0.1:8102"].eligible is False


def test_least_in_flight_relative_to_weight_first() -> None:
    servers = [Candidate("a", 1, True), Candidate("b", 3, True)]
    # a: (0+1)/1 = 1; b: (2+1)/3 = 1 -> tie on score, fewer in flight wins
    assert rank(servers, {"b": 2}) == ["a", "b"]
    assert rank(servers, {"b": 1}) == ["b", "a"]  # b: 2/3 < 1
    assert rank(servers, {"a": 1}) == ["b", "a"]


def test_equal_servers_take_turns() -> None:
    state = PickerState()
    state.assign([_cla("m@v1", [(f"127.0.0.1:{p}", 1, health_check_pb2.UNKNOWN) for p in (1, 2, 3)])])
    firsts = []
    for _ in range(9):
        picked = state.pick("m@v1")
        firsts.append(picked[0])
        state.done(picked[0])  # each ends before the next starts: in flight stays 0
    assert Counter(firsts) == {"127.0.0.1:1": 3, "127.0.0.1:2": 3, "127.0.0.1:3": 3}


def test_a_pick_names_fallbacks_for_retries_and_counts_in_flight() -> None:
    state = PickerState()
    state.assign([_cla("m@v1", [(f"127.0.0.1:{p}", 1, health_check_pb2.UNKNOWN) for p in range(1, 6)])])
    picked = state.pick("m@v1")
    assert len(picked) == 1 + FALLBACKS and len(set(picked)) == len(picked)
    assert state.inflight == {picked[0]: 1}
    state.done(picked[0])
    assert state.inflight == {}
    state.done(picked[0])  # a second end (a stream closed twice) never goes below zero
    assert state.inflight == {}


def test_nothing_to_pick_from() -> None:
    state = PickerState()
    assert state.pick("m@v1") == ()
    state.assign([_cla("m@v1", [("127.0.0.1:1", 1, health_check_pb2.UNHEALTHY)])])
    assert state.pick("m@v1") == ()
    assert state.inflight == {}


def test_new_assignments_replace_the_clusters_and_keep_in_flight_counts() -> None:
    state = PickerState()
    state.assign([_cla("m@v1", [("127.0.0.1:1", 1, health_check_pb2.UNKNOWN)])])
    state.pick("m@v1")
    state.assign([_cla("m@v2", [("127.0.0.1:2", 1, health_check_pb2.UNKNOWN)])])
    assert set(state.clusters) == {"m@v2"}
    assert state.inflight == {"127.0.0.1:1": 1}


@given(
    st.lists(st.tuples(st.integers(1, 100), st.booleans(), st.integers(0, 20)), min_size=1, max_size=12),
)
def test_the_first_pick_has_the_lowest_score_of_the_eligible(spec: list[tuple[int, bool, int]]) -> None:
    servers = [Candidate(f"s{i}", w, ok) for i, (w, ok, _) in enumerate(spec)]
    inflight = {f"s{i}": n for i, (_, _, n) in enumerate(spec)}
    ranked = rank(servers, inflight)
    eligible = [s for s in servers if s.eligible]
    assert sorted(ranked) == sorted(s.address for s in eligible)
    if eligible:
        best = min((inflight[s.address] + 1) / s.weight for s in eligible)
        first = next(s for s in eligible if s.address == ranked[0])
        assert (inflight[first.address] + 1) / first.weight == best


def _two(state: PickerState) -> None:
    state.assign([_cla("m@v1", [(f"127.0.0.1:{p}", 1, health_check_pb2.UNKNOWN) for p in (1, 2)])])


def test_a_server_whose_page_shows_a_queue_is_passed_over() -> None:
    state = PickerState()
    _two(state)
    state.observe({"127.0.0.1:1": ServerLoad(queued=4, read_at=10.0), "127.0.0.1:2": ServerLoad(0, 10.0)})
    firsts = [state.pick("m@v1", now=10.1)[0] for _ in range(4)]
    # Each pick for :2 counts on it until the next reading: 4 picks bring it level with :1,
    # and the tie goes to the one picked longest ago.
    assert firsts == ["127.0.0.1:2"] * 4
    assert state.load("127.0.0.1:2", 10.1) == 4
    assert state.pick("m@v1", now=10.1)[0] == "127.0.0.1:1"


def test_picks_before_the_reading_are_in_it_and_a_stale_reading_says_nothing() -> None:
    state = PickerState()
    _two(state)
    state.pick("m@v1", now=1.0)
    address = state.pick("m@v1", now=1.0)[0]
    for a in list(state.inflight):
        state.done(a)
    state.observe({address: ServerLoad(queued=1, read_at=2.0)})
    assert state.load(address, 2.5) == 1  # the reading, not the picks made before it
    assert state.load(address, 2.0 + LOAD_MAX_AGE_S + 0.1) == 0


def test_capacity_scales_the_load() -> None:
    state = PickerState()
    _two(state)
    state.observe(
        {
            "127.0.0.1:1": ServerLoad(queued=2, read_at=0.0, capacity=3.0),  # (2+1)/3 = 1
            "127.0.0.1:2": ServerLoad(queued=1, read_at=0.0, capacity=1.0),  # (1+1)/1 = 2
        }
    )
    assert state.pick("m@v1", now=0.5)[0] == "127.0.0.1:1"
