"""The precise index's keys in memory that the picker and its index's process share (pure, over
a buffer the caller maps).

Under a flood of KV events, the picker's own copy of the index's keys (mirror.py's dicts) cost
it a dictionary insert and delete per block, 200,000 a second, on the picks' loop: the flood
bench's pick p99 rose with how bunched that work was (sent every 100 ms instead of 10, the rise
went from about 1.5 to 4 ms). Here the index's process (picker/kv_process.py) writes the keys
into one table in shared memory, a batch at a time, at its low CPU priority; the picker only
reads it, for the blocks of the prompts it picks for, and does no work per stored block.

- **An entry** is a 64-bit mix of a block's key (blocks.py), its server's slot (a small number
  the index's process gives each server it follows) and that slot's epoch. A server's blocks
  all go at once (a restart, a stream dropped, the server gone) by a new epoch for its slot:
  its old entries no longer match anything, and the next rebuild leaves them out.
- **The table**: open addressing, linear probing, deletes leave a tombstone. Its capacity is at
  least 4x the index's bound (a power of two); past LOAD_MAX of it used (live entries,
  tombstones and old epochs' entries), the writer rebuilds it from the index's own maps into
  the second buffer and switches to it.
- **Readers never wait.** One writer (the index's process); each slot is written whole (8
  aligned bytes), and entries never move once written. A reader may see part of a batch:
  never an entry that was not stored, and at worst a shorter cached prefix than a moment
  later. A reader that overlapped a rebuild's switch of buffers (`seq` moved between its start
  and its end) discards what it read: `held` answers None, and the caller scores that one pick
  as if nothing were cached (x86's store order keeps the rest; no fence is issued).

About BYTES_PER_BLOCK bytes of shared memory a block of the bound (two buffers of 8-byte
entries at 4x the bound, rounded up to a power of two: 64 to 128).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

MAGIC = 0x6B76_7461_626C_6501  # "kvtable", version 1
HEADER_WORDS = 8
_MAGIC, _SEQ, _ACTIVE, _CAPACITY, _SLOTS, _USED, _LIVE, _REBUILDS = range(HEADER_WORDS)
EMPTY, TOMB = 0, 1
SLOTS = 1 << 12  # servers followed at once (each slot's epoch is one word)
LOAD_MAX = 0.75  # used entries (live, tombstones, old epochs) past which the table is rebuilt
PROBES_MAX = 1 << 12  # a probe sequence this long means a table read mid-switch: given up
SPREAD = 4  # capacity: at least this many times the index's bound
BYTES_PER_BLOCK = 2 * 8 * SPREAD  # at a bound that is a power of two (twice that at worst)
# `held` looks at this many blocks of a prompt one at a time (a few array operations cost tens
# of microseconds however short: 35 us for 8 servers and 4 blocks, where this is a few), then
# at FIRST_CHUNK more as arrays, four times more each round.
SCALAR_BLOCKS = 32
FIRST_CHUNK = 64

_U = np.uint64
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E37_79B9_7F4A_7C15
_C1, _C2 = _U(0xBF58_476D_1CE4_E5B9), _U(0x94D0_49BB_1331_11EB)
_S30, _S27, _S31 = _U(30), _U(27), _U(31)


class TableInvalid(ValueError):
    """A buffer that does not hold a table (wrong magic or size)."""


def capacity_for(max_blocks: int) -> int:
    """The table's capacity for an index bound: a power of two, at least SPREAD x the bound."""
    n = 1024
    while n < SPREAD * max(1, max_blocks):
        n <<= 1
    return n


def table_bytes(capacity: int, slots: int = SLOTS) -> int:
    return 8 * (HEADER_WORDS + slots + 2 * capacity)


def keys_array(keys: Sequence[int]) -> NDArray[np.int64]:
    """Block keys (blocks.py: Python's 64-bit hashes, signed) as an array."""
    return np.fromiter(keys, dtype=np.int64, count=len(keys))


def distinct(x: NDArray[Any]) -> NDArray[Any]:
    """`x`'s distinct values, sorted (np.unique hashed them: 0.9 s for a million here, where a
    sort is a tenth of that)."""
    if len(x) < 2:
        return x.copy()
    x = np.sort(x)
    keep = np.empty(len(x), dtype=bool)
    keep[0] = True
    np.not_equal(x[1:], x[:-1], out=keep[1:])
    return x[keep]


def _tag(slot: int, epoch: int) -> int:
    return ((epoch << 16 | slot) * _GOLDEN) & _MASK64


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finalizer, in place; never EMPTY or TOMB (arrays wrap without a warning)."""
    x ^= x >> _S30
    x *= _C1
    x ^= x >> _S27
    x *= _C2
    x ^= x >> _S31
    x[x <= TOMB] += _U(2)
    return x


def _mix_int(x: int) -> int:
    """_mix of one entry, in Python's integers (the same value)."""
    x ^= x >> 30
    x = (x * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D0_49BB_1331_11EB) & _MASK64
    x ^= x >> 31
    return x + 2 if x <= TOMB else x


