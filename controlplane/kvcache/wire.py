"""vLLM's KV events on the wire (pure): what a server's publisher sends, read and written.

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'` publishes on a ZMQ PUB
socket, per engine step with cache changes, a multipart message of three frames:

- the topic (the config's `topic`, empty by default);
- the sequence number, 8 bytes big-endian, from 0 at the publisher's start;
- a msgpack `KVEventBatch`: `ts` (a float, seconds), `events`, and `data_parallel_rank`.

Each event is one of (msgspec's tagged structs, the tag under "type"):
- `BlockStored`: `block_hashes` (the server's own hashes, 64-bit integers or digests, in
  chain order), `parent_block_hash` (the block before the first, or None at the prompt's
  start), `token_ids` (every token of those blocks, `block_size` per block), `block_size`,
  `lora_id`, `medium`, `lora_name`, and `extra_keys` (one entry per block: what besides the
  tokens the server hashed, such as multimodal inputs or a cache salt);
- `BlockRemoved`: `block_hashes`, `medium`;
- `AllBlocksCleared`.

The batch is an array (`array_like`: ts, events, data_parallel_rank); the events were arrays
too in vLLM 0.9 to 0.11 (the tag first, then the fields in order) and are maps since (the tag
under "type"; vLLM 0.32 adds extra_keys, group_idx and kv_cache_spec_kind). Every form is
read. The replay socket (ROUTER) takes `(b"", start_seq)` and answers, to a DEALER, `(b"",
topic, seq, payload)` per buffered batch from start_seq, then `(b"", b"", -1, b"")` (vLLM
0.32; earlier versions left the topic out).

Every message is checked against limits.py's KV_* bounds before anything of it is used: a
message that breaks one is refused whole (WireError, with the reason), so a bad publisher
changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from controlplane import limits

END_SEQ = -1  # the replay socket's "no more"


class WireError(ValueError):
    """A message that cannot be taken: the reason names the frame or field."""


@dataclass(frozen=True)
class Stored:
    """Blocks a server cached: its own hashes (chain order), the block before the first (None:
    the prompt's start), every token of the blocks, and what else keyed them."""

    hashes: tuple[Hashable, ...]
    parent: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    lora: str | None = None  # the adapter (lora_name, else lora_id), None for the base model
    extra: tuple[Hashable | None, ...] | None = None  # per block, as the server hashed it


@dataclass(frozen=True)
class Removed:
    hashes: tuple[Hashable, ...]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    seq: int
    ts: float
    events: tuple[Event, ...]


def seq_of(frame: bytes) -> int:
    """A sequence-number frame: 8 bytes, big-endian (signed: the replay's end is -1)."""
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def replayed(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """A replay socket's answer, as a DEALER receives it: (b"", topic, seq, payload) from vLLM
    0.32, (b"", seq, payload) before it; its sequence number (END_SEQ: no more) and payload."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise WireError(f"replay answer of {len(frames)} frames, not (b'', [topic,] seq, payload)")
    return seq_of(frames[-2]), frames[-1]


def read(frames: Sequence[bytes]) -> Batch:
    """A published message (topic, seq, payload) as a Batch; WireError if it is not one."""
    if len(frames) != 3:
        raise WireError(f"{len(frames)} frames, not 3 (topic, sequence, payload)")
    return read_payload(seq_of(frames[1]), frames[2])


# vLLM 0.32's form, decoded and checked in C (msgspec): a batch of a thousand blocks in well
# under a millisecond. Anything else (an older form, or a message that breaks a rule) goes the
# generic way below, which reads every form and names what is wrong.
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_Hash = (
    int | Annotated[bytes, msgspec.Meta(min_length=1, max_length=limits.KV_HASH_MAX_BYTES)]
)  # msgpack: 64-bit


class _Stored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=limits.KV_BLOCKS_PER_EVENT_MAX)]
    parent_block_hash: _Hash | None
    token_ids: list[_TokenId]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=limits.KV_BLOCK_SIZE_MAX)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: Annotated[str, msgspec.Meta(max_length=limits.API_NAME_MAX_CHARS)] | None = None
    extra_keys: list[Any] | None = None


class _Removed(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=limits.KV_BLOCKS_PER_EVENT_MAX)]


class _Cleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[
        list[_Stored | _Removed | _Cleared], msgspec.Meta(max_length=limits.KV_EVENTS_PER_BATCH_MAX)
    ]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(_Batch)


def _fast(seq: int, payload: bytes) -> Batch | None:
    try:
        raw = _DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not math.isfinite(raw.ts):
        return None
    events: list[Event] = []
    for ev in raw.events:
        if isinstance(ev, _Stored):
            n = len(ev.block_hashes)
            if len(ev.token_ids) != ev.block_size * n:
                return None
            if ev.extra_keys is not None and len(ev.extra_keys) != n:
                return None
            events.append(
                Stored(
                    tuple(ev.block_hashes),
                    ev.parent_block_hash,
                    tuple(ev.token_ids),
                    ev.block_size,
                    _adapter(ev.lora_name, ev.lora_id),
                    _extra(ev.extra_keys),
                )
            )
        elif isinstance(ev, _Removed):
            events.append(Removed(tuple(ev.block_hashes)))
        else:
            events.append(Cleared())
    return Batch(seq, raw.ts, tuple(events))


def read_payload(seq: int, payload: bytes) -> Batch:
    if seq < 0:
        raise WireError(f"negative sequence number {seq}")
    if len(payload) > limits.KV_EVENT_MAX_BYTES:
        raise WireError(f"payload of {len(payload)} bytes, above {limits.KV_EVENT_MAX_BYTES}")
    fast = _fast(seq, payload)
    if fast is not None:
        return fast
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError) as e:
        raise WireError(f"payload is not msgpack: {e}") from None
    if isinstance(raw, list | tuple):
        if len(raw) < 2:
            raise WireError("batch: an array of fewer than 2 fields (ts, events)")
        ts, events = raw[0], raw[1]
    elif isinstance(raw, dict):
        if "events" not in raw:
            raise WireError("batch: no 'events'")
        ts, events = raw.get("ts", 0.0), raw["events"]
    else:
        raise WireError(f"batch: a {type(raw).__name__}, not an array or map")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise WireError("batch.ts: not a finite number")
    if not isinstance(events, list):
        raise WireError("batch.events: not an array")
    if len(events) > limits.KV_EVENTS_PER_BATCH_MAX:
        raise WireError(f"batch.events: {len(events)} events, above {limits.KV_EVENTS_PER_BATCH_MAX}")
    return Batch(seq, float(ts), tuple(_event(e, i) for i, e in enumerate(events)))


_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)


def _event(raw: Any, i: int) -> Event:
    where = f"events[{i}]"
    kind: Any
    fields: dict[str, Any]
    if isinstance(raw, list | tuple):
        if not raw or not isinstance(raw[0], str):
            raise WireError(f"{where}: an array without its type first")
        kind, fields = (
            raw[0],
            dict(
                zip(_STORED if raw[0] == "BlockStored" else ("block_hashes", "medium"), raw[1:], strict=False)
            ),
        )
    elif isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    else:
        raise WireError(f"{where}: a {type(raw).__name__}, not an event")
    if kind == "AllBlocksCleared":
        return Cleared()
    if kind == "BlockRemoved":
        return Removed(_hashes(fields.get("block_hashes"), f"{where}.block_hashes"))
    if kind != "BlockStored":
        raise WireError(
            f"{where}.type: {str(kind)[:64]!r} is not BlockStored, BlockRemoved or AllBlocksCleared"
        )
    hashes = _hashes(fields.get("block_hashes"), f"{where}.block_hashes")
    parent = fields.get("parent_block_hash")
    if parent is not None:
        parent = _hash(parent, f"{where}.parent_block_hash")
    size = fields.get("block_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= limits.KV_BLOCK_SIZE_MAX:
        raise WireError(f"{where}.block_size: not a whole number from 1 to {limits.KV_BLOCK_SIZE_MAX}")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens
    ):
        raise WireError(f"{where}.token_ids: not an array of token ids")
    if len(tokens) != size * len(hashes):
        raise WireError(
            f"{where}.token_ids: {len(tokens)} tokens for {len(hashes)} blocks of {size} "
            f"(a block's tokens and its size disagree)"
        )
    lora = _adapter(fields.get("lora_name"), fields.get("lora_id"))
    if lora is not None and (not isinstance(lora, str) or len(lora) > limits.API_NAME_MAX_CHARS):
        raise WireError(f"{where}.lora_name: not a name")
    extra = fields.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise WireError(f"{where}.extra_keys: not one entry per block")
    return Stored(hashes, parent, tuple(tokens), size, lora, _extra(extra))


def _adapter(lora_name: Any, lora_id: Any) -> Any:
    """The adapter a stored block belongs to: its name, else `#id`, else None (the base model)."""
    if lora_name is None and lora_id is not None:
        return f"#{lora_id}"
    return lora_name


def _extra(extra_keys: list[Any] | None) -> tuple[Hashable | None, ...] | None:
    """Each block's extra keys as hashable values; None when there are none at all (vLLM 0.32
    sends one None per block)."""
    if extra_keys is None or all(e is None for e in extra_keys):
        return None
    return tuple(None if e is None else _frozen(e) for e in extra_keys)


def _hashes(raw: Any, where: str) -> tuple[Hashable, ...]:
    if not isinstance(raw, list):
        raise WireError(f"{where}: not an array")
    if len(raw) > limits.KV_BLOCKS_PER_EVENT_MAX:
        raise WireError(f"{where}: {len(raw)} blocks, above {limits.KV_BLOCKS_PER_EVENT_MAX}")
    return tuple(_hash(h, where) for h in raw)


def _hash(h: Any, where: str) -> Hashable:
    """A block hash: a whole number (vLLM's 64-bit integers) or bytes (its digests)."""
    if isinstance(h, int) and not isinstance(h, bool) and -(1 << 63) <= h < 1 << 64:
        return h
    if isinstance(h, bytes | bytearray | str) and 0 < len(h) <= limits.KV_HASH_MAX_BYTES:
        return bytes(h) if not isinstance(h, str) else h
    raise WireError(
        f"{where}: a block hash that is neither a 64-bit integer nor up to {limits.KV_HASH_MAX_BYTES} bytes"
    )


def _frozen(x: Any) -> Hashable:
    """An extra key as something hashable (msgpack arrays come back as lists)."""
    if isinstance(x, list | tuple):
        return tuple(_frozen(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in x.items()))
    return x if isinstance(x, Hashable) else repr(x)


# ---- written, as vLLM writes them (the emulator publishes with these) --------------------------


def stored(
    hashes: Sequence[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int,
    lora: str | None = None,
) -> dict[str, Any]:
    """A BlockStored event as vLLM's msgspec struct encodes it (a map, omit_defaults)."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": lora,
    }


def removed(hashes: Sequence[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


_ENCODER = msgspec.msgpack.Encoder()


def frames(
    seq: int, ts: float, events: Sequence[dict[str, Any]], topic: bytes = b""
) -> tuple[bytes, bytes, bytes]:
    """A published message: topic, 8-byte big-endian seq, the msgpack KVEventBatch."""
    return topic, seq.to_bytes(8, "big"), payload(ts, events)


def payload(ts: float, events: Sequence[dict[str, Any]]) -> bytes:
    """A KVEventBatch as vLLM 0.32 encodes it: an array (ts, events, data_parallel_rank)."""
    return _ENCODER.encode([ts, list(events), 0])
