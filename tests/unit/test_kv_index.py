"""The precise prefix index (kvcache/): vLLM's wire format read (both its array and map forms)
and refused whole when it breaks a bound; the index applies batches in order, asks for a
replay past a gap, starts again on a new stream, keeps each server's entries to itself, and
holds its bound; a prompt's keys match the blocks the emulator's cache publishes."""

from __future__ import annotations

import tracemalloc
from collections.abc import Hashable
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.kvcache import wire
from controlplane.kvcache.blocks import prompt_keys
from controlplane.kvcache.index import BYTES_PER_BLOCK, Applied, KvIndex, run
from controlplane.sim.prefix_cache import BLOCK_TOKENS, PrefixCache, token_id

A, B = "127.0.0.1:8001", "127.0.0.1:8002"


class Collect:
    """A PrefixCache listener that keeps the events as the publisher would send them."""

    def __init__(self) -> None:
        self.events: list[dict[str, object]] = []

    def stored(self, hashes, parent, token_ids, block_size):  # type: ignore[no-untyped-def]
        self.events.append(wire.stored(hashes, parent, token_ids, block_size))

    def removed(self, hashes):  # type: ignore[no-untyped-def]
        self.events.append(wire.removed(hashes))


def batch(seq: int, events: list[dict[str, object]]) -> wire.Batch:
    return wire.read(wire.frames(seq, 1.0, events))


def tokens(n: int, salt: int = 0) -> list[str]:
    return [str(100 + (i * 7 + salt) % 300) for i in range(n)]


def ids(toks: list[str]) -> list[int]:
    return [token_id(t) for t in toks]


def test_both_forms_of_vllms_batches_are_read() -> None:
    as_map = wire.read(wire.frames(3, 12.5, [wire.stored([1, 2], None, list(range(32)), 16), wire.cleared()]))
    assert as_map.seq == 3 and as_map.ts == 12.5
    assert as_map.events == (wire.Stored((1, 2), None, tuple(range(32)), 16, None), wire.Cleared())
    # vLLM 0.9 to 0.11: array_like structs, the tag first
    legacy = msgspec.msgpack.encode(
        [
            12.5,
            [["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU"], ["BlockRemoved", [1], "GPU"]],
            0,
        ]
    )
    read = wire.read([b"", (4).to_bytes(8, "big"), legacy])
    assert read.events == (wire.Stored((1, 2), None, tuple(range(32)), 16, None), wire.Removed((1,)))


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"", b"\x00" * 8], "2 frames"),
        ([b"", b"\x00" * 7, b"\x90"], "sequence frame of 7 bytes"),
        ([b"", b"\x00" * 8, b"\xc1"], "not msgpack"),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode({"ts": 1.0})], "no 'events'"),
        ([b"", b"\x00" * 8, msgspec.msgpack.encode({"ts": float("nan"), "events": []})], "ts"),
        (
            [b"", b"\x00" * 8, wire.payload(1.0, [wire.stored([1], None, list(range(15)), 16)])],
            "15 tokens for 1 blocks of 16",
        ),
        ([b"", b"\x00" * 8, wire.payload(1.0, [wire.stored([1], None, [], 0)])], "block_size"),
        ([b"", b"\x00" * 8, wire.payload(1.0, [{"type": "BlockExploded"}])], "BlockExploded"),
        (
            [b"", b"\x00" * 8, wire.payload(1.0, [wire.stored([b"x" * 65], None, list(range(16)), 16)])],
            "hash",
        ),
        ([b"", b"\x00" * 8, wire.payload(1.0, [wire.stored([1], None, [-1] * 16, 16)])], "token ids"),
        ([b"", b"\x00" * 8, b"\x00" * (5 << 20)], "payload of"),
    ],
)
def test_a_message_that_is_not_a_batch_is_refused_with_its_reason(frames: list[bytes], why: str) -> None:
    with pytest.raises(wire.WireError, match=why):
        wire.read(frames)


