"""picker/choose.py under hostile input (issue 41): the prefix index is bounded in bytes, a
peer's nonsense is refused whole and never reaches a pick, and no figure makes the ranking
raise or name a server it may not (pure)."""

from __future__ import annotations

import math
import tracemalloc
from typing import Any

import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane import limits
from controlplane.picker.choose import PickerState, ServerLoad, prefix_digest, sane_load, wait_and_service

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
PEER = "127.0.0.1:9"


def _cla(
    name: str, servers: list[str], health: int = health_check_pb2.UNKNOWN
) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    for address in servers:
        host, _, port = address.rpartition(":")
        lb = cla.endpoints.add().lb_endpoints.add()
        lb.endpoint.address.socket_address.address = host
        lb.endpoint.address.socket_address.port_value = int(port)
        lb.load_balancing_weight.value = 1
        lb.health_status = health
    return cla


def _state(servers: tuple[str, ...] = (A, B)) -> PickerState:
    state = PickerState()
    state.assign([_cla("m@v1", list(servers))])
    return state


# ---- the prefix index: bounded in bytes ------------------------------------------------------


def test_the_index_keeps_a_digest_not_the_key() -> None:
    state = _state()
    key = "s" * 1_000_000
    state.pick("m@v1", prefix=key)
    (kept,) = state.prefixes
    assert kept == prefix_digest("m@v1", key) and len(kept) == limits.PICKER_PREFIX_DIGEST_BYTES
    assert state.pick("m@v1", prefix=key).reason == "approximate"
    assert state.pick("m@v2", prefix=key).servers == ()  # per cluster: another has its own
    assert prefix_digest("m@v1", key) != prefix_digest("m@v2", key)
    assert prefix_digest("m@v1", "a\0b") != prefix_digest("m@v1\0a", "b")  # no ambiguity at the seam


def test_memory_per_prefix_entry_is_bounded_whatever_the_keys_length() -> None:
    """What finding 5 measured (1 MB keys grew the picker by hundreds of MB): now each entry
    costs about 250 bytes (the digest and the index's own entry). 2,000 entries of 64 KB
    keys stay under 300 bytes each."""
    state = _state()
    for i in range(50):  # warm up the containers
        state.done(state.pick("m@v1", prefix=f"warm-{i}").servers[0])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2000):
            picked = state.pick("m@v1", prefix=f"{i:06d}" + "p" * 65_536)
            state.done(picked.servers[0])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(state.prefixes) == 2050
    assert grown / 2000 < 300, grown / 2000


def test_the_count_bound_holds_and_zero_turns_the_index_off() -> None:
    state = PickerState(prefix_entries=0)
    state.assign([_cla("m@v1", [A, B])])
    for i in range(10):
        assert state.pick("m@v1", prefix=f"k{i}").reason == "least_loaded"
    assert state.pick("m@v1", prefix="k1").reason == "least_loaded"
    assert len(state.prefixes) == 0


# ---- peers: nonsense refused whole -------------------------------------------------------------


@pytest.mark.parametrize(
    ("counts", "words"),
    [
        ({A: 10**400}, "more than 10^12 in flight on one server, above its bound 1024"),
        ({A: 1_000_000}, "1000000 in flight on one server, above its bound 1024"),
        ({A: -1}, "a negative count"),
        ({A: float("nan")}, "not a whole number (float)"),
        ({A: 3.0}, "not a whole number (float)"),
        ({A: "7"}, "not a whole number (str)"),
        ({A: True}, "not a whole number (bool)"),
        ({A: None}, "not a whole number (NoneType)"),
        (
            {f"127.0.0.{i % 250}:{i}": 1 for i in range(limits.PICKER_PEER_MAX_SERVERS + 1)},
            "more than 10000 servers",
        ),
        ([(A, 1), (A, 1)], "a server named twice"),
    ],
    ids=["1e400", "a-million", "negative", "nan", "float", "text", "bool", "null", "too-many", "twice"],
)
def test_a_peer_answering_nonsense_is_refused_whole_and_counts_for_nothing(counts: Any, words: str) -> None:
    state = _state()
    assert state.observe_peer(PEER, {A: 3, B: 1}, now=10.0) is None
    assert state.load(A, 10.1) == 3
    why = state.observe_peer(PEER, counts, now=10.2)
    assert why is not None and words in why, why
    assert len(why) < 120  # one short line, never a 400-digit number
    assert state.load(A, 10.3) == 0 and state.load(B, 10.3) == 0  # the peer counts for nothing now
    picks = {state.pick("m@v1", now=10.4).servers[0] for _ in range(2)}
    assert picks == {A, B}  # and picks go on, spread


