"""The picker's flow control (docs/flow-control.md): the requests of a model whose every
server is full wait here, on their ext_proc streams, until a slot frees.

The control plane names a picked cluster's flow control in its metadata
(names.FLOW_METADATA_NS `config`, routing/clusters.flow_config). For each such cluster the
picker keeps a queue (flow/queue.py orders it); `Flows` holds them and what each waiting
request needs to be picked when its turn comes:

- **A request that finds no free slot** (PickerState.free_slot), or others already waiting
  in its cluster, waits: its class from `x-priority` (missing or unknown: the default
  class), its tenant from the configured header (missing: the tenant "", one for every
  such request), its size from `content-length`, its deadline its class's longest wait.
- **A slot frees** (a request ends, a page or a peer shows less load): `dispatch` hands
  the next requests in the queue's order their picks, while a slot is free.
- **A deadline passes**: the request is answered 429 (`timeout`); **the queue is full**:
  the requests shed are answered 429 (`full`); **its client goes away**: it is removed.

The queue holds requests only while the picker runs: a picker that dies releases every
request it held (their streams break, and Envoy's failure_mode_allow routes them by the
weights), and one that hangs holds each at most its class's wait (the timeout Envoy was told
to allow, then failure_mode_allow again).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.flow.queue import FlowQueue, Waiting

CONFIG_MAX_BYTES = 64 << 10  # a cluster's flow config as the control plane sends it
TENANT_MAX_BYTES = 256  # a tenant key longer than this waits under its digest
TENANT_LABELS_MAX = 64  # the fleet's tenants a picker names in its metrics; the rest are "other"
DEFAULT_TOKENS = 256  # a waiting request's charge when neither its prompt nor its size is known
BYTES_PER_TOKEN = 4  # its charge from its size otherwise
# Envoy waits for a queued request's answer exactly its class's longest wait (a hung picker
# costs no more); a live picker answers its 429 this much before, so that it comes first.
ANSWER_LEAD_S = 0.25


class FlowConfigError(ValueError):
    pass


@dataclass(frozen=True)
class FlowConfig:
    """A cluster's flow control as the control plane configured it."""

    classes: tuple[str, ...]  # highest first
    default_rank: int
    max_wait_s: tuple[float, ...]  # per class
    max_requests: int
    max_bytes: int
    tenant_header: str
    tenants: frozenset[str] = frozenset()  # named in the fleet: metric labels

    def rank(self, priority: str) -> int:
        """The rank of the class `priority` names; the default class's if it names none."""
        try:
            return self.classes.index(priority) if priority else self.default_rank
        except ValueError:
            return self.default_rank


def read_config(text: str) -> FlowConfig:
    """A cluster's `config` (routing/clusters.flow_config), checked; FlowConfigError says what
    is wrong (the cluster then has no queue: its requests are picked as before)."""
    if len(text) > CONFIG_MAX_BYTES:
        raise FlowConfigError(f"more than {CONFIG_MAX_BYTES} bytes")
    try:
        raw: Any = json.loads(text)
    except ValueError as e:
        raise FlowConfigError(f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise FlowConfigError("not an object")
    classes = raw.get("classes")
    waits = raw.get("max_wait_s")
    if (
        not isinstance(classes, list)
        or not classes
        or not all(isinstance(c, str) for c in classes)
        or not isinstance(waits, list)
        or len(waits) != len(classes)
        or not all(_positive(w) for w in waits)
    ):
        raise FlowConfigError(
            "classes and max_wait_s must be lists of names and positive seconds of one length"
        )
    default = raw.get("default_class")
    if default not in classes:
        raise FlowConfigError(f"default_class {default!r} is not a class")
    bounds = [raw.get("max_requests"), raw.get("max_bytes")]
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in bounds):
        raise FlowConfigError("max_requests and max_bytes must be whole numbers from 1")
    max_requests, max_bytes = int(bounds[0] or 1), int(bounds[1] or 1)
    header = raw.get("tenant_header")
    if not isinstance(header, str) or not header or len(header) > 128:
        raise FlowConfigError("tenant_header must be a header name")
    tenants = raw.get("tenants", [])
    if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
        raise FlowConfigError("tenants must be a list of names")
    return FlowConfig(
        tuple(classes),
        classes.index(default),
        tuple(float(w) for w in waits),
        max_requests,
        max_bytes,
        header.lower(),
        frozenset(tenants[:TENANT_LABELS_MAX]),
    )


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def tenant_key(value: bytes) -> str:
    """The tenant a header's value names: itself, or past TENANT_MAX_BYTES its digest (a
    10 MB key waits as one tenant, and is never kept whole)."""
    if len(value) > TENANT_MAX_BYTES:
        return "sha256:" + hashlib.sha256(value).hexdigest()
    return value.decode(errors="replace")


