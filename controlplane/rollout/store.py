"""Durable rollout and drain state: SQLite in WAL mode, one transaction per transition (thin I/O).

Each model's latest rollout is one row (its spec and machine state as JSON), as is each
model's API layer over the file (overlay.ModelLayer) and each endpoint drain. Every
transition appends audit records (who, when, what, why) in the same transaction, so a
`kill -9` between two transitions loses neither, and a command is acknowledged only once
it is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from controlplane.rollout.machine import Rollout, RolloutSpec, Transition
from controlplane.rollout.overlay import EndpointDrain, ModelLayer

SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    model TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    at REAL NOT NULL,
    who TEXT NOT NULL,
    phase TEXT NOT NULL,
    step INTEGER NOT NULL,
    weight INTEGER NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_model ON audit (model, id);
CREATE TABLE IF NOT EXISTS layers (
    model TEXT PRIMARY KEY,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS drains (
    address TEXT PRIMARY KEY,
    data TEXT NOT NULL
);
"""


class StoreUnavailable(Exception):
    """The store cannot be reached; nothing was written."""


class StoreConflict(Exception):
    """Another replica changed what this write would replace since it was read; nothing was
    written. Reload and try again."""


@dataclass(frozen=True)
class StateChange:
    """What one transition writes besides its audit records: state to store, keys to drop."""

    rollouts: tuple[Rollout, ...] = ()
    layers: tuple[ModelLayer, ...] = ()
    drop_layers: tuple[str, ...] = ()
    drains: tuple[EndpointDrain, ...] = ()
    drop_drains: tuple[str, ...] = ()


@dataclass(frozen=True)
class StoredState:
    rollouts: dict[str, Rollout] = field(default_factory=dict)
    layers: dict[str, ModelLayer] = field(default_factory=dict)
    drains: dict[str, EndpointDrain] = field(default_factory=dict)


class StateStore(Protocol):
    """Where rollout and drain state lives: SQLite here, etcd for several replicas
    (controlplane/ha/). Every write is atomic with its audit records."""

    where: str  # for messages: the file or the etcd endpoints

    async def load(self) -> StoredState: ...

    async def write(self, who: str, transitions: Iterable[Transition], change: StateChange) -> None: ...

    async def history(self, model: str) -> list[AuditRecord]: ...

    def changes(self) -> AsyncIterator[None]:
        """Yields whenever another replica changed the stored state (never, for SQLite)."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class AuditRecord:
    model: str
    at: float  # Unix time
    who: str
    phase: str
    step: int
    weight: int
    reason: str


def rollout_to_json(rollout: Rollout) -> tuple[dict[str, Any], dict[str, Any]]:
    """(spec, machine state) as stored, by SQLite and by etcd."""
    return asdict(rollout.spec), {k: v for k, v in asdict(rollout).items() if k != "spec"}


def layer_from_json(data: dict[str, Any]) -> ModelLayer:
    """A ModelLayer from its stored JSON (JSON has lists where the layer has tuples)."""
    versions = {v: (s[0], s[1]) for v, s in data["versions"].items()}
    return ModelLayer(**{**data, "versions": versions})


def rollout_from_json(spec: dict[str, Any], state: dict[str, Any]) -> Rollout:
    """A Rollout from its stored JSON (older records lack newer spec fields: defaults apply)."""
    spec["steps"] = tuple(spec["steps"])
    return Rollout(spec=RolloutSpec(**spec), **state)


class RolloutStore:
    """Rollout state under a directory: `<state_dir>/controlplane.db`."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "controlplane.db"
        self.where = str(self.path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a committed transition survives power loss
        self.db.executescript(SCHEMA)

    def close_now(self) -> None:
        self.db.close()

    # The StateStore protocol. SQLite writes take about a millisecond (one fsync): done
    # inline, so a command is acknowledged only once it is on disk.

    async def load(self) -> StoredState:
        return StoredState({r.spec.model: r for r in self.all()}, self.layers(), self.drains())

    async def write(self, who: str, transitions: Iterable[Transition], change: StateChange) -> None:
        try:
            self.commit(who, transitions, change)
        except sqlite3.OperationalError as e:
            raise StoreUnavailable(f"{self.where}: {e}") from e

    async def history(self, model: str) -> list[AuditRecord]:
        return self.audit(model)

    async def changes(self) -> AsyncIterator[None]:
        await asyncio.Event().wait()  # one process owns the file: nobody else changes it
        yield

    async def close(self) -> None:
        self.close_now()

    def save(self, rollout: Rollout, transitions: Iterable[Transition], who: str) -> None:
        """Store the rollout's state and its new audit records atomically."""
        self.commit(who, transitions, StateChange(rollouts=(rollout,)))

    def commit(self, who: str, transitions: Iterable[Transition], change: StateChange) -> None:
        """Store rollouts, layers and drains, and append audit records, in one transaction."""
        now = time.time()
        with self._transaction():
            for rollout in change.rollouts:
                spec, state = rollout_to_json(rollout)
                self.db.execute(
                    "INSERT INTO rollouts (model, spec, state, updated_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(model) DO UPDATE SET spec = excluded.spec, state = excluded.state, "
                    "updated_at = excluded.updated_at",
                    (rollout.spec.model, json.dumps(spec), json.dumps(state), now),
                )
            for layer in change.layers:
                self.db.execute(
                    "INSERT OR REPLACE INTO layers (model, data) VALUES (?, ?)",
                    (layer.model, json.dumps(asdict(layer))),
                )
            for model in change.drop_layers:
                self.db.execute("DELETE FROM layers WHERE model = ?", (model,))
            for d in change.drains:
                self.db.execute(
                    "INSERT OR REPLACE INTO drains (address, data) VALUES (?, ?)",
                    (d.address, json.dumps(asdict(d))),
                )
            for address in change.drop_drains:
                self.db.execute("DELETE FROM drains WHERE address = ?", (address,))
            self.db.executemany(
                "INSERT INTO audit (model, at, who, phase, step, weight, reason) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(t.model, now, who, t.phase, t.step, t.weight, t.reason) for t in transitions],
            )

    def layers(self) -> dict[str, ModelLayer]:
        rows = self.db.execute("SELECT data FROM layers ORDER BY model").fetchall()
        return {layer.model: layer for layer in (layer_from_json(json.loads(r[0])) for r in rows)}

    def drains(self) -> dict[str, EndpointDrain]:
        rows = self.db.execute("SELECT data FROM drains ORDER BY address").fetchall()
        return {d.address: d for d in (EndpointDrain(**json.loads(r[0])) for r in rows)}

    def get(self, model: str) -> Rollout | None:
        row = self.db.execute("SELECT spec, state FROM rollouts WHERE model = ?", (model,)).fetchone()
        return None if row is None else rollout_from_json(json.loads(row[0]), json.loads(row[1]))

    def all(self) -> list[Rollout]:
        rows = self.db.execute("SELECT spec, state FROM rollouts ORDER BY model").fetchall()
        return [rollout_from_json(json.loads(s), json.loads(st)) for s, st in rows]

    def audit(self, model: str) -> list[AuditRecord]:
        rows = self.db.execute(
            "SELECT model, at, who, phase, step, weight, reason FROM audit WHERE model = ? ORDER BY id",
            (model,),
        ).fetchall()
        return [AuditRecord(*r) for r in rows]

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")
