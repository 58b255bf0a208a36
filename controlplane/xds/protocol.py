"""The per-stream xDS protocol as a pure object (sans-IO), for SotW and delta, ADS or one type.

Feed it requests (`receive`) and snapshots (`set_snapshot`); it returns events: bytes to
send, ACKs, NACKs, stale nonces. It never does I/O, so every protocol corner is unit-tested.

Rules it keeps:
- one response in flight per type: the next goes out only after the ACK or NACK, so a slow
  proxy gets the latest state, coalesced, never a backlog;
- a NACKed response is never re-sent: the same content waits until it changes;
- stale nonces are ignored (SotW: the whole request; delta: only its ACK part);
- on ADS with a wildcard cluster subscription (Envoy), make-before-break: a route is sent
  only once every cluster it names has been ACKed with its endpoints, and a cluster is
  removed only after no route the proxy has (or is being sent) names it.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from controlplane.routing.translate import CLUSTER, ENDPOINT, LISTENER, ROUTE, TYPE_URLS
from controlplane.xds import wire
from controlplane.xds.snapshot import Snapshot, SnapshotResource

FULL_STATE_TYPES = frozenset({LISTENER, CLUSTER})
WILDCARD = "*"


@dataclass(frozen=True)
class Send:
    """Write `payload` (a serialised response) to the stream."""

    type_url: str
    nonce: str
    version: str
    payload: bytes
    names: tuple[str, ...]
    removed: tuple[str, ...]
    generation: int


@dataclass(frozen=True)
class Ack:
    """The proxy applied a response. `latency_s` runs from the snapshot's creation."""

    type_url: str
    nonce: str
    version: str
    generation: int
    latency_s: float


@dataclass(frozen=True)
class Nack:
    """The proxy rejected a response; it keeps its previous config."""

    type_url: str
    nonce: str
    version: str
    message: str


@dataclass(frozen=True)
class NackCleared:
    """The desired config went back to what the proxy has: its rejection no longer matters."""

    type_url: str


@dataclass(frozen=True)
class StaleNonce:
    type_url: str
    nonce: str


@dataclass(frozen=True)
class UnknownType:
    type_url: str


@dataclass(frozen=True)
class NodeIdentified:
    node_id: str
    cluster: str
    user_agent: str


Event = Send | Ack | Nack | NackCleared | StaleNonce | UnknownType | NodeIdentified


@dataclass
class _InFlight:
    nonce: str
    version: str
    resources: dict[str, SnapshotResource]
    removed: frozenset[str]
    generation: int
    created_at: float
    complete: bool = True  # it carried everything desired at `generation` (nothing held back)


