"""A copy of the precise index's keys, kept from its journal (pure).

The precise index (index.py) decodes, keys and bounds the servers' KV events in a process of
its own (picker/kv_process.py), at a low CPU priority, so that a flood of events never takes
the picks' cores nor their interpreter. What a pick needs of it is small: which keys each
server holds, and each server's block size. The index writes every change to those in its
journal, in order; the process sends the journal to the picker in runs (`runs`), and the
picker keeps them here: about 0.2 us a key (mostly a cache miss into a table of a million),
where decoding and keying them was microseconds a block.

Ops: ADD and REMOVE a server's key, CLEAR a server (its stream dropped, or AllBlocksCleared),
BLOCK_SIZE (a server's block size, once known), PUBLISHED (a batch of the server's was
applied: it publishes, so it is not stale), SLOT (where the server's keys are in the shared
table).

**With a shared table** (table.py; where the machine has memfd, as Linux does), the index's
process writes the keys there itself and sends no ADD or REMOVE: this copy then holds only
each server's slot, block size and count of blocks (from the process's stats), and reads the
table for a pick's prompt. Without one, it keeps the keys in its own dicts, as below.

Each server's keys are split over SHARDS dicts by their low bits: a dict whose deleted entries
have used up its room is rebuilt whole on its next insert, and under a flood's churn a dict of
half a million keys was rebuilt every few seconds, 10-30 ms each time on the picks' loop
(index.Sharded, for the same reason). A shard's rebuild is a few thousand keys. The price is a
loop in Python over the keys (0.37 us a key added or removed, against 0.22 in one dict's bulk
update; measured with a flood's churn of 1,000 adds and 1,000 removals, the largest step
0.7 ms against 31 ms). Grouping each run's keys by shard in the index's process, so that each
group was one bulk update, cost as much again in the groups' own overhead (tried, not kept).

About BYTES_PER_KEY bytes a key here (a dict entry and its integer), beside the index's own
index.BYTES_PER_BLOCK in its process; `max_blocks` bounds this copy too: a journal that would
grow it past twice the index's bound (which the index never lets happen) clears it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controlplane.kvcache.table import KeyTable

ADD, REMOVE, CLEAR, BLOCK_SIZE, PUBLISHED, SLOT = 1, 2, 3, 4, 5, 6
RUN_KEYS = 2048  # keys in one run (and one message of the index's process) at most
# Keys applied at once (`steps`): about 0.1 ms of the picks' loop (a dict insert or delete is
# 0.1-0.3 us into a table of a million: mostly a cache miss).
STEP_KEYS = 256
BYTES_PER_KEY = (
    70  # measured: tests/unit/test_kv_mirror.py::test_the_mirrors_bytes_per_block_are_as_documented
)
SHARDS = 256  # dicts per server (a power of two): a key's shard is its low bits
_MASK = SHARDS - 1
_GONE = object()


def runs(journal: Sequence[tuple[int, str, int]], most: int = RUN_KEYS) -> list[list[Any]]:
    """The journal as runs `[op, server, values]`: consecutive ADDs (or REMOVEs) of one server
    become one run of their keys (at most `most`); other ops are runs of one value."""
    out: list[list[Any]] = []
    last: list[Any] | None = None
    for op, server, value in journal:
        if (
            last is not None
            and op in (ADD, REMOVE)
            and last[0] == op
            and last[1] == server
            and len(last[2]) < most
        ):
            last[2].append(value)
            continue
        last = [op, server, [value]]
        out.append(last)
    return out


@dataclass
class KvMirror:
    """The keys each server holds, as the index's journal says (see the module's text)."""

    max_blocks: int
    # Per server, its keys in SHARDS dicts of ints to None (key & _MASK), not sets: holding
    # only atoms, the collector never tracks them, where a full collection walks a set's every
    # entry (20 ms a million on the picks' loop).
    keys: dict[str, list[dict[int, None]]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # per server, its keys
    sizes: dict[str, int] = field(default_factory=dict)
    size: int = 0
    evicted: int = 0  # the index's, as its process last said
    # The index's own size, as its process last said (None: not yet). This copy may hold up to
    # one flush's stored blocks more for a moment: it applies a flush's adds before its evictions.
    index_size: int | None = None
    overflows: int = 0  # journals that would have grown this past twice the bound: cleared
    # The shared table the index's process writes (None: the keys are in `keys` above), and
    # each server's slot in it.
    table: KeyTable | None = None
    slots: dict[str, int] = field(default_factory=dict)
    torn_reads: int = 0  # picks whose read of the table overlapped its rebuild: scored uncached

    def apply(self, ops: Iterable[Sequence[Any]]) -> set[str]:
        """Runs from the journal (`runs`), in order; the servers that published."""
        published: set[str] = set()
        for op, server, values in ops:
            if op == ADD:
                shards = self.keys.get(server)
                if shards is None:
                    shards = self.keys[server] = [{} for _ in range(SHARDS)]
                added = 0
                for key in values:
                    shard = shards[key & _MASK]
                    if key not in shard:
                        shard[key] = None
                        added += 1
                self.counts[server] = self.counts.get(server, 0) + added
                self.size += added
            elif op == REMOVE:
                shards = self.keys.get(server)
                if shards is None:
                    continue
                removed = 0
                for key in values:
                    if shards[key & _MASK].pop(key, _GONE) is not _GONE:
                        removed += 1
                self.counts[server] -= removed
                self.size -= removed
            elif op == CLEAR:
                self.forget(server)
            elif op == BLOCK_SIZE:
                self.sizes[server] = int(values[0])
            elif op == PUBLISHED:
                published.add(server)
            elif op == SLOT:
                self.slots[server] = int(values[0])
        if self.size > 2 * self.max_blocks:
            self.clear()
            self.overflows += 1
        return published

    def steps(self, ops: Iterable[Sequence[Any]], step: int = STEP_KEYS) -> Iterator[set[str]]:
        """`apply`, at most `step` keys at a time: yields the servers that published so far in
        each step, so that a caller on an event loop lets the picks run between."""
        for op, server, values in ops:
            for start in range(0, max(1, len(values)), step):
                yield self.apply([(op, server, values[start : start + step])])

    def clear(self) -> None:
        """Forget every server (the index's process is gone: its next one starts empty)."""
        self.keys.clear()
        self.counts.clear()
        self.sizes.clear()
        self.slots.clear()
        self.size = 0

    def forget(self, server: str) -> None:
        self.keys.pop(server, None)
        self.size -= self.counts.pop(server, 0)
        self.sizes.pop(server, None)
        self.slots.pop(server, None)

    def set_counts(self, counts: Mapping[str, int]) -> None:
        """Each server's blocks, as the index's process last said (with a shared table)."""
        if self.table is not None:
            self.counts = {s: int(n) for s, n in counts.items() if s in self.slots}
            self.size = sum(self.counts.values())

    def server_keys(self, server: str) -> set[int]:
        """Every key `server` holds (for tests and tools: a copy, O(its keys))."""
        return {k for shard in self.keys.get(server, ()) for k in shard}

    def keep_only(self, servers: Iterable[str]) -> None:
        wanted = set(servers)
        for server in [
            s for s in self.keys.keys() | self.sizes.keys() | self.slots.keys() if s not in wanted
        ]:
            self.forget(server)

    @property
    def index_blocks(self) -> int:
        """Blocks in the index, every server, as its process last said (this copy's own count
        until it has)."""
        return self.size if self.index_size is None else self.index_size

    def held_blocks(self, server: str) -> int:
        return self.counts.get(server, 0)

    def block_size(self, server: str) -> int | None:
        return self.sizes.get(server)

    def held(self, server: str, keys: list[int]) -> int:
        """How many of `keys` (first to last) `server` holds from the first on."""
        if self.table is not None:
            slot = self.slots.get(server)
            if slot is None or not keys:
                return 0
            held = self.table.held([slot], keys)
            return 0 if held is None else held[0]
        shards = self.keys.get(server)
        if not shards:
            return 0
        n = 0
        for key in keys:
            if key not in shards[key & _MASK]:
                break
            n += 1
        return n

    def matched(self, servers: Iterable[str], keys_by_size: Mapping[int, list[int]]) -> dict[str, int]:
        """As KvIndex.matched: each server's longest cached prefix in blocks, on the keys of its
        own block size (none known: 0)."""
        if self.table is not None:
            return self._matched_in_table(self.table, servers, keys_by_size)
        out = {}
        for server in servers:
            size = self.sizes.get(server)
            keys = keys_by_size.get(size or 0) if size is not None else None
            out[server] = self.held(server, keys) if keys else 0
        return out

    def _matched_in_table(
        self, table: KeyTable, servers: Iterable[str], keys_by_size: Mapping[int, list[int]]
    ) -> dict[str, int]:
        out: dict[str, int] = {}
        by_size: dict[int, list[str]] = {}
        for server in servers:
            out[server] = 0
            size = self.sizes.get(server)
            if size is not None and server in self.slots and keys_by_size.get(size):
                by_size.setdefault(size, []).append(server)
        for size, group in by_size.items():
            held = table.held([self.slots[s] for s in group], keys_by_size[size])
            if held is None:
                self.torn_reads += 1
                continue
            out.update(zip(group, held, strict=True))
        return out
