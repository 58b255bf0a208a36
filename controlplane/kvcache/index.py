"""The precise prefix index (pure): which server holds which blocks, from the servers' own
KV events, bounded in memory, shared by every model the picker serves.

Per server it keeps one stream: the last sequence number applied, the block size the server
reported, and its blocks (the server's hash -> the block's key, blocks.py). Batches are
applied in sequence order:

- **The next batch** is applied: stored blocks are keyed by chaining from their parent (a
  stored event whose parent the index does not hold cannot be keyed and is skipped, counted
  as an orphan: a miss, never a false hit), removed blocks are dropped, AllBlocksCleared
  drops the server's every block.
- **A batch past a gap** is not applied: `apply` answers GAP, and the caller asks the
  server's replay socket for the missing batches. Where the replay cannot fill the gap, the
  caller calls `forget`: the server's blocks are dropped rather than trusted (a removal may
  be among the lost batches), and its stream starts again from the next batch.
- **A batch at or before the last one applied** is a new stream (the server restarted, its
  sequence numbers start at 0 again): the server's blocks are dropped, then it is applied.
- **A block size other than the stream's** is refused (the event, not the stream).
- **After a replay** (`replayed`), live batches up to the last one replayed are duplicates.

Every change touches only the server whose stream it came in on: a bad publisher spoils its
own entries and no other server's (the keys are computed here from token ids, not taken
from the servers' hashes).

**The bound**: at most `max_blocks` blocks over all servers. Past it, the server holding the
most loses its oldest (first stored) blocks. Each block costs two dictionary entries and
their integers: about BYTES_PER_BLOCK bytes (measured in tests/unit/test_kv_index.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from controlplane.kvcache.blocks import block_key, root
from controlplane.kvcache.mirror import ADD, BLOCK_SIZE, CLEAR, PUBLISHED, REMOVE
from controlplane.kvcache.wire import Batch, Cleared, Removed, Stored

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
STEP_BLOCKS = 256  # blocks stored between two yields of apply_steps (about 0.3 ms here)
MAX_BLOCKS = 1 << 20  # about 140 MB at the measured cost: a fleet's worth of GPU caches
BYTES_PER_BLOCK = 140  # measured: tests/unit/test_kv_index.py::test_the_bytes_per_block_are_as_documented


class Applied(StrEnum):
    APPLIED = "applied"
    GAP = "gap"  # not applied: batches are missing before it (replay, else forget)
    RESTART = "restart"  # a new stream: the server's blocks dropped, then applied
    DUPLICATE = "duplicate"  # already applied from a replay: nothing to do


SHARDS = 64  # each map is split in this many dicts: a dict's resize is O(its size), so no pause is long


class Sharded(Generic[K, V]):
    """A mapping split over SHARDS dicts by the key's hash: a million entries never resize at
    once (a resize of one dict of a million is tens of milliseconds on the event loop). The
    index uses only what a dict has (`get`, `in`, `[k] = v`, `pop(k, None)`, `len`, `clear`), so
    where no pick shares its loop (its own process) it keeps plain dicts, each operation in C."""

    __slots__ = ("_len", "_maps")

    def __init__(self) -> None:
        self._maps: list[dict[K, V]] = [{} for _ in range(SHARDS)]
        self._len = 0

    def _map(self, k: K) -> dict[K, V]:
        return self._maps[hash(k) & (SHARDS - 1)]

    def get(self, k: K) -> V | None:
        return self._map(k).get(k)

    def __contains__(self, k: object) -> bool:
        return k in self._maps[hash(k) & (SHARDS - 1)]

    def __setitem__(self, k: K, v: V) -> None:
        m = self._map(k)
        if k not in m:
            self._len += 1
        m[k] = v

    def pop(self, k: K, default: None = None) -> V | None:
        m = self._map(k)
        if k in m:
            self._len -= 1
            return m.pop(k)
        return default

    def clear(self) -> None:
        for m in self._maps:
            m.clear()
        self._len = 0

    def values(self) -> Iterator[V]:
        for m in self._maps:
            yield from m.values()

    def keys(self) -> set[K]:
        """Every key (a copy, O(its size): for tests and tools)."""
        return {k for m in self._maps for k in m}

    def __len__(self) -> int:
        return self._len


@dataclass
class Stream:
    """One server's publisher as the index follows it."""

    server: str = ""
    seq: int | None = None  # the last batch applied (None: none yet)
    block_size: int | None = None
    # The server's hash -> key, and key -> the server's hash: Sharded, or dicts (KvIndex.sharded).
    blocks: Sharded[Hashable, int] | dict[Hashable, int] = field(default_factory=Sharded)
    keys: Sharded[int, Hashable] | dict[int, Hashable] = field(default_factory=Sharded)
    order: deque[Hashable] = field(default_factory=deque)  # hashes as stored, oldest first (some gone)
    last_event_at: float | None = None
    replayed_to: int | None = None  # batches up to this came by replay: live copies are duplicates
    orphans: int = 0  # stored events skipped: their parent was not held
    refused: int = 0  # events refused: a block size other than the stream's


