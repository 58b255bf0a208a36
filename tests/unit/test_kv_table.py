"""The shared key table (kvcache/table.py) against a plain model: per server, a set of keys."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.kvcache import table as kt
from controlplane.kvcache.table import KeyTable, TableInvalid, keys_array

CAPACITY = 1024


def new(capacity: int = CAPACITY) -> KeyTable:
    return KeyTable(bytearray(kt.table_bytes(capacity)), create=True, capacity=capacity)


def model_held(held: set[int], keys: list[int]) -> int:
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


# Keys from a small pool (so that adds, removes and prompts meet), with the extremes of a
# signed 64-bit hash and keys that collide in the table's low bits.
_KEYS = st.one_of(
    st.integers(0, 40),
    st.sampled_from([-(1 << 63), (1 << 63) - 1, -1, 1024, 2048, 1 << 40]),
)
_OP = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.lists(_KEYS, max_size=30)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.lists(_KEYS, max_size=30)),
    st.tuples(st.just("drop"), st.integers(0, 3), st.just([])),
    st.tuples(st.just("rebuild"), st.just(0), st.just([])),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_OP, max_size=40), prompt=st.lists(_KEYS, max_size=40))
def test_the_table_answers_as_a_set_per_server_would(
    ops: list[tuple[str, int, list[int]]], prompt: list[int]
) -> None:
    t = new()
    model: dict[int, set[int]] = {s: set() for s in range(4)}
    for op, slot, keys in ops:
        if op == "add":
            t.add(slot, keys_array(keys))
            model[slot] |= set(keys)
        elif op == "remove":
            t.remove(slot, keys_array(keys))
            model[slot] -= set(keys)
        elif op == "drop":
            t.drop(slot, len(model[slot]))
            model[slot] = set()
        else:
            t.rebuild((s, keys_array(sorted(held))) for s, held in model.items())
            assert t.used == t.live == sum(len(h) for h in model.values())
        assert t.live == sum(len(h) for h in model.values())
        if t.full():
            t.rebuild((s, keys_array(sorted(held))) for s, held in model.items())
    assert t.held([0, 1, 2, 3], keys_array(prompt)) == [model_held(model[s], prompt) for s in range(4)]


def test_a_long_prompt_is_matched_past_the_first_chunks_and_stops_at_the_first_miss() -> None:
    t = new(1 << 14)
    keys = list(range(1000, 1000 + 500))
    t.add(0, keys_array(keys))
    t.add(1, keys_array(keys[:37]))
    t.add(2, keys_array(keys[:100] + keys[101:]))  # the 101st evicted: the rest is no hit
    assert t.held([0, 1, 2, 3], keys_array(keys)) == [500, 37, 100, 0]
    assert t.held([0], keys_array([])) == [0]


def test_a_server_dropped_holds_nothing_and_its_old_entries_go_at_the_rebuild() -> None:
    t = new()
    t.add(5, keys_array(range(100)))
    t.add(6, keys_array(range(100)))
    used = t.used
    t.drop(5, 100)
    assert t.held([5, 6], keys_array(range(100))) == [0, 100]
    assert t.live == 100 and t.used == used
    t.rebuild([(6, keys_array(range(100)))])
    assert t.used == 100 and t.rebuilds == 1
    t.add(5, keys_array(range(10)))  # the slot again, a new server: only its own keys
    assert t.held([5, 6], keys_array(range(100))) == [10, 100]


def test_churn_past_the_load_bound_asks_for_a_rebuild_and_the_rebuild_keeps_only_the_live() -> None:
    t = new()
    live: list[int] = []
    for start in range(0, 5000, 50):
        batch = list(range(start, start + 50))
        t.add(0, keys_array(batch))
        live += batch
        if len(live) > 200:
            t.remove(0, keys_array(live[:50]))
            live = live[50:]
        if t.full():
            t.rebuild([(0, keys_array(live))])
    assert t.rebuilds >= 1
    assert t.live == len(live) == 200
    assert t.held([0], keys_array(live)) == [200]
    assert t.held([0], keys_array([0])) == [0]


def test_a_reader_that_overlapped_a_switch_of_buffers_gets_none() -> None:
    t = new()
    t.add(0, keys_array(range(10)))
    seq = t.header[1].copy()
    original = kt._has

    def switched_meanwhile(view: memoryview, mask: int, e: int) -> bool:
        t.header[1] = seq + np.uint64(1)  # a rebuild began while this read ran
        return original(view, mask, e)

    kt._has = switched_meanwhile  # type: ignore[assignment]
    try:
        assert t.held([0], keys_array(range(10))) is None
    finally:
        kt._has = original  # type: ignore[assignment]
    assert t.held([0], keys_array(range(10))) == [10]


def test_another_process_view_reads_what_the_writer_wrote() -> None:
    buf = bytearray(kt.table_bytes(CAPACITY))
    writer = KeyTable(buf, create=True, capacity=CAPACITY)
    reader = KeyTable(buf)
    writer.add(3, keys_array([7, 8, 9]))
    assert reader.held([3], keys_array([7, 8, 9, 10])) == [3]
    writer.rebuild([(3, keys_array([7]))])
    assert reader.held([3], keys_array([7, 8])) == [1]


def test_a_buffer_that_is_not_a_table_is_refused() -> None:
    with pytest.raises(TableInvalid, match="magic"):
        KeyTable(bytearray(kt.table_bytes(CAPACITY)))
    with pytest.raises(TableInvalid, match="power of two"):
        KeyTable(bytearray(kt.table_bytes(CAPACITY)), create=True, capacity=1000)
    buf = bytearray(kt.table_bytes(CAPACITY))
    KeyTable(buf, create=True, capacity=CAPACITY)
    with pytest.raises(TableInvalid, match="bytes for a table"):
        KeyTable(buf[: len(buf) // 2])


def test_the_capacity_is_a_power_of_two_at_least_four_times_the_bound() -> None:
    assert kt.capacity_for(1 << 20) == 1 << 22
    assert kt.capacity_for(1_000_000) == 1 << 22
    assert kt.capacity_for(10) == 1024


def test_a_rebuild_places_keys_whose_run_passes_the_tables_end() -> None:
    """The rebuild places a sorted run of entries at once; those past the last slot go in from
    the first, where the probing of a lookup wraps to."""
    t = new()
    candidates = np.arange(20_000, dtype=np.int64)
    home = kt.entries(0, 0, candidates.copy()) & np.uint64(CAPACITY - 1)
    near_end = candidates[home >= 1016].tolist()
    near_start = candidates[home < 4].tolist()
    keys = near_end[:30] + near_start[:10]
    assert len(keys) == 40
    t.rebuild([(0, keys_array(keys))])
    assert t.held([0], keys_array(keys)) == [40]
    assert t.held([0], keys_array([*keys, 10**9])) == [40]
    t.remove(0, keys_array(keys[:5]))
    assert t.held([0], keys_array(keys[5:])) == [35]


def test_the_bytes_per_block_are_as_documented() -> None:
    """kv-events.md: 64 to 128 bytes a block of the bound; 64 MiB at the default bound."""
    from controlplane.kvcache.index import MAX_BLOCKS

    assert kt.table_bytes(kt.capacity_for(MAX_BLOCKS)) / MAX_BLOCKS == pytest.approx(
        kt.BYTES_PER_BLOCK, rel=0.01
    )
    assert kt.table_bytes(kt.capacity_for(MAX_BLOCKS)) // (1 << 20) == 64
    worst = (1 << 20) + 1
    assert kt.table_bytes(kt.capacity_for(worst)) / worst <= 2 * kt.BYTES_PER_BLOCK * 1.01  # the header


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=20),
    slot=st.integers(0, kt.SLOTS - 1),
    epoch=st.integers(0, 1 << 40),
)
def test_the_one_at_a_time_entries_are_the_arrays_entries(keys: list[int], slot: int, epoch: int) -> None:
    """`held` reads a prompt's first blocks one at a time, the rest as arrays: the same entries."""
    tag = kt._tag(slot, epoch)
    assert kt.entries(slot, epoch, keys_array(keys)).tolist() == [
        kt._mix_int((k & ((1 << 64) - 1)) ^ tag) for k in keys
    ]