def test_a_peers_bound_is_the_servers_slots_times_the_factor() -> None:
    state = _state()
    assert state.peer_bound(A) == limits.PICKER_PEER_DEFAULT_SLOTS * limits.PICKER_PEER_SLOTS_FACTOR
    state.observe({A: ServerLoad(queued=10, read_at=0.0, running=8, waiting=2)})
    assert state.peer_bound(A) == 8 * limits.PICKER_PEER_SLOTS_FACTOR
    assert state.peer_bound(B) == 8 * limits.PICKER_PEER_SLOTS_FACTOR  # borrowed: the most seen
    assert state.observe_peer(PEER, {A: 8 * limits.PICKER_PEER_SLOTS_FACTOR}, now=1.0) is None
    assert state.observe_peer(PEER, {A: 8 * limits.PICKER_PEER_SLOTS_FACTOR + 1}, now=1.0) is not None
    state.observe({A: ServerLoad(queued=10**9, read_at=0.0, running=10**9, waiting=1)})
    assert state.peer_bound(A) == limits.METRICS_MAX_QUEUE  # never above what a page may show


def test_servers_the_picker_does_not_know_are_left_out_of_a_peers_answer() -> None:
    state = _state()
    assert state.observe_peer(PEER, {A: 2, "10.9.9.9:1": 5, "junk": 1, B: 0}, now=1.0) is None
    assert state.peers[PEER] == (1.0, {A: 2})


# ---- the ranking: total, whatever it is told ------------------------------------------------------

NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(
    pages=st.dictionaries(
        st.sampled_from([A, B, C, "10.0.0.1:1"]),
        st.tuples(NUMBERS, NUMBERS, NUMBERS, NUMBERS, NUMBERS, NUMBERS),
        max_size=4,
    ),
    peer=st.dictionaries(
        st.sampled_from([A, B, C, "x"]), st.one_of(NUMBERS, st.text(max_size=3)), max_size=4
    ),
    inflight=st.dictionaries(st.sampled_from([A, B, C]), st.integers(0, 10**6), max_size=3),
    now=st.floats(0, 1e9),
    prefix=st.text(max_size=20),
)
def test_no_figure_makes_a_pick_raise_or_name_a_server_it_may_not(
    pages: dict[str, tuple[Any, ...]],
    peer: dict[str, Any],
    inflight: dict[str, int],
    now: float,
    prefix: str,
) -> None:
    state = PickerState()
    state.assign([_cla("m@v1", [A, B]), _cla("m@v2", [C], health_check_pb2.UNHEALTHY)])
    state.inflight.update(inflight)
    state.observe(
        {
            a: ServerLoad(queued=q, read_at=t, capacity=cap, running=r, waiting=w, kv_use=kv)  # type: ignore[arg-type]
            for a, (q, t, cap, r, w, kv) in pages.items()
        }
    )
    state.observe_peer(PEER, peer, now)
    for page in state.loads.values():
        assert math.isfinite(page.queued) and math.isfinite(page.read_at)
    for address in (A, B, C):
        assert math.isfinite(state.load(address, now))
    picked = state.pick("m@v1", now, prefix=prefix)
    assert picked.servers and set(picked.servers) <= {A, B}
    assert state.pick("m@v2", now).servers == ()  # never an ineligible server


@settings(max_examples=300, deadline=None)
@given(NUMBERS, NUMBERS, NUMBERS)
def test_wait_and_service_is_total_and_finite(load: Any, slots: Any, scale: Any) -> None:
    got = wait_and_service(load, slots, scale)
    assert got > 0 and not math.isnan(got)  # a rank, whatever it was given (inf only past 1e308)


def test_a_page_with_figures_that_are_not_finite_says_nothing_or_nothing_of_them() -> None:
    assert sane_load(ServerLoad(queued=float("nan"), read_at=0.0)) is None
    assert sane_load(ServerLoad(queued=1.0, read_at=float("inf"))) is None
    assert sane_load(ServerLoad(queued=-1.0, read_at=0.0)) is None
    page = sane_load(
        ServerLoad(queued=2.0, read_at=1.0, capacity=float("inf"), running=-3, waiting=1, kv_use=7.0)
    )
    assert page == ServerLoad(2.0, 1.0, None, running=None, waiting=1.0, kv_use=1.0)


def test_a_fleet_that_changes_does_not_grow_the_picker() -> None:
    state = PickerState()
    for gen in range(200):
        servers = [f"127.0.{gen % 250}.{i}:{1000 + gen}" for i in range(1, 4)]
        state.assign([_cla("m@v1", servers)])
        picked = state.pick("m@v1", now=float(gen)).servers[0]
        state.done(picked, float(gen))
        state.observe({servers[0]: ServerLoad(queued=9, read_at=float(gen), running=4, waiting=5)})
    assert len(state._last_pick) <= 3 and len(state._events) <= 3 and len(state.slots) <= 3
