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
    KV_FULL,
    LOAD_MAX_AGE_S,
    PEER_MAX_AGE_S,
    PREFIX_LOAD_BOUND,
    Candidate,
    PickerState,
    ServerLoad,
    candidates,
    prefix_digest,
    wait_and_service,
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
    state = PickerState()
    state.assign([cla])
    firsts = {state.pick("m@v1").servers[0] for _ in range(20)}
    assert firsts == {"127.0.0.1:1", "127.0.0.1:4"}


def test_the_control_planes_own_assignments_read_back() -> None:
    """What translate sends (held out: UNHEALTHY at weight 1) is what the picker reads."""
    fleet = parse_fleet(BASIC)
    desired = translate(fleet, {"llama-3-8b@v1": {"127.0.0.1:8101": 30, "127.0.0.1:8102": 0}})
    cla = desired.by_type[ENDPOINT]["llama-3-8b@v1"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    got = {c.address: c for c in candidates(cla)}
    assert got["127.0.0.1:8101"] == Candidate("127.0.0.1:8101", 30, True)
    assert got["127.0.0.1:8102"].eligible is False


def _state(servers: list[tuple[str, int]], inflight: dict[str, int] | None = None) -> PickerState:
    state = PickerState()
    state.assign([_cla("m@v1", [(a, w, health_check_pb2.UNKNOWN) for a, w in servers])])
    state.inflight.update(inflight or {})
    return state


def test_least_in_flight_relative_to_weight_first() -> None:
    servers = [("a:1", 1), ("b:1", 3)]
    # a: (0+1)/1 = 1; b: (2+1)/3 = 1 -> tie on score, fewer in flight wins
    assert _state(servers, {"b:1": 2}).pick("m@v1").servers[:2] == ("a:1", "b:1")
    assert _state(servers, {"b:1": 1}).pick("m@v1").servers[:2] == ("b:1", "a:1")  # b: 2/3 < 1
    assert _state(servers, {"a:1": 1}).pick("m@v1").servers[:2] == ("b:1", "a:1")


def test_equal_servers_take_turns() -> None:
    state = PickerState()
    state.assign([_cla("m@v1", [(f"127.0.0.1:{p}", 1, health_check_pb2.UNKNOWN) for p in (1, 2, 3)])])
    firsts = []
    for _ in range(9):
        picked = state.pick("m@v1").servers
        firsts.append(picked[0])
        state.done(picked[0])  # each ends before the next starts: in flight stays 0
    assert Counter(firsts) == {"127.0.0.1:1": 3, "127.0.0.1:2": 3, "127.0.0.1:3": 3}


def test_a_pick_names_fallbacks_for_retries_and_counts_in_flight() -> None:
    state = PickerState()
    state.assign([_cla("m@v1", [(f"127.0.0.1:{p}", 1, health_check_pb2.UNKNOWN) for p in range(1, 6)])])
    picked, reason, _ = state.pick("m@v1")
    assert reason == "least_loaded"
    assert len(picked) == 1 + FALLBACKS and len(set(picked)) == len(picked)
    assert state.inflight == {picked[0]: 1}
    state.done(picked[0])
    assert state.inflight == {}
    state.done(picked[0])  # a second end (a stream closed twice) never goes below zero
    assert state.inflight == {}


def test_nothing_to_pick_from() -> None:
    state = PickerState()
    assert state.pick("m@v1").servers == ()
    state.assign([_cla("m@v1", [("127.0.0.1:1", 1, health_check_pb2.UNHEALTHY)])])
    assert state.pick("m@v1").servers == ()
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
    servers = [(f"127.0.0.{i}:1", w, ok) for i, (w, ok, _) in enumerate(spec)]
    inflight = {f"127.0.0.{i}:1": n for i, (_, _, n) in enumerate(spec)}
    state = PickerState()
    health = {True: health_check_pb2.UNKNOWN, False: health_check_pb2.UNHEALTHY}
    state.assign([_cla("m@v1", [(a, w, health[ok]) for a, w, ok in servers])])
    state.inflight.update(inflight)
    picked = state.pick("m@v1").servers
    eligible = [(a, w) for a, w, ok in servers if ok]
    assert set(picked) <= {a for a, _ in eligible}
    assert len(picked) == min(len(eligible), 1 + FALLBACKS)
    if eligible:
        best = min((inflight[a] + 1) / w for a, w in eligible)
        weight = dict(eligible)[picked[0]]
        assert (inflight[picked[0]] + 1) / weight == best


def _two(state: PickerState) -> None:
    state.assign([_cla("m@v1", [(f"127.0.0.1:{p}", 1, health_check_pb2.UNKNOWN) for p in (1, 2)])])


def test_a_server_whose_page_shows_a_queue_is_passed_over() -> None:
    state = PickerState()
    _two(state)
    state.observe({"127.0.0.1:1": ServerLoad(queued=4, read_at=10.0), "127.0.0.1:2": ServerLoad(0, 10.0)})
    firsts = [state.pick("m@v1", now=10.1).servers[0] for _ in range(4)]
    # The picker sent none of :1's four: they count on top of its own. Its picks for :2 count
    # until they end: 4 bring it level with :1, and the tie goes to the one picked longest ago.
    assert firsts == ["127.0.0.1:2"] * 4
    assert state.load("127.0.0.1:2", 10.1) == 4
    assert state.pick("m@v1", now=10.1).servers[0] == "127.0.0.1:1"


def test_a_page_counts_only_what_the_picker_did_not_send() -> None:
    state = PickerState()
    _two(state)
    a = "127.0.0.1:1"
    for t in (1.0, 1.1, 1.2):
        state.started(a, t)
    state.done(a, 1.5)
    # Read at 1.3: three running there, all the picker's (three started, none ended by 1.3).
    state.observe({a: ServerLoad(queued=3, read_at=1.3)})
    assert state.inflight_at(a, 1.3) == 3
    assert state.load(a, 2.0) == 2  # its own two still in flight, nothing foreign
    # Read at 1.6: five there, of which the picker's two: three from elsewhere.
    state.observe({a: ServerLoad(queued=5, read_at=1.6)})
    assert state.load(a, 2.0) == 2 + 3
    state.done(a, 2.1)
    assert state.load(a, 2.2) == 1 + 3  # its end shows at once, the page's three until the next
    assert state.load(a, 1.6 + LOAD_MAX_AGE_S + 0.1) == 1  # a stale page says nothing


def test_capacity_scales_the_load() -> None:
    state = PickerState()
    _two(state)
    state.observe(
        {
            "127.0.0.1:1": ServerLoad(queued=2, read_at=0.0, capacity=3.0),  # (2+1)/3 = 1
            "127.0.0.1:2": ServerLoad(queued=1, read_at=0.0, capacity=1.0),  # (1+1)/1 = 2
        }
    )
    assert state.pick("m@v1", now=0.5).servers[0] == "127.0.0.1:1"


def test_wait_and_service() -> None:
    assert wait_and_service(0, 4, 1.0) == 1.0
    assert wait_and_service(3, 4, 1.0) == 1.0  # a slot free: one service
    assert wait_and_service(4, 4, 1.0) == 1.25  # full: a quarter of a service's wait first
    assert wait_and_service(7, 4, 0.5) == 4.0
    assert wait_and_service(2, 1, 2.0) == wait_and_service(2, 0, 2.0) == 1.5  # one slot: (load+1)/speed


@given(st.floats(0, 50), st.floats(0, 50), st.floats(1, 16), st.floats(0.1, 4))
def test_more_load_never_takes_less_time(a: float, b: float, slots: float, scale: float) -> None:
    lo, hi = sorted((a, b))
    assert wait_and_service(lo, slots, scale) <= wait_and_service(hi, slots, scale)


def test_a_fast_server_with_a_free_slot_beats_an_idle_slow_one() -> None:
    """What weighted least request cannot do: (3+1)/1 > (0+1)/0.35, yet the fast server with
    a slot free serves in 1, the slow one in 2.9. Its slots are learnt from a page that shows
    it full (requests waiting); before that, one slot: the weighted least request score."""
    fast, slow = "127.0.0.1:1", "127.0.0.1:2"
    state = PickerState()
    _two(state)
    pages = {
        fast: ServerLoad(queued=3, read_at=0.0, capacity=1.0, running=3, waiting=0),
        slow: ServerLoad(queued=0, read_at=0.0, capacity=0.35, running=0, waiting=0),
    }
    state.observe(pages)
    assert state.slots == {}
    assert state.pick("m@v1", now=0.1).servers[0] == slow
    state.done(slow, 0.2)
    state.observe({fast: ServerLoad(queued=6, read_at=1.0, capacity=1.0, running=4, waiting=2)})
    assert state.slots == {fast: 4}
    state.observe({**pages, fast: ServerLoad(queued=3, read_at=2.0, capacity=1.0, running=3, waiting=0)})
    assert state.slots == {fast: 4}  # kept: the most a full page showed
    assert state.pick("m@v1", now=2.1).servers[0] == fast  # 3 of 4 slots busy: 1.0 < 2.9
    state.done(fast, 2.2)
    # Full: a free slot beats a wait, even a short one on a faster server (the wait is a guess:
    # the requests ahead may be long), as the simulation's full-scan picker does.
    state.observe({**pages, fast: ServerLoad(queued=5, read_at=3.0, capacity=1.0, running=4, waiting=1)})
    assert wait_and_service(5, 4, 1.0) < wait_and_service(0, 1, 0.35)
    assert state.pick("m@v1", now=3.1).servers[0] == slow


def test_a_full_kv_cache_counts_the_server_full() -> None:
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    state = PickerState()
    _two(state)
    state.observe(
        {
            a: ServerLoad(queued=6, read_at=0.0, capacity=1.0, running=4, waiting=2),
            b: ServerLoad(queued=6, read_at=0.0, capacity=1.0, running=4, waiting=2),
        }
    )
    state.observe(
        {
            a: ServerLoad(queued=1, read_at=1.0, running=1, waiting=0, kv_use=KV_FULL),
            b: ServerLoad(queued=2, read_at=1.0, running=2, waiting=0, kv_use=0.5),
        }
    )
    assert state.pick("m@v1", now=1.1).servers[0] == b


def test_a_prefix_goes_back_to_its_server_within_the_load_bound() -> None:
    state = PickerState()
    state.assign([_cla("m@v1", [(f"127.0.0.1:{p}", 1, health_check_pb2.UNKNOWN) for p in (1, 2, 3)])])
    first, reason, _ = state.pick("m@v1", prefix="sys-A")
    assert reason == "least_loaded"
    again = state.pick("m@v1", prefix="sys-A")
    assert again.reason == "approximate" and again.servers[0] == first[0]
    other = state.pick("m@v1", prefix="sys-B")
    assert other.reason == "least_loaded" and other.servers[0] != first[0]  # a miss goes to the least loaded
    # The prefix's server fills up: past PREFIX_LOAD_BOUND x the mean time it spills over.
    held = first[0]
    while (p := state.pick("m@v1", prefix="sys-A")).servers[0] == held:
        assert p.reason == "approximate"
    load = {a: state.load(a, 0.0) for a in ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")}
    before = {**load, held: load[held] - 0}  # the spilled request is on its new server now
    before[p.servers[0]] -= 1
    mean = sum(v + 1 for v in before.values()) / 3
    assert before[held] + 1 > PREFIX_LOAD_BOUND * mean  # spilled only past the bound
    assert before[held] + 1 <= PREFIX_LOAD_BOUND * mean + PREFIX_LOAD_BOUND  # and not long after
    assert p.reason == "least_loaded"
    assert state.prefixes[prefix_digest("m@v1", "sys-A")] == p.servers[0]  # the key follows to its new server
    assert state.pick("m@v1", prefix="sys-A").reason == "approximate"


def test_the_prefix_index_is_bounded_least_recently_used_first() -> None:
    state = PickerState(prefix_entries=3)
    _two(state)
    for key in ("a", "b", "c"):
        state.pick("m@v1", prefix=key)
    state.pick("m@v1", prefix="a")  # a used again: b is now the oldest
    state.pick("m@v1", prefix="d")
    assert list(state.prefixes) == [prefix_digest("m@v1", k) for k in ("c", "a", "d")]
    for i in range(1000):
        state.pick("m@v1", prefix=f"k{i}")
    assert len(state.prefixes) == 3


def test_a_subset_hint_narrows_the_servers() -> None:
    state = PickerState()
    state.assign([_cla("m@v1", [(f"127.0.0.1:{p}", 1, health_check_pb2.UNKNOWN) for p in (1, 2, 3)])])
    only = frozenset({"127.0.0.1:3", "127.0.0.1:9"})
    assert {state.pick("m@v1", subset=only).servers for _ in range(5)} == {("127.0.0.1:3",)}
    assert state.pick("m@v1", subset=frozenset({"127.0.0.1:9"})).servers == ()  # none eligible in it


def test_a_server_never_seen_full_borrows_its_peers_slots() -> None:
    """Else a slow server, given one request at a time (one slot assumed), would never fill
    up and show its slots, and would sit nearly idle while the fast ones queue."""
    fast, slow = "127.0.0.1:1", "127.0.0.1:2"
    state = PickerState()
    _two(state)
    state.observe(
        {
            fast: ServerLoad(queued=6, read_at=0.0, capacity=1.0, running=4, waiting=2),
            slow: ServerLoad(queued=1, read_at=0.0, capacity=0.35, running=1, waiting=0),
        }
    )
    assert state.slots == {fast: 4}
    # slow: 1 of 4 borrowed slots busy, so free; fast: full. The free one first.
    assert state.pick("m@v1", now=0.1).servers[0] == slow
    # Its own full page overrides what it borrowed: 1 slot, so now it is full too.
    state.observe(
        {
            fast: ServerLoad(queued=4, read_at=1.0, capacity=1.0, running=4, waiting=0),
            slow: ServerLoad(queued=3, read_at=1.0, capacity=0.35, running=1, waiting=2),
        }
    )
    assert state.slots == {fast: 4, slow: 1}
    state.done(slow, 1.05)
    # fast: 4 of 4 busy, 1.25; slow: its page's 2 the picker did not send, full: (1 + 2) / 0.35.
    assert state.pick("m@v1", now=1.1).servers[0] == fast


def test_failover_ranks_hold_the_next_rank_only_takes_over_when_the_first_has_none() -> None:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="m@v1")
    for priority, port, health in (
        (0, 1, health_check_pb2.UNKNOWN),
        (1, 2, health_check_pb2.UNKNOWN),
        (1, 3, health_check_pb2.UNKNOWN),
    ):
        locality = cla.endpoints.add(priority=priority)
        lb = locality.lb_endpoints.add(health_status=health)
        lb.endpoint.address.socket_address.address = "127.0.0.1"
        lb.endpoint.address.socket_address.port_value = port
    state = PickerState()
    state.assign([cla])
    # The preferred zone's one server, however busy, as Envoy would.
    assert {state.pick("m@v1").servers for _ in range(5)} == {("127.0.0.1:1",)}
    cla.endpoints[0].lb_endpoints[0].health_status = health_check_pb2.UNHEALTHY
    state.assign([cla])
    assert {state.pick("m@v1").servers[0] for _ in range(6)} == {"127.0.0.1:2", "127.0.0.1:3"}


def test_peers_counts_add_to_the_load_while_fresh() -> None:
    """Two pickers: each counts the other's requests in flight, so they do not both send to
    the same idle server; the page's share is what none of them sent."""
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    state = PickerState()
    _two(state)
    state.observe_peer("127.0.0.1:9", {a: 2}, now=10.0)
    assert state.load(a, 10.5) == 2
    assert state.pick("m@v1", now=10.5).servers[0] == b
    state.observe({a: ServerLoad(queued=3, read_at=10.4)})  # the peer's 2 and 1 from elsewhere
    assert state.load(a, 10.6) == 2 + 1
    assert state.load(a, 10.0 + PEER_MAX_AGE_S + 0.1) == 3  # the peer silent: the page alone
