"""The KV events of a real vLLM (0.32, its CPU build, the tests' tiny model), captured by
scripts/capture_vllm_kv_events.py into tests/fixtures/kv_events/vllm/: read as they came,
matched by the prompt as the picker tokenizes it, and the emulator's events written in the
same form (so benchmarks with many emulated servers test the real format)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from controlplane.kvcache import wire
from controlplane.kvcache.blocks import prompt_keys
from controlplane.kvcache.index import KvIndex
from controlplane.kvcache.prompt import Tokenizers, token_ids
from controlplane.sim.prefix_cache import PrefixCache

CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events" / "vllm"


def captured() -> list[list[bytes]]:
    return msgspec.msgpack.decode((CAPTURE / "events.msgpack").read_bytes())  # type: ignore[no-any-return]


def test_the_captured_batches_are_read_in_order_with_the_servers_block_size() -> None:
    batches = [wire.read(f) for f in captured()]
    assert [b.seq for b in batches] == list(range(len(batches)))
    stored = [e for b in batches for e in b.events if isinstance(e, wire.Stored)]
    assert stored and {e.block_size for e in stored} == {128}  # vLLM's CPU block size
    assert all(len(e.token_ids) == 128 * len(e.hashes) for e in stored)


def test_the_replay_answers_are_read_and_end_with_the_marker() -> None:
    answers = msgspec.msgpack.decode((CAPTURE / "replay.msgpack").read_bytes())
    read = [wire.replayed(a) for a in answers]
    assert [seq for seq, _ in read] == [*range(len(read) - 1), wire.END_SEQ]
    assert [wire.read_payload(seq, p) for seq, p in read[:-1]] == [wire.read(f) for f in captured()]


def test_the_picker_tokenizes_each_request_as_vllm_did_so_its_blocks_match() -> None:
    index = KvIndex()
    for f in captured():
        index.apply("vllm", wire.read(f), 0.0)
    tokenizer = Tokenizers().get(str(CAPTURE))
    requests = [r for r in json.loads((CAPTURE / "requests.json").read_text()) if r["body"] is not None]
    held = []
    for r in requests:
        ids = token_ids(tokenizer, json.dumps(r["body"]).encode())
        assert ids is not None
        keys = prompt_keys(ids, 128)
        held.append((index.held("vllm", keys), len(keys)))
    # Every full block of every prompt is found: the chats' (the second shares the first's
    # system prompt and so its blocks) and the token-id completion's.
    assert all(n == total and total > 0 for n, total in held), held


def shape(x: Any) -> Any:
    """A message's structure: maps' keys in order with their values' shapes, types elsewhere."""
    if isinstance(x, dict):
        return [(k, shape(v)) for k, v in x.items()]
    if isinstance(x, list):
        return ["list", shape(x[0]) if x else None]
    return type(x).__name__


def test_the_emulator_writes_what_vllm_writes() -> None:
    real = captured()[0]
    events: list[dict[str, Any]] = []

    class Listener:
        def stored(self, hashes, parent, token_ids, block_size):  # type: ignore[no-untyped-def]
            events.append(wire.stored(hashes, parent, token_ids, block_size))

        def removed(self, hashes):  # type: ignore[no-untyped-def]
            events.append(wire.removed(hashes))

    PrefixCache(100, Listener()).admit([str(i) for i in range(64)])
    ours = wire.frames(0, 1.5, events)
    assert [len(f) for f in ours[:2]] == [len(f) for f in real[:2]] == [0, 8]  # topic, seq
    real_batch, our_batch = msgspec.msgpack.decode(real[2]), msgspec.msgpack.decode(ours[2])
    assert shape(our_batch) == shape(real_batch)
    assert wire.read(list(ours)).events[0] == wire.Stored(
        tuple(events[0]["block_hashes"]), None, tuple(range(64)), 16, None, None
    )