@dataclass
class TypeState:
    """What one stream knows about one resource type."""

    requested: bool = False
    wildcard: bool = False
    names: frozenset[str] = frozenset()
    latest_nonce: str = ""
    in_flight: _InFlight | None = None
    responded: bool = False
    # What the proxy has, as far as we know: name -> version, and the resource when we sent it.
    acked: dict[str, str] = field(default_factory=dict)
    acked_res: dict[str, SnapshotResource] = field(default_factory=dict)
    acked_version: str = ""  # also the content key of what the proxy holds
    last_subscription: tuple[bool, frozenset[str]] = (False, frozenset())
    # NACK memory: full-state content key, or per-resource versions.
    rejected_key: str = ""
    rejected: dict[str, str] = field(default_factory=dict)
    last_error: str = ""
    last_nacked: bool = False
    answered: set[str] = field(default_factory=set)
    # XOR of per-(name, version) hashes of `acked`: the proxy's state version in O(1).
    state_xor: int = 0
    last_names: tuple[int, int] = (0, 0)  # length and hash of the last SotW names list
    # Whether to keep the resource objects the proxy holds (routes and clusters need them
    # for make-before-break; endpoint assignments do not, and are the bulk).
    keep_resources: bool = True
    # The snapshot generation this type was last found fully in sync with (-1: not known).
    settled: int = -1

    def unsettle(self) -> None:
        """The subscription changed: recompute on the next pump, even after an ACK."""
        self.settled = -1
        if self.in_flight is not None:
            self.in_flight.complete = False

    def hold(self, name: str, version: str, res: SnapshotResource | None = None) -> None:
        """Record that the proxy holds `name` at `version`."""
        old = self.acked.get(name)
        if old is not None:
            self.state_xor ^= _h(name, old)
        self.acked[name] = version
        self.state_xor ^= _h(name, version)
        if res is not None and self.keep_resources:
            self.acked_res[name] = res
        else:
            self.acked_res.pop(name, None)

    def drop(self, name: str) -> None:
        """Record that the proxy no longer holds `name`."""
        old = self.acked.pop(name, None)
        if old is not None:
            self.state_xor ^= _h(name, old)
        self.acked_res.pop(name, None)

    def state_after(self, updates: dict[str, SnapshotResource], removed: Iterable[str]) -> str:
        """The state version once `updates` and `removed` are applied, without a full scan."""
        x = self.state_xor
        for name in removed:
            if name in self.acked:
                x ^= _h(name, self.acked[name])
        for name, res in updates.items():
            if name in self.acked:
                x ^= _h(name, self.acked[name])
            x ^= _h(name, res.version)
        return f"{x:016x}"


_SHARED_NAMES: OrderedDict[frozenset[str], frozenset[str]] = OrderedDict()


def shared_names(names: Iterable[str]) -> frozenset[str]:
    """One frozenset per distinct subscription, of interned strings, shared by every stream:
    a thousand proxies subscribed to the same thousand clusters hold one set, not a thousand."""
    key = frozenset(sys.intern(n) for n in names)
    found = _SHARED_NAMES.get(key)
    if found is not None:
        _SHARED_NAMES.move_to_end(key)
        return found
    _SHARED_NAMES[key] = key
    if len(_SHARED_NAMES) > 256:
        _SHARED_NAMES.popitem(last=False)
    return key


