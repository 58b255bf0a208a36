"""picker/adapters.py and its part in picker/choose.py's pick: where LoRA adapters are loaded,
what sending a request for one costs, and picks that keep adapters warm without piling a hot
one onto one server (pure)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from envoy.config.core.v3 import health_check_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.picker.adapters import (
    BLOCKED,
    EVICT,
    HARM_WINDOW_S,
    RESIDENT,
    SLOT_FREE,
    UNKNOWN,
    AdapterConfigError,
    AdapterView,
    read_adapter_config,
)
from controlplane.picker.choose import PickerState, ServerLoad
from tests.unit.test_picker_choose import _cla

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


def state(*servers: str) -> PickerState:
    s = PickerState()
    s.assign([_cla("m@v1", [(a, 10, health_check_pb2.HEALTHY) for a in servers])])
    return s


def page(
    running: tuple[str, ...] = (), waiting: tuple[str, ...] = (), max_lora: int = 2, n: float = 0.0
) -> ServerLoad:
    return ServerLoad(
        n, 0.0, 1.0, running=n, waiting=0.0, lora_running=running, lora_waiting=waiting, max_lora=max_lora
    )


def test_states_from_the_page_and_the_pickers_own_requests() -> None:
    v = AdapterView()
    assert v.state(A, "x", 0.0) == (UNKNOWN, 0.0)
    v.observe(A, ["x"], ["y"], 2, 0.0)
    assert v.state(A, "x", 0.0)[0] == RESIDENT
    assert v.state(A, "y", 0.0)[0] == RESIDENT  # waiting there: it rides on that load
    assert v.state(A, "z", 0.0)[0] == BLOCKED  # both slots' adapters have requests
    v.observe(A, [], [], 2, 1.0)  # they ended: x and y stay in their slots
    assert v.state(A, "x", 1.0)[0] == RESIDENT
    state_, harm = v.state(A, "z", 1.0)
    assert state_ == EVICT and 0.9 < harm <= 1.0  # the least recently used was used just now
    assert v.state(A, "z", 1.0 + HARM_WINDOW_S)[1] == 0.0  # long idle: no harm
    v.observe(B, [], [], 2, 0.0)
    assert v.state(B, "z", 0.0)[0] == SLOT_FREE


def test_the_slots_are_the_most_recent_max_lora_adapters_and_in_flight_ones_stay() -> None:
    v = AdapterView()
    v.observe(A, [], [], 2, 0.0)
    v.started(A, "a", 1.0)
    v.started(A, "b", 2.0)
    assert v.slots(A, 2.0) == ["a", "b"]
    v.done(A, "a", 3.0)
    v.done(A, "b", 4.0)
    v.started(A, "c", 5.0)  # evicts a (least recently used)
    assert set(v.slots(A, 5.0)) == {"b", "c"} and v.evictions == 1
    assert v.state(A, "a", 5.0)[0] == EVICT
    v.started(A, "b", 6.0)
    assert v.state(A, "a", 6.0)[0] == BLOCKED  # b and c both have requests in flight


def test_a_server_without_lora_says_nothing_and_a_stale_page_pins_nothing() -> None:
    v = AdapterView(page_max_age_s=5.0)
    v.observe(A, None, None, None, 0.0)
    assert A not in v.servers
    v.observe(B, ["x", "y"], [], 2, 0.0)
    assert v.state(B, "x", 100.0)[0] == RESIDENT  # still among its two most recent
    assert v.state(B, "z", 100.0)[0] == EVICT  # not blocked: the page that showed them running is old


def test_a_hostile_page_is_bounded() -> None:
    v = AdapterView()
    v.observe(A, [f"a{i}" for i in range(10_000)], [], 10**9, 0.0)
    s = v.servers[A]
    assert s.max_lora is None and len(s.running) <= 64 and len(s.last_used) <= 64


def test_picks_go_where_the_adapter_is_and_say_why() -> None:
    s = state(A, B, C)
    s.slots.update({A: 4.0, B: 4.0, C: 4.0})
    s.observe({A: page(("x",), n=1.0), B: page(("y",), n=0.0), C: page((), n=0.0)})
    p = s.pick("m@v1", 0.0, adapter="x")
    assert p.servers[0] == A and p.reason == "adapter_resident"
    p = s.pick("m@v1", 0.0, adapter="z")  # C has both slots free, B one
    assert p.reason == "adapter_slot_free"
    assert s.pick("m@v1", 0.0).reason == "least_loaded"  # the base model: no adapter cost


def test_a_hot_adapter_spreads_once_its_servers_queue_longer_than_a_load() -> None:
    s = state(A, B, C, "127.0.0.1:4")
    for a in (A, B, C, "127.0.0.1:4"):
        s.slots[a] = 4.0
    s.observe({a: page((), max_lora=2) for a in (A, B, C, "127.0.0.1:4")})
    went = Counter(s.pick("m@v1", 0.0, adapter="hot").servers[0] for _ in range(40))
    assert len(went) >= 2, went  # not all 40 on one server
    assert max(went.values()) <= 30, went


def test_adapters_with_zipf_popularity_load_less_than_an_adapter_blind_pick() -> None:
    """16 adapters over 4 servers of 2 slots, requests ending as they come: the adapter-aware
    pick loads far less often than one blind to adapters (the view counts its evictions)."""
    import random

    def run(aware: bool) -> int:
        rnd = random.Random(7)
        s = state(A, B, C, "127.0.0.1:4")
        servers = [A, B, C, "127.0.0.1:4"]
        for a in servers:
            s.slots[a] = 4.0
        s.observe({a: page((), max_lora=2) for a in servers})
        weights = [1 / (i + 1) for i in range(16)]
        inflight: list[tuple[float, str, str]] = []
        t = 0.0
        for _ in range(1000):
            t += 0.05
            for end in [x for x in inflight if x[0] <= t]:
                inflight.remove(end)
                s.done(end[1], t, end[2])
            adapter = f"a{rnd.choices(range(16), weights)[0]}"
            p = s.pick("m@v1", t, adapter=adapter if aware else "")
            if not aware:
                s.adapters.started(p.servers[0], adapter, t)
            inflight.append((t + 0.4, p.servers[0], adapter))
        return s.adapters.evictions

    # 8 slots for 16 adapters: the tail (adapters 8 to 16, 23% of requests) must load wherever
    # it goes; holding the head in 7 slots and churning one, the floor is about 0.35x blind.
    aware, blind = run(True), run(False)
    assert aware <= 0.45 * blind, (aware, blind)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["observe", "start", "done"]),
            st.sampled_from([A, B]),
            st.sampled_from(["a", "b", "c", "d"]),
            st.integers(0, 3),
        ),
        max_size=60,
    )
)
def test_any_sequence_keeps_the_view_consistent(ops: list[tuple[str, str, str, int]]) -> None:
    v = AdapterView()
    t = 0.0
    for op, server, adapter, n in ops:
        t += 0.5
        if op == "observe":
            v.observe(server, [adapter] if n % 2 else [], [], n or None, t)
        elif op == "start":
            v.started(server, adapter, t)
        else:
            v.done(server, adapter, t)
        for srv in (A, B):
            st_, harm = v.state(srv, adapter, t)
            assert st_ in (RESIDENT, SLOT_FREE, EVICT, BLOCKED, UNKNOWN) and 0.0 <= harm <= 1.0
            assert (
                all(c >= 1 for c in v.servers.get(srv, None).inflight.values()) if srv in v.servers else True
            )


def test_the_cluster_config_is_read_and_checked() -> None:
    cfg = read_adapter_config(
        json.dumps(
            {
                "placement": "dynamic",
                "adapters": {
                    "x": {"source": "/x", "versions": ["v1"], "endpoints": [A]},
                    "y": {"source": None, "versions": [], "endpoints": []},
                },
            }
        )
    )
    assert cfg.placement == "dynamic"
    assert cfg.servers("x", "v1", [A, B]) == frozenset({A})
    assert cfg.servers("x", "v2", [A, B]) == frozenset()
    assert cfg.servers("y", "v1", [A, B]) is None
    for bad in (
        "nope",
        "[]",
        '{"placement": "sometimes", "adapters": {}}',
        '{"placement": "static", "adapters": {"x": 1}}',
    ):
        with pytest.raises(AdapterConfigError):
            read_adapter_config(bad)