def test_stored_blocks_match_a_prompt_from_its_first_block_and_removal_and_clearing_end_it() -> None:
    cache, got = PrefixCache(1000, Collect()), None
    listener = cache.listener
    assert isinstance(listener, Collect)
    prompt = tokens(5 * BLOCK_TOKENS + 3)
    cache.admit(prompt)
    index = KvIndex()
    assert index.apply(A, batch(0, listener.events), 0.0) == Applied.APPLIED
    keys = prompt_keys(ids(prompt), BLOCK_TOKENS)
    assert len(keys) == 5
    assert index.matched([A, B], {BLOCK_TOKENS: keys}) == {A: 5, B: 0}
    # A prompt that extends it: the server's events chain from the cached blocks.
    longer = prompt[: 5 * BLOCK_TOKENS] + tokens(4 * BLOCK_TOKENS, salt=9)
    listener.events.clear()
    assert cache.admit(longer) == 5 * BLOCK_TOKENS
    index.apply(A, batch(1, listener.events), 1.0)
    assert index.held(A, prompt_keys(ids(longer), BLOCK_TOKENS)) == 9
    # Two prompts that share the first blocks and then differ: only the shared ones match.
    other = prompt[: 2 * BLOCK_TOKENS] + tokens(3 * BLOCK_TOKENS, salt=5)
    assert index.held(A, prompt_keys(ids(other), BLOCK_TOKENS)) == 2
    got = index.matched([A], {BLOCK_TOKENS: keys})
    assert got == {A: 5}
    index.apply(A, batch(2, [wire.cleared()]), 2.0)
    assert index.matched([A], {BLOCK_TOKENS: keys}) == {A: 0} and index.size == 0


def test_an_evicted_block_ends_the_match_there() -> None:
    listener = Collect()
    cache = PrefixCache(6, listener)
    first = tokens(4 * BLOCK_TOKENS)
    cache.admit(first)
    cache.admit(tokens(4 * BLOCK_TOKENS, salt=3))  # 8 blocks in a cache of 6: 2 of first's evicted
    index = KvIndex()
    index.apply(A, batch(0, listener.events), 0.0)
    assert index.held(A, prompt_keys(ids(first), BLOCK_TOKENS)) == 0  # its first two are gone
    assert index.size == 6


def test_a_gap_is_not_applied_a_new_stream_starts_again_and_forget_drops_everything() -> None:
    index = KvIndex()
    index.apply(A, batch(0, [wire.stored([1], None, list(range(16)), 16)]), 0.0)
    assert index.apply(A, batch(2, [wire.stored([2], 1, list(range(16)), 16)]), 0.0) == Applied.GAP
    assert index.size == 1 and index.stream(A).seq == 0
    assert index.apply(A, batch(1, [wire.stored([2], 1, list(range(16)), 16)]), 0.0) == Applied.APPLIED
    assert index.size == 2
    # The server restarted: its sequence numbers start again; what it held is gone.
    assert index.apply(A, batch(0, [wire.stored([7], None, list(range(1, 17)), 16)]), 0.0) == Applied.RESTART
    assert index.size == 1
    index.forget(A)
    assert index.size == 0 and A not in index.streams


def test_a_bad_publisher_spoils_only_its_own_entries() -> None:
    index = KvIndex()
    good = [wire.stored([1, 2], None, list(range(32)), 16)]
    index.apply(A, batch(0, good), 0.0)
    keys = prompt_keys(list(range(32)), 16)
    assert index.held(A, keys) == 2
    # B: the same hashes for other tokens (a collision), a wrong block size, orphans, a reset.
    index.apply(B, batch(0, [wire.stored([1, 2], None, list(range(100, 132)), 16)]), 0.0)
    index.apply(B, batch(1, [wire.stored([3], None, list(range(8)), 8)]), 0.0)
    index.apply(B, batch(2, [wire.stored([4], 999, list(range(16)), 16)]), 0.0)
    index.apply(B, batch(3, [wire.removed([1, 2]), wire.cleared()]), 0.0)
    index.apply(B, batch(1, []), 0.0)  # a new stream
    assert index.held(A, keys) == 2
    assert index.stream(B).refused == 0  # the new stream forgot the counts too
    assert index.size == 2


def test_the_bound_holds_and_the_server_holding_most_loses_its_oldest() -> None:
    index = KvIndex(max_blocks=100)
    for seq in range(10):
        toks = list(range(seq * 160, (seq + 1) * 160))
        index.apply(A, batch(seq, [wire.stored(list(range(seq * 10, seq * 10 + 10)), None, toks, 16)]), 0.0)
    index.apply(B, batch(0, [wire.stored(list(range(10)), None, list(range(160)), 16)]), 0.0)
    assert index.size == 100
    assert len(index.streams[B].blocks) == 10  # B held the fewest: untouched
    assert index.evicted == 10
    last = prompt_keys(list(range(9 * 160, 10 * 160)), 16)
    assert index.held(A, last) == 10  # the newest are kept