@dataclass
class Held:
    """A waiting request's stream: what its pick needs, and where its answer goes."""

    future: asyncio.Future[Any]
    asked: Any  # the request's Ask
    kv: Any  # its KvAsk, or None
    tenant_label: str
    klass: str
    arrival: float


SHED_FULL, SHED_TIMEOUT, RELEASED = "full", "timeout", "released"


@dataclass
class ClusterFlow:
    """One cluster's queue and its waiting requests."""

    config: FlowConfig
    queue: FlowQueue = field(init=False)
    held: dict[int, Held] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.queue = FlowQueue(max_requests=self.config.max_requests, max_bytes=self.config.max_bytes)

    def label(self, tenant: str) -> str:
        return tenant if tenant in self.config.tenants else ("" if not tenant else "other")


class Flows:
    """Every cluster's queue (pure but for the futures each waiting request awaits)."""

    def __init__(self) -> None:
        self.clusters: dict[str, ClusterFlow] = {}
        self._ids = 0

    def configure(self, configs: Mapping[str, FlowConfig]) -> list[Held]:
        """The clusters' flow control now; the requests of a cluster that lost its queue (or
        whose queue changed) are returned, to be picked at once."""
        released: list[Held] = []
        for cluster in list(self.clusters):
            if configs.get(cluster) != self.clusters[cluster].config:
                flow = self.clusters.pop(cluster)
                released += flow.held.values()
        for cluster, config in configs.items():
            if cluster not in self.clusters:
                self.clusters[cluster] = ClusterFlow(config)
        return released

    def waiting(self) -> int:
        return sum(len(f.queue) for f in self.clusters.values())

    def enqueue(
        self,
        cluster: str,
        held: Held,
        *,
        rank: int,
        tenant: str,
        now: float,
        size: int,
        tokens: int,
    ) -> tuple[int, list[tuple[Held, str]]]:
        """Queue a request of `cluster`; its id, and the requests shed for room (with
        SHED_FULL), the request itself among them if it did not fit."""
        flow = self.clusters[cluster]
        self._ids += 1
        wait = flow.config.max_wait_s[rank]
        deadline = now + max(wait / 2, wait - ANSWER_LEAD_S)  # the 429 before Envoy gives up waiting
        w = Waiting(self._ids, rank, tenant, now, deadline, size, tokens)
        flow.held[w.id] = held
        out = []
        for s in flow.queue.push(w):
            out.append((flow.held.pop(s.id), SHED_FULL))
        return w.id, out

    def remove(self, cluster: str, id: int) -> None:
        """A waiting request's client went away (or it was answered): out of the queue."""
        flow = self.clusters.get(cluster)
        if flow is not None:
            flow.queue.remove(id)
            flow.held.pop(id, None)

    def expired(self, now: float) -> list[tuple[Held, str]]:
        out = []
        for flow in self.clusters.values():
            for w in flow.queue.expired(now):
                out.append((flow.held.pop(w.id), SHED_TIMEOUT))
        return out

    def next_up(self, cluster: str, may_go: Callable[[Held], bool] | None = None) -> Held | None:
        """The next request of `cluster`'s queue, out of it (None: none waits, or none that
        `may_go`: a request that may go only to some servers, whose slots are all taken);
        its tenant charged its prompt's tokens (flow/queue.py)."""
        flow = self.clusters[cluster]
        accept = None if may_go is None else (lambda w: w.id in flow.held and may_go(flow.held[w.id]))
        w = flow.queue.pop(accept)
        return flow.held.pop(w.id) if w is not None else None
