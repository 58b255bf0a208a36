"""picker/choose.py's free_slot: when every server is full by the picker's view, requests of a
model with flow control wait (pure)."""

from __future__ import annotations

from envoy.config.core.v3 import health_check_pb2

from controlplane.picker.choose import KV_FULL, LOAD_MAX_AGE_S, PickerState, ServerLoad
from tests.unit.test_picker_choose import _cla

A, B = "127.0.0.1:1", "127.0.0.1:2"


def state(*servers: str, health: int = health_check_pb2.HEALTHY) -> PickerState:
    s = PickerState()
    s.assign([_cla("m@v1", [(a, 10, health) for a in servers])])
    return s


def test_known_slots_full_on_every_server_means_no_free_slot() -> None:
    s = state(A, B)
    s.slots.update({A: 2.0, B: 2.0})
    for a in (A, A, B):
        s.started(a, 0.0)
    assert s.free_slot("m@v1", 0.0)  # B has one left
    s.started(B, 0.0)
    assert not s.free_slot("m@v1", 0.0)
    s.done(A, 0.1)
    assert s.free_slot("m@v1", 0.1)


def test_slots_never_seen_are_free_until_a_page_shows_a_request_waiting() -> None:
    s = state(A)
    for _ in range(50):
        s.started(A, 0.0)
    assert s.free_slot("m@v1", 0.0)  # nothing known: as without flow control
    s.observe({A: ServerLoad(0.0, 0.0, 1.0, running=4.0, waiting=0.0)})
    assert s.free_slot("m@v1", 0.0)
    s.observe({A: ServerLoad(6.0, 0.0, 1.0, running=4.0, waiting=2.0)})  # full: its slots are 4
    assert s.slots[A] == 4.0 and not s.free_slot("m@v1", 0.0)


def test_a_server_whose_slots_are_unknown_takes_its_peers() -> None:
    s = state(A, B)
    s.slots[A] = 1.0
    s.started(A, 0.0)
    s.started(B, 0.0)
    assert not s.free_slot("m@v1", 0.0)  # B counts A's one slot


def test_a_full_kv_cache_counts_a_server_full_and_a_stale_page_says_nothing() -> None:
    s = state(A)
    s.slots[A] = 4.0
    s.observe({A: ServerLoad(1.0, 0.0, 1.0, running=1.0, waiting=0.0, kv_use=KV_FULL)})
    assert not s.free_slot("m@v1", 0.0)
    assert s.free_slot("m@v1", LOAD_MAX_AGE_S + 1.0)


def test_no_eligible_server_has_nothing_to_wait_for() -> None:
    assert state(A, health=health_check_pb2.UNHEALTHY).free_slot("m@v1", 0.0)
    assert PickerState().free_slot("nope@v1", 0.0)
