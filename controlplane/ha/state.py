"""Rollout and drain state in etcd, shared by every control-plane replica (thin I/O).

Keys under the prefix (default `/controlplane`):

    fleet                      the fleet YAML (controlplane import writes it)
    state/rollouts/<model>     {"spec": ..., "state": ...}
    state/layers/<model>       a ModelLayer
    state/drains/<address>     an EndpointDrain
    audit/<model>/<time>-<id>  one audit record per transition
    leader                     the replica driving rollouts and drains (leased)

A write is one etcd transaction with its audit records. It only succeeds if none of the
state keys it replaces changed since this replica last read them (compared by
mod_revision). Otherwise it raises StoreConflict and nothing is written, so a command
on one replica never silently overwrites a transition made on another. Replicas notice
each other's writes by polling etcd's revision (`changes`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict
from typing import Any

import aetcd

from controlplane.ha.etcd import Etcd
from controlplane.rollout.machine import Transition
from controlplane.rollout.overlay import EndpointDrain
from controlplane.rollout.store import (
    AuditRecord,
    StateChange,
    StoreConflict,
    StoredState,
    StoreUnavailable,
    layer_from_json,
    rollout_from_json,
    rollout_to_json,
)

POLL_S = 0.25  # how often a replica checks etcd's revision for others' changes


class EtcdStateStore:
    """The StateStore protocol over etcd."""

    def __init__(self, etcd: Etcd, replica: str) -> None:
        self.etcd = etcd
        self.url = etcd.url
        self.where = etcd.url.where
        self.replica = replica
        self._revisions: dict[bytes, int] = {}  # state key -> mod_revision last read
        self._loaded_at: int | None = None  # etcd's revision when the state was last loaded
        self._seq = 0

    def _state_key(self, kind: str, name: str) -> bytes:
        return self.url.key("state", kind, name)

    async def load(self) -> StoredState:
        prefix = self.url.key("state") + b"/"
        result = await self.etcd.call(lambda c: c.get_prefix(prefix))
        state = StoredState()
        self._revisions = {}
        self._loaded_at = int(result.header.revision)
        for kv in result:
            self._revisions[kv.key] = kv.mod_revision
            kind, _, name = kv.key[len(prefix) :].decode().partition("/")
            data = json.loads(kv.value)
            if kind == "rollouts":
                state.rollouts[name] = rollout_from_json(data["spec"], data["state"])
            elif kind == "layers":
                state.layers[name] = layer_from_json(data)
            elif kind == "drains":
                state.drains[name] = EndpointDrain(**data)
        return state

    async def write(self, who: str, transitions: Iterable[Transition], change: StateChange) -> None:
        puts: list[tuple[bytes, bytes]] = []
        for r in change.rollouts:
            spec, state = rollout_to_json(r)
            puts.append(
                (
                    self._state_key("rollouts", r.spec.model),
                    json.dumps({"spec": spec, "state": state}).encode(),
                )
            )
        for layer in change.layers:
            puts.append((self._state_key("layers", layer.model), json.dumps(asdict(layer)).encode()))
        for d in change.drains:
            puts.append((self._state_key("drains", d.address), json.dumps(asdict(d)).encode()))
        deletes = [self._state_key("layers", m) for m in change.drop_layers]
        deletes += [self._state_key("drains", a) for a in change.drop_drains]
        now = time.time()
        for t in transitions:
            self._seq += 1
            record = {
                "model": t.model,
                "at": now,
                "who": who,
                "phase": t.phase,
                "step": t.step,
                "weight": t.weight,
                "reason": t.reason,
            }
            key = self.url.key("audit", t.model, f"{time.time_ns():020d}-{self.replica}-{self._seq:06d}")
            puts.append((key, json.dumps(record).encode()))

        state_prefix = self.url.key("state") + b"/"
        guarded = [k for k, _ in puts if k.startswith(state_prefix)] + deletes

        async def txn(c: aetcd.Client) -> tuple[bool, Any]:
            tx = c.transactions
            compare = [tx.mod(k) == self._revisions.get(k, 0) for k in guarded]
            ops = [tx.put(k, v) for k, v in puts] + [tx.delete(k) for k in deletes]
            return await c.transaction(compare=compare, success=ops, failure=[])  # type: ignore[no-any-return]

        succeeded, responses = await self.etcd.call(txn)
        if not succeeded:
            raise StoreConflict(f"{self.where}: changed by another replica")
        # Every key this transaction wrote now has its revision: remember it, so our next
        # write of them compares against our own change (and still catches anyone else's).
        if responses:
            first = responses[0]
            kind = first.WhichOneof("response")
            revision = int(getattr(first, kind).header.revision)
            for k, _ in puts:
                if k.startswith(state_prefix):
                    self._revisions[k] = revision
            for k in deletes:
                self._revisions.pop(k, None)

    async def history(self, model: str) -> list[AuditRecord]:
        result = await self.etcd.call(lambda c: c.get_prefix(self.url.key("audit", model) + b"/"))
        records = sorted(result, key=lambda kv: kv.key)
        return [AuditRecord(**json.loads(kv.value)) for kv in records]

    async def revision(self) -> int:
        """etcd's current revision: it moves whenever anything under any key changes."""
        got = await self.etcd.call(lambda c: c.get(self.url.key("fleet")))
        if got is not None:
            return int(got.header.revision)
        head = await self.etcd.call(lambda c: c.get_prefix(self.url.key("state") + b"/"))
        return int(head.header.revision)

    async def changes(self) -> AsyncIterator[None]:
        """Yield whenever etcd's revision moved: first against the revision the state was last
        loaded at, so that a change made between that load and the first poll here (another
        replica's rollout started while this one was starting, or while its member was lost)
        is not taken for the baseline and missed; then against the last poll."""
        seen: int | None = None
        while True:
            try:
                rev = await self.revision()
            except StoreUnavailable:
                await asyncio.sleep(POLL_S * 4)
                continue
            base = self._loaded_at if seen is None else seen
            seen = rev
            if base is not None and rev != base:
                yield None
            await asyncio.sleep(POLL_S)

    async def close(self) -> None:
        await self.etcd.close()


def new_replica_id() -> str:
    return uuid.uuid4().hex[:8]