def _has(view: memoryview, mask: int, e: int) -> bool:
    """Whether entry `e` is in the table `view` (one at a time: _find's scalar twin)."""
    at = e & mask
    for _ in range(PROBES_MAX):
        seen = view[at]
        if seen == e:
            return True
        if seen == EMPTY:
            return False
        at = (at + 1) & mask
    return False


def entries(slot: int, epoch: int, keys: NDArray[np.int64]) -> NDArray[np.uint64]:
    """The table's entries for `keys` of the server in `slot` at `epoch` (never EMPTY or TOMB)."""
    return _mix(keys.view(np.uint64) ^ _U(_tag(slot, epoch)))


_WINDOW = np.arange(8, dtype=np.int64)  # probes looked at at once by _find


def _find(table: NDArray[np.uint64], e: NDArray[np.uint64]) -> NDArray[np.int64]:
    """Each entry's position in `table`, -1 where it is absent. The first len(_WINDOW) probes
    of every entry are read at once (a handful of array operations, where one at a time cost
    ten times more on a short prompt); the rare longer runs go on one probe at a time."""
    mask = len(table) - 1
    w = len(_WINDOW)
    at = (e & _U(mask)).astype(np.int64)
    seen = table[(at[:, None] + _WINDOW) & mask]
    hit, empty = seen == e[:, None], seen == EMPTY
    first_hit = np.where(hit.any(axis=1), hit.argmax(axis=1), w)
    first_empty = np.where(empty.any(axis=1), empty.argmax(axis=1), w)
    out = np.where(first_hit < first_empty, (at + first_hit) & mask, -1)
    which = np.flatnonzero((first_hit == w) & (first_empty == w))
    if not which.size:
        return out
    e, at = e[which], (at[which] + w) & mask
    for _ in range(PROBES_MAX):
        if not which.size:
            break
        seen1 = table[at]
        hit1 = seen1 == e
        out[which[hit1]] = at[hit1]
        go = ~(hit1 | (seen1 == EMPTY))
        which, e, at = which[go], e[go], (at[go] + 1) & mask
    return out


def _insert(table: NDArray[np.uint64], e: NDArray[np.uint64]) -> int:
    """Put entries that are distinct and absent; the EMPTY slots they took. Entries that want
    the same free slot all write it, and the one read back there has it (numpy keeps the last
    write); the others go on to the next slot (a reader may see a loser's entry there for a
    moment: an entry being added anyway)."""
    mask = len(table) - 1
    at = (e & _U(mask)).astype(np.int64)
    took = 0
    for _ in range(len(table)):
        if not e.size:
            break
        seen = table[at]
        free = seen <= TOMB
        table[at[free]] = e[free]
        won = free & (table[at] == e)
        took += int(np.count_nonzero(won & (seen == EMPTY)))
        rest = ~won
        e, at = e[rest], (at[rest] + 1) & mask
    return took


def _place(table: NDArray[np.uint64], e: NDArray[np.uint64]) -> None:
    """Distinct entries into an empty table, as inserting them one by one in the order of their
    home slots would place them: each at its home, or just past the one before it where that
    one reached it (pos[i] = max(home[i], pos[i-1] + 1), which is i + the running max of
    home[j] - j): two sorts' worth of work, where _insert's rounds took a second for a million.
    The few placed past the table's end go in from its start, one probe at a time."""
    mask = len(table) - 1
    home = (e & _U(mask)).astype(np.int64)
    order = np.argsort(home, kind="stable")
    e, home = e[order], home[order]
    step = np.arange(len(e), dtype=np.int64)
    at = np.maximum.accumulate(home - step) + step if len(e) else step
    inside = at <= mask
    table[at[inside]] = e[inside]
    if not inside.all():
        _insert(table, e[~inside])