@functools.lru_cache(maxsize=1 << 16)
def _h(name: str, version: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{name}\0{version}".encode(), digest_size=8).digest(), "big")


def _key(resources: Iterable[tuple[str, str]]) -> str:
    h = hashlib.blake2b(digest_size=6)
    for name, version in sorted(resources):
        h.update(name.encode())
        h.update(b"\0")
        h.update(version.encode())
        h.update(b"\n")
    return h.hexdigest()


class XdsStream:
    """Protocol state of one xDS stream (ADS carries every type; other services one)."""

    def __init__(
        self,
        snapshot: Snapshot,
        *,
        delta: bool,
        ads: bool = True,
        type_url: str | None = None,
    ) -> None:
        if not ads and type_url is None:
            raise ValueError("a non-ADS stream serves exactly one type_url")
        self.snapshot = snapshot
        self.delta = delta
        self.ads = ads
        self.fixed_type = type_url
        self.types: dict[str, TypeState] = {}
        self.node_id = ""
        self._nonce = 0
        self._unknown_reported: set[str] = set()
        # A cluster new to the proxy warms on EDS sent after it: name -> CDS response nonce.
        self._eds_fresh_after: dict[str, int] = {}

    # ---- inputs -------------------------------------------------------------------------

    def set_snapshot(self, snapshot: Snapshot, now: float) -> list[Event]:
        """A new desired state: send what changed, in make-before-break order."""
        previous = self.snapshot.generation
        self.snapshot = snapshot
        return list(self._pump(fast_from=previous if snapshot.parent == previous else None))

    def receive(
        self,
        request: discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest,
        now: float,
    ) -> list[Event]:
        """One request from the proxy: subscription change, ACK or NACK."""
        events: list[Event] = []
        if request.HasField("node") and request.node.id and not self.node_id:
            self.node_id = request.node.id
            events.append(NodeIdentified(request.node.id, request.node.cluster, request.node.user_agent_name))
        type_url = request.type_url or (self.fixed_type or "")
        if type_url not in TYPE_URLS or (self.fixed_type and type_url != self.fixed_type):
            if type_url not in self._unknown_reported:
                self._unknown_reported.add(type_url)
                events.append(UnknownType(type_url))
            return events
        ts = self.types.get(type_url)
        if ts is None:
            ts = self.types[type_url] = TypeState(keep_resources=type_url != ENDPOINT)
        if isinstance(request, discovery_pb2.DeltaDiscoveryRequest):
            events.extend(self._receive_delta(type_url, ts, request, now))
        else:
            events.extend(self._receive_sotw(type_url, ts, request, now))
        events.extend(self._pump())
        return events

    # ---- request handling ---------------------------------------------------------------

    def _receive_sotw(
        self, type_url: str, ts: TypeState, req: discovery_pb2.DiscoveryRequest, now: float
    ) -> list[Event]:
        nonce = req.response_nonce
        if nonce and nonce != ts.latest_nonce:
            return [StaleNonce(type_url, nonce)]
        events = self._ack_or_nack(type_url, ts, nonce, req.error_detail.message, req.error_detail.code, now)
        raw_names = tuple(req.resource_names)
        fingerprint = (len(raw_names), hash(raw_names))
        if ts.requested and fingerprint == ts.last_names:
            return events  # an ACK with the same subscription: the common case
        ts.last_names = fingerprint
        names = set(raw_names)
        if not ts.requested:
            # Legacy wildcard: a first request without names subscribes to everything.
            wildcard = not names or WILDCARD in names
        else:
            wildcard = WILDCARD in names or (ts.wildcard and not names and not ts.names)
        if not ts.requested or wildcard != ts.wildcard or names - {WILDCARD} != ts.names:
            ts.unsettle()
        ts.wildcard = wildcard
        ts.requested = True
        ts.names = shared_names(names - {WILDCARD})
        self._forget_uninterested(type_url, ts)
        return events

    def _receive_delta(
        self, type_url: str, ts: TypeState, req: discovery_pb2.DeltaDiscoveryRequest, now: float
    ) -> list[Event]:
        events: list[Event] = []
        nonce = req.response_nonce
        if nonce and ts.in_flight is not None and nonce == ts.in_flight.nonce:
            events.extend(
                self._ack_or_nack(type_url, ts, nonce, req.error_detail.message, req.error_detail.code, now)
            )
        elif nonce:
            events.append(StaleNonce(type_url, nonce))
        subscribe = set(req.resource_names_subscribe)
        unsubscribe = set(req.resource_names_unsubscribe)
        if subscribe or unsubscribe or not ts.requested:
            ts.unsettle()
        if not ts.requested:
            ts.wildcard = not subscribe
            for name, version in req.initial_resource_versions.items():
                ts.hold(name, version)
        ts.requested = True
        if WILDCARD in subscribe:
            ts.wildcard = True
        if WILDCARD in unsubscribe:
            ts.wildcard = False
        if subscribe or unsubscribe:
            ts.names = shared_names((ts.names | (subscribe - {WILDCARD})) - unsubscribe)
        for name in unsubscribe:
            ts.drop(name)
            ts.answered.discard(name)
        return events

    def _ack_or_nack(
        self, type_url: str, ts: TypeState, nonce: str, error: str, code: int, now: float
    ) -> list[Event]:
        flight = ts.in_flight
        if flight is None or nonce != flight.nonce:
            return []
        ts.in_flight = None
        ts.settled = -1
        if error or code:
            ts.last_error = error or f"rejected with code {code}"
            ts.last_nacked = True
            if type_url in FULL_STATE_TYPES and not self.delta:
                ts.rejected_key = flight.version
            else:
                ts.rejected.update({n: r.version for n, r in flight.resources.items()})
            return [Nack(type_url, nonce, flight.version, ts.last_error)]
        ts.last_nacked = False
        if type_url in FULL_STATE_TYPES and not self.delta:
            # Replaced whole, never mutated: may be the snapshot's own dicts, shared by streams.
            ts.acked_res = flight.resources
            ts.acked = self.snapshot.versions(type_url, flight.resources)
            ts.state_xor = 0
            ts.rejected_key = ""
        else:
            for name, res in flight.resources.items():
                if not ts.wildcard and name not in ts.names:
                    continue  # unsubscribed while the response was in flight: the proxy dropped it
                if type_url == ENDPOINT and name in self._eds_fresh_after:
                    if self._eds_fresh_after[name] > int(flight.nonce):
                        continue  # applied before its cluster was (re)created: does not warm it
                    del self._eds_fresh_after[name]
                    if not self._eds_fresh_after:
                        self._eds_fresh_after = {}  # dicts never shrink; let the table go
                ts.hold(name, res.version, res)
                ts.rejected.pop(name, None)
            for name in flight.removed:
                ts.drop(name)
        ts.acked_version = flight.version
        ts.settled = flight.generation if flight.complete else -1
        return [
            Ack(
                type_url,
                nonce,
                flight.version,
                flight.generation,
                max(0.0, now - flight.created_at),
            )
        ]

    def _interested(self, type_url: str, ts: TypeState, name: str) -> bool:
        return name in ts.names or (ts.wildcard and name in self.snapshot.wildcard_names(type_url))

    def _forget_uninterested(self, type_url: str, ts: TypeState) -> None:
        # A SotW proxy drops what it no longer subscribes to; so do we.
        if type_url in FULL_STATE_TYPES:
            return
        for name in [n for n in ts.acked if not self._interested(type_url, ts, n)]:
            ts.drop(name)
            ts.answered.discard(name)

    # ---- what to send -------------------------------------------------------------------

    def _gating(self) -> bool:
        cds = self.types.get(CLUSTER)
        return self.ads and cds is not None and cds.wildcard

    def _ready_clusters(self) -> set[str]:
        cds = self.types.get(CLUSTER)
        eds = self.types.get(ENDPOINT)
        if cds is None or eds is None:
            return set()
        ready = {n for n in cds.acked if n in eds.acked}
        flight = cds.in_flight
        if flight is not None:
            # A cluster response on its way may remove clusters: they are not ready any more.
            if self.delta:
                ready -= flight.removed
            else:
                ready &= set(flight.resources)
        return ready

    def _referenced_clusters(self) -> set[str]:
        """Clusters named by routes the proxy has or is being sent."""
        out: set[str] = set()
        for t in (ROUTE, LISTENER):
            ts = self.types.get(t)
            if ts is None:
                continue
            for res in ts.acked_res.values():
                out |= res.refs
            if ts.in_flight is not None:
                for res in ts.in_flight.resources.values():
                    out |= res.refs
        return out

    def desired(self, type_url: str) -> dict[str, SnapshotResource]:
        """What this proxy should hold now for a type, with make-before-break applied."""
        return self._desired(type_url)[0]

    def _desired(self, type_url: str) -> tuple[dict[str, SnapshotResource], set[str]]:
        """(resources, names held back because a cluster they name is not ready yet)."""
        held_back: set[str] = set()
        ts = self.types.get(type_url)
        if ts is None:
            return {}, held_back
        every = self.snapshot.resources.get(type_url, {})
        wildcard_names = self.snapshot.wildcard_names(type_url)
        out: dict[str, SnapshotResource]
        if ts.wildcard and len(wildcard_names) == len(every) and all(n in every for n in ts.names):
            # The snapshot's own dict, shared by every stream: copied below before any change.
            out = every if isinstance(every, dict) else dict(every)
        else:
            wanted = set(ts.names)
            if ts.wildcard:
                wanted |= wildcard_names
            out = {}
            for name in wanted:
                res = self.snapshot.get(type_url, name)
                if res is not None:
                    out[name] = res
        if not self._gating():
            return out, held_back
        if type_url == CLUSTER:
            kept_names = [n for n in self._referenced_clusters() if n not in out]
            if kept_names:
                out = dict(out)
            for name in kept_names:
                held_back.add(name)  # to be removed later: not in sync yet
                kept = ts.acked_res.get(name)
                if kept is not None:
                    out[name] = kept
                elif name in ts.acked and ts.wildcard:
                    # Delta: the proxy has it from before (initial versions); do not remove it.
                    out[name] = _Placeholder.of(name, ts.acked[name])
        elif type_url in (ROUTE, LISTENER):
            ready = self._ready_clusters()
            if all(res.refs <= ready for res in out.values()):
                return out, held_back
            out = dict(out)
            for name, res in list(out.items()):
                if res.refs <= ready:
                    continue
                held = ts.acked_res.get(name)
                if held is not None and held.refs <= ready:
                    out[name] = held
                else:
                    del out[name]
                held_back.add(name)
        return out, held_back

    def _pump(self, fast_from: int | None = None) -> Iterable[Event]:
        """Send what each type needs. With `fast_from`, the snapshot is a known successor of
        generation `fast_from`, and a type settled at that generation only looks at the
        names that changed: one cluster's change costs O(1) per stream, not O(clusters)."""
        order: Sequence[str] = TYPE_URLS if self.ads else (self.fixed_type or "",)
        gen = self.snapshot.generation
        for type_url in order:
            ts = self.types.get(type_url)
            if ts is None or not ts.requested:
                continue
            if ts.in_flight is not None:
                continue
            if ts.settled == gen and not ts.last_nacked:
                continue
            if fast_from is not None and ts.settled == fast_from and not ts.last_nacked:
                changed = self.snapshot.changes.get(type_url, frozenset())
                if not changed:
                    ts.settled = gen
                    continue
                if type_url == ENDPOINT:
                    send = self._changed_endpoints(ts, changed)
                    if send is None:
                        ts.settled = gen
                    else:
                        yield send
                    continue
            if ts.last_nacked and self._matches_acked(type_url, ts):
                ts.last_nacked = False
                yield NackCleared(type_url)
            send = self._next_response(type_url, ts)
            if send is not None:
                yield send

    def _changed_endpoints(self, ts: TypeState, changed: frozenset[str]) -> Send | None:
        """EDS after a snapshot that changed only `changed`, for a stream that was in sync."""
        updates: dict[str, SnapshotResource] = {}
        removed: set[str] = set()
        for name in changed:
            if name in ts.names:
                res = self.snapshot.get(ENDPOINT, name)
                assert res is not None  # EDS always has at least an empty assignment
                if ts.acked.get(name) != res.version and ts.rejected.get(name) != res.version:
                    updates[name] = res
            elif ts.wildcard:
                res = self.snapshot.resources.get(ENDPOINT, {}).get(name)
                if res is not None and ts.acked.get(name) != res.version:
                    updates[name] = res
                elif res is None and name in ts.acked and self.delta:
                    removed.add(name)
        if not updates and not removed:
            return None
        return self._emit(ENDPOINT, ts, updates, frozenset(removed), ts.state_after(updates, removed))

    def _matches_acked(self, type_url: str, ts: TypeState) -> bool:
        desired = self.desired(type_url)
        if type_url in FULL_STATE_TYPES and not self.delta and set(desired) != set(ts.acked):
            return False
        return all(ts.acked.get(n) == r.version for n, r in desired.items())

    def _next_response(self, type_url: str, ts: TypeState) -> Send | None:
        desired, held_back = self._desired(type_url)
        # In sync with this snapshot unless something is sent or held back below.
        ts.settled = self.snapshot.generation if not held_back else -1
        complete = not held_back
        full = type_url in FULL_STATE_TYPES and not self.delta
        if full:
            key = _key((n, r.version) for n, r in desired.items())
            subscription = (ts.wildcard, frozenset(ts.names))
            if ts.responded and key == ts.acked_version and subscription == ts.last_subscription:
                return None
            if key == ts.rejected_key:
                return None
            ts.last_subscription = subscription
            return self._emit(type_url, ts, desired, frozenset(), key, complete)
        updates = {
            n: r
            for n, r in desired.items()
            if ts.acked.get(n) != r.version
            and ts.rejected.get(n) != r.version
            and not isinstance(r, _Placeholder)
        }
        removed: frozenset[str] = frozenset()
        if self.delta:
            gone = {n for n in ts.acked if n not in desired}
            # Names asked for that do not exist are answered once, as removed.
            gone |= {n for n in ts.names if n not in desired and n not in ts.answered}
            removed = frozenset(gone - held_back)
        if not updates and not removed and (ts.responded or not self.delta):
            # SotW routes and endpoints: an empty response says nothing; wait for content.
            return None
        return self._emit(type_url, ts, updates, removed, ts.state_after(updates, removed), complete)

    def _emit(
        self,
        type_url: str,
        ts: TypeState,
        resources: dict[str, SnapshotResource],
        removed: frozenset[str],
        version: str,
        complete: bool = True,
    ) -> Send:
        """Put a response in flight. `version` is also its content key (NACK memory);
        `complete` says it carries everything desired (nothing held back)."""
        self._nonce += 1
        nonce = str(self._nonce)
        ts.settled = -1
        if type_url == CLUSTER:
            eds = self.types.get(ENDPOINT)
            for name in resources:
                if name not in ts.acked:
                    self._eds_fresh_after[name] = self._nonce
                    if eds is not None:
                        eds.drop(name)
                        eds.settled = -1
        names = tuple(sorted(resources))
        if self.delta:
            payload = wire.delta_response(
                version, type_url, nonce, (resources[n].delta_field for n in names), sorted(removed)
            )
        else:
            payload = wire.sotw_response(version, type_url, nonce, (resources[n].sotw_field for n in names))
        ts.latest_nonce = nonce
        ts.responded = True
        ts.answered |= removed
        ts.in_flight = _InFlight(
            nonce=nonce,
            version=version,
            resources=resources,
            removed=removed,
            generation=self.snapshot.generation,
            created_at=self.snapshot.created_at,
            complete=complete,
        )
        return Send(
            type_url,
            nonce,
            version,
            payload,
            names,
            tuple(sorted(removed)),
            self.snapshot.generation,
        )

    # ---- status -------------------------------------------------------------------------

    @property
    def wants_every_cluster(self) -> bool:
        """A wildcard CDS subscriber (an Envoy), not a proxyless client asking by name."""
        cds = self.types.get(CLUSTER)
        return cds is not None and cds.wildcard

    def holds_cluster(self, name: str) -> bool:
        """The proxy has ACKed the cluster and its endpoints: routes may name it."""
        cds, eds = self.types.get(CLUSTER), self.types.get(ENDPOINT)
        return cds is not None and eds is not None and name in cds.acked and name in eds.acked

    def status(self, type_url: str) -> str:
        """SYNCED, STALE, NACKED or NOT_SENT for one type, as an operator reads it."""
        ts = self.types.get(type_url)
        if ts is None or not ts.requested or not ts.responded:
            return "NOT_SENT"
        if ts.in_flight is not None:
            return "STALE"
        if ts.last_nacked:
            return "NACKED"
        return "SYNCED" if self._matches_acked(type_url, ts) else "STALE"


@dataclass(frozen=True)
class _Placeholder(SnapshotResource):
    """A resource the proxy holds from an earlier connection; kept, never re-sent."""

    @classmethod
    def of(cls, name: str, version: str) -> _Placeholder:
        return cls(name=name, type_url=CLUSTER, version=version, sotw_field=b"", delta_field=b"")