def run(steps: Generator[None, None, Applied]) -> Applied:
    """Every step of an apply_steps at once; its outcome."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


@dataclass
class KvIndex:
    max_blocks: int = MAX_BLOCKS
    streams: dict[str, Stream] = field(default_factory=dict)
    size: int = 0  # blocks held over every server
    evicted: int = 0  # blocks dropped for the bound
    # Every change to the keys a server holds, in order, for a mirror in another process
    # (kvcache/mirror.py: its ops); None: not kept. The owner drains it.
    journal: list[tuple[int, str, int]] | None = None
    # Each server's maps split in Sharded dicts (no long resize: picks share this loop), or, in
    # a process of its own where nothing waits on a resize, plain dicts (a third less CPU).
    sharded: bool = True

    def stream(self, server: str) -> Stream:
        st = self.streams.get(server)
        if st is None:
            st = self.streams[server] = Stream(server) if self.sharded else Stream(server, blocks={}, keys={})
        return st

    def apply(self, server: str, batch: Batch, now: float) -> Applied:
        """A batch from `server`'s publisher, in the order it came (see the module's text)."""
        return run(self.apply_steps(server, batch, now))

    def apply_steps(
        self, server: str, batch: Batch, now: float, step: int = STEP_BLOCKS
    ) -> Generator[None, None, Applied]:
        """`apply`, yielding after every `step` blocks stored, so that a caller on an event loop
        lets other work run between (a batch of thousands of blocks is a millisecond or more
        of work); it returns the outcome. Between two steps the server's entries hold part of
        the batch: a prefix of a prompt's chain, never a block without the one before."""
        outcome = self._begin(server, batch, now)
        if outcome in (Applied.GAP, Applied.DUPLICATE):
            return outcome
        st = self.stream(server)
        for event in batch.events:
            if isinstance(event, Stored):
                yield from self._store(st, event, step)
            elif isinstance(event, Removed):
                for h in event.hashes:
                    self._drop(st, h)
            elif isinstance(event, Cleared):
                self._clear(st)
            self._bound()
        return outcome

    def _begin(self, server: str, batch: Batch, now: float) -> Applied:
        st = self.stream(server)
        outcome = Applied.APPLIED
        if st.replayed_to is not None:
            if batch.seq <= st.replayed_to:
                return Applied.DUPLICATE
            st.replayed_to = None
        if st.seq is not None and batch.seq > st.seq + 1:
            return Applied.GAP
        if st.seq is not None and batch.seq <= st.seq:
            self.forget(server)
            st = self.stream(server)
            outcome = Applied.RESTART
        st.seq = batch.seq
        st.last_event_at = now
        if self.journal is not None:
            self.journal.append((PUBLISHED, server, 0))
        return outcome

    def replayed(self, server: str) -> None:
        """The batches applied so far came by replay: the same batches arriving live after them
        (queued while the replay ran) are duplicates, not a new stream."""
        st = self.stream(server)
        st.replayed_to = st.seq

    def forget(self, server: str) -> None:
        """Drop `server`'s blocks and stream (a gap that cannot be filled, a server gone, a
        publisher reconnected): its next batch starts a new stream."""
        st = self.streams.pop(server, None)
        if st is not None:
            self.size -= len(st.blocks)
            if self.journal is not None:
                self.journal.append((CLEAR, server, 0))

    def keep_only(self, servers: Iterable[str]) -> None:
        """Forget every server not in `servers` (those the fleet no longer has)."""
        wanted = set(servers)
        for server in [s for s in self.streams if s not in wanted]:
            self.forget(server)

    def _clear(self, st: Stream) -> None:
        self.size -= len(st.blocks)
        if self.journal is not None:
            self.journal.append((CLEAR, st.server, 0))
            if st.block_size is not None:
                self.journal.append((BLOCK_SIZE, st.server, st.block_size))
        st.blocks.clear()
        st.keys.clear()
        st.order.clear()

    def _store(self, st: Stream, ev: Stored, step: int) -> Iterator[None]:
        if st.block_size is None:
            st.block_size = ev.block_size
            if self.journal is not None:
                self.journal.append((BLOCK_SIZE, st.server, ev.block_size))
        elif ev.block_size != st.block_size:
            st.refused += 1
            return
        if ev.parent is None:
            parent = root(ev.lora)
        else:
            held = st.blocks.get(ev.parent)
            if held is None:
                st.orphans += 1
                return
            parent = held
        size = ev.block_size
        tokens = ev.token_ids
        # The loop below runs for every block of a flood: its lookups are bound once here.
        blocks, keys, order, journal, server = st.blocks, st.keys, st.order, self.journal, st.server
        for i, h in enumerate(ev.hashes):
            if i and i % step == 0:
                self._bound()
                yield
                if st is not self.streams.get(server):
                    return  # forgotten meanwhile (a reconnect, a server gone)
            if ev.extra is None:
                key = hash((parent, tokens[i * size : (i + 1) * size]))  # block_key's, inline
            else:
                key = block_key(parent, tokens[i * size : (i + 1) * size], ev.extra[i])
            if h in blocks:
                self._drop(st, h)  # a hash stored again (or reused for other tokens): the new one counts
            other = keys.get(key)
            if other is not None:  # the same tokens under another hash: one entry
                self._drop(st, other)
            blocks[h] = key
            keys[key] = h
            order.append(h)
            self.size += 1
            if journal is not None:
                journal.append((ADD, server, key))
            parent = key
        if len(st.order) > 2 * len(st.blocks) + 4096:  # hashes removed since: compact
            st.order = deque(h for h in st.order if h in st.blocks)

    def _drop(self, st: Stream, h: Hashable) -> None:
        key = st.blocks.pop(h, None)
        if key is not None:
            st.keys.pop(key, None)
            self.size -= 1
            if self.journal is not None:
                self.journal.append((REMOVE, st.server, key))

    def _bound(self) -> None:
        while self.size > self.max_blocks:
            st = max(self.streams.values(), key=lambda s: len(s.blocks))
            drop = min(len(st.blocks), self.size - self.max_blocks, 4096)
            blocks, keys, order, journal, server = st.blocks, st.keys, st.order, self.journal, st.server
            dropped = 0
            while dropped < drop and order:
                key = blocks.pop(order.popleft(), None)  # _drop's, inline: every block of a flood
                if key is not None:  # not removed since (then it is no more in the order's count)
                    keys.pop(key, None)
                    if journal is not None:
                        journal.append((REMOVE, server, key))
                    dropped += 1
            self.size -= dropped
            self.evicted += dropped

    @property
    def index_blocks(self) -> int:
        """Blocks in the index, every server (what its gauge shows)."""
        return self.size

    def held_blocks(self, server: str) -> int:
        """How many blocks `server` holds (0: none known)."""
        st = self.streams.get(server)
        return len(st.blocks) if st is not None else 0

    def block_size(self, server: str) -> int | None:
        st = self.streams.get(server)
        return st.block_size if st is not None else None

    def held(self, server: str, keys: list[int]) -> int:
        """How many of `keys` (a prompt's blocks, first to last) `server` holds from the first
        on: its longest cached prefix, in blocks."""
        st = self.streams.get(server)
        if st is None:
            return 0
        n = 0
        for key in keys:
            if key not in st.keys:
                break
            n += 1
        return n

    def matched(self, servers: Iterable[str], keys_by_size: Mapping[int, list[int]]) -> dict[str, int]:
        """Each of `servers`' longest cached prefix in blocks, for a prompt keyed per block
        size (a server is matched on the keys of its own block size; none: 0)."""
        out = {}
        for server in servers:
            st = self.streams.get(server)
            keys = keys_by_size.get(st.block_size or 0) if st is not None else None
            out[server] = self.held(server, keys) if keys else 0
        return out