@pytest.mark.parametrize("sharded", [True, False])
def test_the_bytes_per_block_are_as_documented(sharded: bool) -> None:
    """In the picker's process (Sharded maps) and in the index's own (plain dicts)."""
    index = KvIndex(sharded=sharded)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    n = 20_000
    for seq in range(n // 100):
        toks = list(range(seq * 1600, (seq + 1) * 1600))
        hashes = [(seq * 100 + i) * 2654435761 % (1 << 63) for i in range(100)]
        index.apply(A, batch(seq, [wire.stored(hashes, None, toks, 16)]), 0.0)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_block = grown / n
    assert index.size == n
    print(f"{per_block:.0f} bytes per block")
    assert per_block <= BYTES_PER_BLOCK * 1.2, per_block
    assert per_block >= BYTES_PER_BLOCK * 0.5, per_block  # the figure in the docs is not far off


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("SRC"), st.integers(0, 5), st.integers(0, 3)), max_size=40),
    st.booleans(),
)
def test_the_index_always_agrees_with_the_servers_cache(
    ops: list[tuple[str, int, int]], sharded: bool
) -> None:
    """Whatever a server stores and evicts, the index, fed its events in order, answers each
    prompt's cached prefix as the server's cache does (its maps Sharded or plain dicts)."""
    listener = Collect()
    cache = PrefixCache(12, listener)
    index = KvIndex(sharded=sharded)
    prompts = [tokens((n + 1) * BLOCK_TOKENS, salt=s) for _, n, s in ops]
    for seq, ((op, _, _), prompt) in enumerate(zip(ops, prompts, strict=True)):
        listener.events.clear()
        if op == "C":
            cache = PrefixCache(12, listener)
            listener.events.append(wire.cleared())
        else:
            cache.admit(prompt)
        index.apply(A, batch(seq, list(listener.events)), 0.0)
    for prompt in prompts:
        assert index.held(A, prompt_keys(ids(prompt), BLOCK_TOKENS)) * BLOCK_TOKENS == cache.peek(prompt)


def test_the_emulate_commands_kv_flags_name_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from controlplane.cli.main import main

    assert main(["emulate", "--model", "m", "--tokenizer", str(tmp_path / "none")]) == 2
    assert "--tokenizer: " in capsys.readouterr().err
    assert main(["emulate", "--model", "m", "--kv-replay", "tcp://127.0.0.1:5558"]) == 2
    assert "--kv-replay: needs --kv-events" in capsys.readouterr().err
    args = ["emulate", "--model", "m", "--count", "2", "--kv-events", "tcp://127.0.0.1:5557"]
    assert main(args) == 2
    assert "--kv-events: one server only" in capsys.readouterr().err


def _state(
    index: KvIndex,
) -> dict[str, tuple[dict[Hashable, int | None], dict[int, Hashable | None], list[Hashable]]]:
    """Each server's blocks, keys and order of storing, as plain values (either layout)."""
    out = {}
    for server, stream in index.streams.items():
        held = [h for h in stream.order if h in stream.blocks]
        blocks = {h: stream.blocks.get(h) for h in held}
        keys = {k: stream.keys.get(k) for k in blocks.values() if k is not None and k in stream.keys}
        out[server] = (blocks, keys, held)
    return out


STORES = st.lists(
    st.tuples(
        st.sampled_from([A, B]),
        # hashes from a small space: a hash stored again, within a batch and across batches
        st.lists(st.integers(0, 24), min_size=1, max_size=12),
        st.integers(0, 2),  # tokens from few prompts: the same tokens under another hash
        st.booleans(),  # a removal of some of them after
    ),
    max_size=25,
)


@settings(max_examples=120, deadline=None)
@given(STORES, st.integers(4, 40), st.sampled_from([1, 3, 256]))
def test_both_layouts_leave_the_same_index_and_journal(
    stores: list[tuple[str, list[int], int, bool]], bound: int, step: int
) -> None:
    """Plain dicts (the index's own process) and Sharded maps (the picker's process), fed the
    same batches (hashes stored again, in one batch or later; the same tokens under other
    hashes; removals; the bound), hold the same blocks in the same order and journal the same
    changes."""
    plain = KvIndex(max_blocks=bound, journal=[], sharded=False)
    sharded = KvIndex(max_blocks=bound, journal=[], sharded=True)
    seqs = {A: 0, B: 0}
    for server, hashes, prompt, remove in stores:
        toks = [token_id(t) for t in tokens(len(hashes) * 4, salt=prompt)]
        events = [wire.stored(hashes, None, toks, 4)]
        if remove:
            events.append(wire.removed(hashes[::2]))
        b = batch(seqs[server], events)
        seqs[server] += 1
        for index in (plain, sharded):
            assert run(index.apply_steps(server, b, 0.0, step)) == Applied.APPLIED
    assert plain.journal == sharded.journal
    assert (plain.size, plain.evicted) == (sharded.size, sharded.evicted)
    assert _state(plain) == _state(sharded)
    assert plain.size <= bound
