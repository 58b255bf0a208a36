"""The index's process's side of the shared key table (pure, over table.py): the index's
journal, as runs (mirror.runs), applied to the table, and what the picker must still be told
sent back as runs for its KvMirror."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controlplane.kvcache.mirror import ADD, CLEAR, REMOVE, SLOT
from controlplane.kvcache.table import KeyTable, keys_array


@dataclass
class TableWriter:
    """The index's process's side of a shared table: the journal's runs applied to it (ADD and
    REMOVE as whole runs, CLEAR as a new epoch for the server's slot), and what the picker
    still needs told (SLOT, CLEAR, BLOCK_SIZE, PUBLISHED) handed back as runs to send.

    Slots are given round the table's SLOTS in turn, so that a slot freed by a CLEAR is taken
    again only after every other: a picker that has not yet heard of the CLEAR reads the slot at
    its new epoch, which then holds nothing (never another server's blocks)."""

    table: KeyTable
    slots: dict[str, int] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)  # per slot, its entries
    _next: int = 0

    def _slot(self, server: str, out: list[list[Any]]) -> int | None:
        slot = self.slots.get(server)
        if slot is not None:
            return slot
        size = len(self.table.epochs)
        if len(self.slots) >= size:
            return None
        taken = set(self.slots.values())
        while self._next in taken:
            self._next = (self._next + 1) % size
        slot, self._next = self._next, (self._next + 1) % size
        self.slots[server] = slot
        out.append([SLOT, server, [slot]])
        return slot

    def apply(self, runs_: Iterable[Sequence[Any]]) -> list[list[Any]]:
        """The runs (`runs`), in order; the runs the picker must still be sent. A server's ADD
        and REMOVE runs up to its next other op are netted (a key's last op decides: the table
        is a set) and applied as one add and one remove: under a flood a flush's runs are
        many runs of 256 keys (the index's steps), each a few array operations however short."""
        out: list[list[Any]] = []
        pending: dict[str, list[tuple[NDArray[np.int64], bool]]] = {}
        for op, server, values in runs_:
            if op in (ADD, REMOVE):
                pending.setdefault(server, []).append((keys_array(values), op == ADD))
                continue
            self._settle(server, pending.pop(server, None), out)
            if op == CLEAR:
                slot = self.slots.pop(server, None)
                if slot is not None:
                    self.table.drop(slot, self.counts.pop(slot, 0))
            out.append([op, server, list(values)])
        for server, runs_of in pending.items():
            self._settle(server, runs_of, out)
        return out

    def _settle(
        self, server: str, runs_of: list[tuple[NDArray[np.int64], bool]] | None, out: list[list[Any]]
    ) -> None:
        if not runs_of:
            return
        keys = np.concatenate([k for k, _ in runs_of])[::-1]  # newest first
        flags = np.concatenate([np.full(len(k), a) for k, a in runs_of])[::-1]
        order = np.argsort(keys, kind="stable")  # a key's newest op first among its own
        keys, flags = keys[order], flags[order]
        newest = np.empty(len(keys), dtype=bool)
        newest[:1] = True
        np.not_equal(keys[1:], keys[:-1], out=newest[1:])
        keys, last_added = keys[newest], flags[newest]
        adds, removes = keys[last_added], keys[~last_added]
        slot = self.slots.get(server)
        if removes.size and slot is not None:
            self.counts[slot] -= self.table.remove(slot, removes, unique=True)
        if adds.size:
            slot = self._slot(server, out)
            if slot is None:  # past SLOTS servers: not in the table (no hit for them)
                return
            self.counts[slot] = self.counts.get(slot, 0) + self.table.add(slot, adds, unique=True)

    def rebuild(self, live: Mapping[str, Iterable[int]]) -> None:
        """The table rebuilt from every server's live keys (`live`: the index's own maps), once
        it is full of tombstones and old epochs' entries (`table.full()`)."""
        arrays = {s: keys_array(list(keys)) for s, keys in live.items() if s in self.slots}
        counts = self.table.rebuild((self.slots[s], a) for s, a in arrays.items())
        self.counts = {self.slots[s]: n for s, n in zip(arrays, counts, strict=True)}

    def held_counts(self) -> dict[str, int]:
        return {s: self.counts.get(slot, 0) for s, slot in self.slots.items()}