class KeyTable:
    """The table over `buffer` (a writable buffer of table_bytes(capacity) bytes, zeroed when
    `create`d; shared memory in use). One writer; any number of readers."""

    def __init__(self, buffer: Any, *, create: bool = False, capacity: int = 0) -> None:
        words = np.frombuffer(buffer, dtype=np.uint64)
        if create:
            if capacity < 1024 or capacity & (capacity - 1) or len(words) < table_bytes(capacity) // 8:
                raise TableInvalid(f"capacity {capacity}: not a power of two >= 1024 that fits the buffer")
            words[:HEADER_WORDS] = 0
            words[_CAPACITY], words[_SLOTS] = capacity, SLOTS
            words[_MAGIC] = MAGIC
        if len(words) < HEADER_WORDS or int(words[_MAGIC]) != MAGIC:
            raise TableInvalid("not a KV key table (wrong magic)")
        capacity, slots = int(words[_CAPACITY]), int(words[_SLOTS])
        if len(words) < table_bytes(capacity, slots) // 8:
            raise TableInvalid(f"a buffer of {len(words) * 8} bytes for a table of {capacity}")
        self.header = words[:HEADER_WORDS]
        self.epochs = words[HEADER_WORDS : HEADER_WORDS + slots]
        start = HEADER_WORDS + slots
        self.buffers = (words[start : start + capacity], words[start + capacity : start + 2 * capacity])
        self._views = (self.buffers[0].data, self.buffers[1].data)  # read one at a time
        self.capacity = capacity

    # ---- the writer (the index's process) --------------------------------------------------

    @property
    def _table(self) -> NDArray[np.uint64]:
        return self.buffers[int(self.header[_ACTIVE])]

    def add(self, slot: int, keys: NDArray[np.int64], unique: bool = False) -> int:
        """`keys` held by the server in `slot` (at its epoch); those already in stay. The
        entries added. `unique`: the caller knows the keys are distinct (no sort to make them so)."""
        e = entries(slot, int(self.epochs[slot]), keys)
        if not unique:
            e = distinct(e)
        table = self._table
        e = e[_find(table, e) < 0]
        self.header[_USED] += _U(_insert(table, e))
        self.header[_LIVE] += _U(len(e))
        return len(e)

    def remove(self, slot: int, keys: NDArray[np.int64], unique: bool = False) -> int:
        """The entries removed (keys the server did not hold are left alone)."""
        table = self._table
        e = entries(slot, int(self.epochs[slot]), keys)
        at = _find(table, e if unique else distinct(e))
        at = at[at >= 0]
        table[at] = TOMB
        self.header[_LIVE] -= _U(len(at))
        return len(at)

    def drop(self, slot: int, held: int) -> None:
        """The server in `slot` (holding `held` entries) no longer holds any: a new epoch."""
        self.epochs[slot] += _U(1)
        self.header[_LIVE] -= _U(min(held, int(self.header[_LIVE])))

    def full(self) -> bool:
        return int(self.header[_USED]) > LOAD_MAX * self.capacity

    def rebuild(self, live: Iterable[tuple[int, NDArray[np.int64]]]) -> list[int]:
        """Every live (slot, keys) into the other buffer, then read from it: the tombstones and
        old epochs' entries are gone. Readers that overlapped the switch discard what they read.
        Each (slot, keys)'s entries, in order."""
        self.header[_SEQ] += _U(1)  # the other buffer is about to be written: readers of it stop
        other = 1 - int(self.header[_ACTIVE])
        table = self.buffers[other]
        table[:] = EMPTY
        parts = [distinct(entries(slot, int(self.epochs[slot]), keys)) for slot, keys in live]
        counts = [len(p) for p in parts]
        _place(table, np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64))
        self.header[_ACTIVE] = other
        self.header[_SEQ] += _U(1)
        self.header[_USED] = self.header[_LIVE] = sum(counts)
        self.header[_REBUILDS] += _U(1)
        return counts

    @property
    def live(self) -> int:
        return int(self.header[_LIVE])

    @property
    def used(self) -> int:
        return int(self.header[_USED])

    @property
    def rebuilds(self) -> int:
        return int(self.header[_REBUILDS])

    # ---- readers (the picker) --------------------------------------------------------------

    def held(self, slots: Sequence[int], keys: Sequence[int] | NDArray[np.int64]) -> list[int] | None:
        """For each server's slot, how many of `keys` (a prompt's blocks, first to last) it holds
        from the first on; None if the table was switched under the read. Looks at
        SCALAR_BLOCKS blocks one at a time, then FIRST_CHUNK as arrays, then four times more
        each round, for the servers that held them all so far."""
        seq = int(self.header[_SEQ])
        active = int(self.header[_ACTIVE])
        table, view, mask = self.buffers[active], self._views[active], self.capacity - 1
        ints = keys.tolist() if isinstance(keys, np.ndarray) else list(keys)
        head = [k & _MASK64 for k in ints[:SCALAR_BLOCKS]]
        out = [0] * len(slots)
        alive = []
        for i, slot in enumerate(slots):
            tag = _tag(slot, int(self.epochs[slot]))
            got = 0
            for k in head:
                if not _has(view, mask, _mix_int(k ^ tag)):
                    break
                got += 1
            out[i] = got
            if got == len(head) < len(ints):
                alive.append(i)
        array = keys_array(ints) if alive else None
        start, chunk = len(head), FIRST_CHUNK
        while array is not None and alive and start < len(ints):
            end = min(len(ints), start + chunk)
            part = array[start:end]
            tags = np.array([_tag(slots[i], int(self.epochs[slots[i]])) for i in alive], dtype=np.uint64)
            e = _mix((part.view(np.uint64)[None, :] ^ tags[:, None]).ravel())
            present = (_find(table, e) >= 0).reshape(len(alive), end - start)
            whole: list[bool] = np.asarray(present.all(axis=1)).tolist()
            misses: list[int] = np.asarray(present.argmin(axis=1)).tolist()
            still = []
            for j, i in enumerate(alive):
                if whole[j]:
                    out[i] = end
                    still.append(i)
                else:
                    out[i] = start + misses[j]
            alive, start, chunk = still, end, chunk * 4
        if int(self.header[_SEQ]) != seq:
            return None
        return out
