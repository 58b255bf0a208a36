"""The per-stream xDS protocol as a pure object (sans-IO), for SotW and delta, ADS or one type.

Feed it requests (`receive`) and snapshots (`set_snapshot`); it returns events: bytes to
send, ACKs, NACKs, stale nonces. It never does I/O, so every protocol corner is unit-tested.

Rules it keeps (docs/xds.md states them for operators):
- one response in flight per type: the next goes out only after the ACK or NACK, so a slow
  proxy gets the latest state, coalesced, never a backlog;
- a rejected resource is never re-sent: the same content waits until it changes. A NACK
  is attributed to the resources Envoy names in its error; the valid changes shipped
  beside them are sent again (Envoy applied them, or will on the re-send, harmlessly);
- stale nonces are ignored (SotW: the whole request; delta: only its ACK part);
- on ADS with a wildcard cluster subscription (Envoy), make-before-break: a route entry is
  sent only once every cluster it names has been ACKed with endpoints sent after the
  cluster was (re)created; a cluster is removed only after no route the proxy has (or is
  being sent) names it, and while kept it keeps the last assignment the proxy ACKed;
- a cluster that is new *or updated* gets a fresh assignment right after it, because
  Envoy (re)warms it and waits for one, holding its CDS ACK meanwhile;
- a proxy that reconnects with config from before keeps every cluster it may route to
  until a route sent on this stream is ACKed (delta: the clusters it declares; SotW: the
  snapshot's lingering clusters, as a proxy last ACKed them), unless its declared route is
  one we know;
- content some proxy already ACKed is never a suspect of a NACK, and a cluster the proxy
  may route to is never dropped from a state-of-the-world response for want of content:
  the last definition a proxy ACKed stands in.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import discovery_pb2

from controlplane import limits
from controlplane.routing.blend import blend_routes
from controlplane.routing.translate import CLUSTER, ENDPOINT, LISTENER, ROUTE, TYPE_URLS
from controlplane.xds import capabilities, wire
from controlplane.xds.capabilities import Capabilities
from controlplane.xds.memory import ClusterMemory
from controlplane.xds.snapshot import Placeholder, Snapshot, SnapshotResource, encode_resource, pair_hash

FULL_STATE_TYPES = frozenset({LISTENER, CLUSTER})
WILDCARD = "*"
# Bounds on what one client can make a stream hold (docs/limits.md).
MAX_NAMES_PER_TYPE = limits.XDS_MAX_NAMES_PER_TYPE
MAX_UNKNOWN_TYPES_REPORTED = 8


def bounded(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters with a note of how much was left out: what a proxy
    sends is shown and logged, and must not grow every status page and log line."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


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
    """The proxy rejected a response (or part of it); it keeps its previous config of what
    it rejected. `rejected` names the resources blamed (all the changed ones if Envoy's
    message names none of them)."""

    type_url: str
    nonce: str
    version: str
    message: str
    rejected: tuple[str, ...] = ()


@dataclass(frozen=True)
class NackCleared:
    """Nothing the proxy rejected is wanted any more (the config moved on, or went back)."""

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
    node: base_pb2.Node | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Refused:
    """The client asked for more than a stream may hold; the caller ends the stream."""

    code: str  # a grpc.StatusCode name
    message: str


Event = Send | Ack | Nack | NackCleared | StaleNonce | UnknownType | NodeIdentified | Refused


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
    acked_here: bool = False  # an ACK of this type arrived on this stream
    # What the proxy has, as far as we know: name -> version, and the resource when we know it.
    acked: dict[str, str] = field(default_factory=dict)
    acked_res: dict[str, SnapshotResource] = field(default_factory=dict)
    acked_version: str = ""  # also the content key of what the proxy holds
    # SotW, types a response may carry part of (RDS, EDS): name -> the version_info of the
    # ACKed response that last carried it, which is what the client's own CSDS reports. (A
    # full-state type's every response carries all: acked_version. Delta: the resource's.)
    carried: dict[str, str] = field(default_factory=dict)
    last_subscription: tuple[bool, frozenset[str]] = (False, frozenset())
    # NACK memory: name -> the version the proxy rejected (never sent to it again).
    rejected: dict[str, str] = field(default_factory=dict)
    # A NACK that names no resource blames every change it carried: they become suspects,
    # re-sent `probe` at a time (a bisection) until the rejected ones are found.
    suspects: dict[str, str] = field(default_factory=dict)
    probing: frozenset[str] = frozenset()  # the suspects the next response may carry
    rejected_key: str = ""  # SotW full state: the content key of the last NACKed response
    last_error: str = ""
    last_nacked: bool = False  # something the proxy rejected (or a suspect) is still wanted
    answered: set[str] = field(default_factory=set)
    # Held from an earlier stream, content unknown: not confirmed until ACKed here.
    unconfirmed: set[str] = field(default_factory=set)
    # XOR of per-(name, version) hashes of `acked`: the proxy's state version in O(1).
    state_xor: int = 0
    last_names: tuple[int, int] = (0, 0)  # length and hash of the last SotW names list
    # Whether to keep the resource objects the proxy holds (routes and clusters need them
    # for make-before-break; endpoint assignments do not, and are the bulk).
    keep_resources: bool = True
    # The snapshot generation this type was last found fully in sync with (-1: not known).
    settled: int = -1
    # When the oldest response not yet answered (ACK or NACK) was sent; None: none awaits.
    unacked_since: float | None = None

    def withholds(self, name: str, version: str) -> bool:
        """Whether `name` at `version` must not go to the proxy now: it rejected it, or it
        is a suspect outside the current probe."""
        if self.rejected.get(name) == version:
            return True
        return self.suspects.get(name) == version and name not in self.probing

    def probe(self, n: int) -> None:
        """Let the next response carry the first `n` suspects (at least one, if any)."""
        self.probing = frozenset(list(self.suspects)[: max(1, n)] if self.suspects else ())

    def unsettle(self) -> None:
        """The subscription changed: recompute on the next pump, even after an ACK."""
        self.settled = -1
        if self.in_flight is not None:
            self.in_flight.complete = False

    def hold(self, name: str, version: str, res: SnapshotResource | None = None) -> None:
        """Record that the proxy holds `name` at `version`."""
        old = self.acked.get(name)
        if old is not None:
            self.state_xor ^= pair_hash(name, old)
        self.acked[name] = version
        self.state_xor ^= pair_hash(name, version)
        if res is not None and self.keep_resources:
            self.acked_res[name] = res
        else:
            self.acked_res.pop(name, None)

    def drop(self, name: str) -> None:
        """Record that the proxy no longer holds `name`."""
        old = self.acked.pop(name, None)
        if old is not None:
            self.state_xor ^= pair_hash(name, old)
        self.acked_res.pop(name, None)
        self.carried.pop(name, None)

    def version_info(self, name: str, delta: bool) -> str:
        """The version the proxy's own CSDS gives `name`: the resource's version on delta,
        else the version_info of the response it came in (what a reconnected proxy held
        before, unknown here, reads as the last response it ACKed here)."""
        if delta:
            return self.acked.get(name, "")
        return self.carried.get(name) or self.acked_version

    def state_after(self, updates: dict[str, SnapshotResource], removed: Iterable[str]) -> str:
        """The state version once `updates` and `removed` are applied, without a full scan."""
        x = self.state_xor
        for name in removed:
            if name in self.acked:
                x ^= pair_hash(name, self.acked[name])
        for name, res in updates.items():
            if name in self.acked:
                x ^= pair_hash(name, self.acked[name])
            x ^= pair_hash(name, res.version)
        return f"{x:016x}"


_SHARED_NAMES: OrderedDict[frozenset[str], frozenset[str]] = OrderedDict()
_SHARED_TOTAL = [0]  # names held in _SHARED_NAMES, all sets together


def shared_names(names: Iterable[str]) -> frozenset[str]:
    """One frozenset per distinct subscription, of interned strings, shared by every stream:
    a thousand proxies subscribed to the same thousand clusters hold one set, not a thousand.
    The cache holds at most 256 sets and XDS_SHARED_NAMES_MAX names in all (oldest out
    first), so a client subscribing to many names it invents leaves nothing behind it."""
    key = frozenset(sys.intern(n) for n in names)
    found = _SHARED_NAMES.get(key)
    if found is not None:
        _SHARED_NAMES.move_to_end(key)
        return found
    if len(key) > limits.XDS_SHARED_NAMES_MAX // 4:
        return key  # too large to keep for sharing: only its own stream holds it
    _SHARED_NAMES[key] = key
    _SHARED_TOTAL[0] += len(key)
    while len(_SHARED_NAMES) > 256 or _SHARED_TOTAL[0] > limits.XDS_SHARED_NAMES_MAX:
        _, old = _SHARED_NAMES.popitem(last=False)
        _SHARED_TOTAL[0] -= len(old)
    return key


def _key(resources: Iterable[tuple[str, str]]) -> str:
    h = hashlib.blake2b(digest_size=6)
    for name, version in sorted(resources):
        h.update(name.encode())
        h.update(b"\0")
        h.update(version.encode())
        h.update(b"\n")
    return h.hexdigest()


def attribute_nack(message: str, names: Iterable[str]) -> set[str]:
    """The resources an Envoy error message blames, among `names`.

    Envoy names each rejected resource followed by a colon ("Error adding/updating
    cluster(s) a@v1: Proto constraint validation failed ..., b@v2: ..."); a name counts only
    at a word boundary, so `a@v1` is not blamed for `xa@v1` or `a@v10`."""
    found = set()
    for name in names:
        if name and re.search(r"(?:^|[\s,'\"(\[])" + re.escape(name) + r"(?=[:'\"\s,)\]]|$)", message):
            found.add(name)
    return found


_ADAPTED: OrderedDict[tuple[str, str, frozenset[str]], SnapshotResource] = OrderedDict()


def _adapted(res: SnapshotResource, missing: frozenset[str]) -> SnapshotResource:
    """`res` without the features a proxy lacks, serialised once per (resource, lack)."""
    lacking = res.needs & missing
    if not lacking or res.message is None:
        return res
    key = (res.type_url, res.version, frozenset(lacking))
    found = _ADAPTED.get(key)
    if found is None:
        found = encode_resource(
            res.type_url, res.name, capabilities.adapt(res.type_url, res.message, lacking)
        )
        _ADAPTED[key] = found
        if len(_ADAPTED) > 4096:
            _ADAPTED.popitem(last=False)
    return found


# Per (snapshot dict, what a proxy lacks): that dict adapted, shared by every stream of that
# kind (the dict is kept alive by the entry, so its id cannot be reused while cached).
_ADAPTED_ALL: OrderedDict[
    tuple[int, frozenset[str]], tuple[Mapping[str, SnapshotResource], dict[str, SnapshotResource]]
] = OrderedDict()


def _adapted_all(
    every: Mapping[str, SnapshotResource], missing: frozenset[str]
) -> dict[str, SnapshotResource]:
    """Every resource of a type as a proxy lacking `missing` can take them, built once per
    snapshot and lack rather than once per stream and response."""
    key = (id(every), missing)
    found = _ADAPTED_ALL.get(key)
    if found is not None and found[0] is every:
        _ADAPTED_ALL.move_to_end(key)
        return found[1]
    adapted = {n: _adapted(r, missing) for n, r in every.items()}
    _ADAPTED_ALL[key] = (every, adapted)
    if len(_ADAPTED_ALL) > 16:
        _ADAPTED_ALL.popitem(last=False)
    return adapted


_BLENDS: OrderedDict[tuple[str, str, frozenset[str]], SnapshotResource] = OrderedDict()


def _blended(desired: SnapshotResource, held: SnapshotResource | None, ready: set[str]) -> SnapshotResource:
    """`desired` with its not-ready entries held back (routing/blend.py), serialised once
    per (desired, held, missing clusters) and shared by every stream in that state."""
    missing = frozenset(desired.refs - ready)
    key = (desired.version, held.version if held is not None else "", missing)
    found = _BLENDS.get(key)
    if found is not None:
        _BLENDS.move_to_end(key)
        return found
    assert isinstance(desired.message, route_pb2.RouteConfiguration)
    held_msg = held.message if held is not None else None
    assert held_msg is None or isinstance(held_msg, route_pb2.RouteConfiguration)
    msg = blend_routes(desired.message, held_msg, ready)
    res = encode_resource(ROUTE, desired.name, msg)
    if held is not None and res.version == held.version:
        res = held
    _BLENDS[key] = res
    if len(_BLENDS) > 256:
        _BLENDS.popitem(last=False)
    return res


class XdsStream:
    """Protocol state of one xDS stream (ADS carries every type; other services one)."""

    def __init__(
        self,
        snapshot: Snapshot,
        *,
        delta: bool,
        ads: bool = True,
        type_url: str | None = None,
        memory: ClusterMemory | None = None,
    ) -> None:
        if not ads and type_url is None:
            raise ValueError("a non-ADS stream serves exactly one type_url")
        self.snapshot = snapshot
        self.delta = delta
        self.ads = ads
        self.fixed_type = type_url
        self.types: dict[str, TypeState] = {}
        self.node_id = ""
        self.node: base_pb2.Node | None = None
        self.capabilities: Capabilities = capabilities.EVERYTHING
        self.memory = memory if memory is not None else ClusterMemory()
        self._nonce = 0
        self._unknown_reported: set[str] = set()
        self._now = 0.0  # the time of the call being handled (set_snapshot, receive)
        # A cluster new to the proxy, or updated, warms on EDS sent after it: name -> CDS nonce.
        self._eds_fresh_after: dict[str, int] = {}
        # Clusters the proxy brought from an earlier stream, kept until a route sent here is
        # ACKed (delta: the names it declared; None: unknown, a SotW reconnect).
        self._inherited_clusters: frozenset[str] | None = frozenset()

    # ---- inputs -------------------------------------------------------------------------

    def set_snapshot(self, snapshot: Snapshot, now: float) -> list[Event]:
        """A new desired state: send what changed, in make-before-break order."""
        previous = self.snapshot.generation
        self.snapshot = snapshot
        self._now = now
        return list(self._pump(fast_from=previous if snapshot.parent == previous else None))

    def receive(
        self,
        request: discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest,
        now: float,
    ) -> list[Event]:
        """One request from the proxy: subscription change, ACK or NACK."""
        events: list[Event] = []
        self._now = now
        if request.HasField("node") and len(request.node.id) > limits.XDS_MAX_NODE_ID_CHARS:
            return [
                Refused(
                    "INVALID_ARGUMENT",
                    f"node id of {len(request.node.id)} characters; at most {limits.XDS_MAX_NODE_ID_CHARS}",
                )
            ]
        if request.HasField("node") and request.node.id and not self.node_id:
            self.node_id = request.node.id
            self.node = request.node
            self.capabilities = capabilities.of_node(request.node)
            events.append(
                NodeIdentified(
                    request.node.id, request.node.cluster, request.node.user_agent_name, request.node
                )
            )
        type_url = request.type_url or (self.fixed_type or "")
        if type_url not in TYPE_URLS or (self.fixed_type and type_url != self.fixed_type):
            if (
                type_url not in self._unknown_reported
                and len(self._unknown_reported) < MAX_UNKNOWN_TYPES_REPORTED
            ):
                self._unknown_reported.add(type_url)
                events.append(UnknownType(bounded(type_url, 200)))
            return events
        ts = self.types.get(type_url)
        if ts is None:
            ts = self.types[type_url] = TypeState(keep_resources=type_url != ENDPOINT)
        names_before = ts.names
        if isinstance(request, discovery_pb2.DeltaDiscoveryRequest):
            events.extend(self._receive_delta(type_url, ts, request, now))
        else:
            events.extend(self._receive_sotw(type_url, ts, request, now))
        if ts.names is not names_before and (refused := self._check_subscription(type_url, ts)):
            events.append(refused)
            return events
        events.extend(self._pump())
        return events

    def _check_subscription(self, type_url: str, ts: TypeState) -> Refused | None:
        """A changed subscription within the bounds of docs/limits.md, or why not. Names the
        snapshot does not have cost every response their own work: a client inventing them
        by the thousand would take the CPU every real proxy needs."""
        if len(ts.names) > MAX_NAMES_PER_TYPE:
            return Refused(
                "RESOURCE_EXHAUSTED",
                f"subscribed to {len(ts.names)} names of {type_url}; a stream may hold at most "
                f"{MAX_NAMES_PER_TYPE}",
            )
        longest = max(map(len, ts.names), default=0)
        if longest > limits.XDS_MAX_NAME_CHARS:
            return Refused(
                "INVALID_ARGUMENT",
                f"a resource name of {longest} characters in {type_url}; at most {limits.XDS_MAX_NAME_CHARS}",
            )
        known = self.snapshot.resources.get(type_url, {})
        lingering = self.snapshot.lingering if type_url in (CLUSTER, ENDPOINT) else {}
        unknown = sum(1 for n in ts.names if n not in known and n not in lingering)
        # As many as the fleet has, or the floor: never more than twice a real proxy's work.
        allowed = max(limits.XDS_MAX_UNKNOWN_NAMES, len(known))
        if unknown > allowed:
            return Refused(
                "RESOURCE_EXHAUSTED",
                f"subscribed to {unknown} names of {type_url} that do not exist; a stream may hold "
                f"at most {allowed} (XDS_MAX_UNKNOWN_NAMES, or as many as exist)",
            )
        return None

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
        first = not ts.requested
        if first:
            # Legacy wildcard: a first request without names subscribes to everything.
            wildcard = not names or WILDCARD in names
        else:
            wildcard = WILDCARD in names or (ts.wildcard and not names and not ts.names)
        if first or wildcard != ts.wildcard or names - {WILDCARD} != ts.names:
            ts.unsettle()
        ts.wildcard = wildcard
        ts.requested = True
        ts.names = shared_names(names - {WILDCARD})
        if first and req.version_info:
            self._inherit_sotw(type_url, ts, req.version_info)
        self._forget_uninterested(type_url, ts)
        return events

    def _inherit_sotw(self, type_url: str, ts: TypeState, version_info: str) -> None:
        """A reconnecting SotW proxy says which version of the type it holds, not what."""
        if type_url == CLUSTER:
            self._inherited_clusters = None  # unknown: keep the lingering clusters
        elif type_url == ROUTE and ts.names:
            current = {n: self.snapshot.get(ROUTE, n) for n in ts.names}
            x = 0
            for n, res in current.items():
                if res is not None:
                    x ^= pair_hash(n, res.version)
            known = None
            if len(ts.names) == 1:
                [only] = ts.names
                known = self.memory.route_by_state(only, version_info)
            if f"{x:016x}" == version_info:
                for n, res in current.items():  # it holds exactly what we would send: known
                    if res is not None:
                        ts.hold(n, res.version, res)
            elif known is not None:
                ts.hold(known.name, known.version, known)  # one a proxy ACKed here before
            else:
                ts.unconfirmed = set(ts.names)

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
            for name, version in list(req.initial_resource_versions.items())[:MAX_NAMES_PER_TYPE]:
                self._inherit_delta(type_url, ts, name, version)
            if type_url == CLUSTER and req.initial_resource_versions:
                self._inherited_clusters = frozenset(ts.acked)
            cds = self.types.get(CLUSTER)
            if type_url == ENDPOINT and self.ads and (cds is None or not cds.requested):
                # Endpoints asked for before clusters: Envoy's CDS is paused because a cluster
                # is (re)warming, and it waits for an assignment sent after it. Which one is
                # not known: every assignment goes out again.
                for name in ts.acked:
                    self._eds_fresh_after.setdefault(name, 0)
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
            ts.unconfirmed.discard(name)
            if type_url == ENDPOINT:
                self._eds_fresh_after.pop(name, None)
        return events

    def _inherit_delta(self, type_url: str, ts: TypeState, name: str, version: str) -> None:
        """A resource the proxy declares it holds from an earlier stream."""
        res = self.snapshot.get(type_url, name) if type_url != ENDPOINT else None
        if (res is None or res.version != version) and type_url == ROUTE:
            res = self.memory.route(name, version)  # one a proxy ACKed here before
        if res is not None and res.version == version:
            ts.hold(name, version, res)  # the content we have: known
            return
        ts.hold(name, version)
        if type_url == ROUTE:
            ts.unconfirmed.add(name)

    def _ack_or_nack(
        self, type_url: str, ts: TypeState, nonce: str, error: str, code: int, now: float
    ) -> list[Event]:
        flight = ts.in_flight
        if flight is None or nonce != flight.nonce:
            return []
        ts.in_flight = None
        ts.unacked_since = None
        ts.settled = -1
        if error or code:
            return [self._nack(type_url, ts, flight, error or f"rejected with code {code}")]
        ts.acked_here = True
        for name, res in flight.resources.items():
            if ts.suspects.get(name) == res.version:
                del ts.suspects[name]  # carried and accepted: not the culprit
        ts.probe(len(ts.suspects) // 2)
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
                if not self.delta:
                    ts.carried[name] = flight.version
                ts.rejected.pop(name, None)
                ts.unconfirmed.discard(name)
            for name in flight.removed:
                ts.drop(name)
                ts.unconfirmed.discard(name)
        if type_url == CLUSTER:
            self.memory.record(flight.resources)
        elif type_url == ROUTE and self._gating():
            self.memory.record_routes(flight.resources.values())
        ts.acked_version = flight.version
        ts.last_nacked = bool(ts.rejected or ts.suspects)
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

    def _nack(self, type_url: str, ts: TypeState, flight: _InFlight, message: str) -> Nack:
        """Blame the resources Envoy names; if it names none (a response refused whole, as
        Envoy does when a resource fails to decode), bisect the changes it carried. Apply
        what Envoy applies anyway (removals); valid changes are sent again."""
        ts.last_error = bounded(message, limits.XDS_MAX_NACK_MESSAGE_CHARS)
        ts.last_nacked = True
        known = self.memory.get if type_url == CLUSTER else (lambda n: None)
        changed = {
            n: r
            for n, r in flight.resources.items()
            if ts.acked.get(n) != r.version
            and not isinstance(r, Placeholder)
            and getattr(known(n), "version", None) != r.version  # a proxy took it: not the culprit
        }
        blamed = attribute_nack(message, changed)
        if not blamed and len(changed) == 1:
            blamed = set(changed)
        for name in blamed:
            ts.rejected[name] = changed[name].version
            ts.suspects.pop(name, None)
        if not blamed and changed:
            # Suspects: these first (one of them is bad), then any earlier ones; the next
            # response carries the first half of them.
            carried = {n: changed[n].version for n in sorted(changed)}
            ts.suspects = {**carried, **{n: v for n, v in ts.suspects.items() if n not in carried}}
            ts.probe(len(carried) // 2)
        if type_url in FULL_STATE_TYPES and not self.delta:
            # Envoy removes what a state-of-the-world response left out when it rejects part of
            # it (not when it rejects it whole): what it holds is not known for sure, so the
            # next different content goes out in full. The dicts may be shared: new ones.
            ts.acked_res = {n: r for n, r in ts.acked_res.items() if n in flight.resources}
            ts.acked = {n: v for n, v in ts.acked.items() if n in flight.resources}
            ts.acked_version = ""
            ts.rejected_key = flight.version
        # Delta: removals are sent again (Envoy skips them when it refuses a response whole,
        # and removing what is gone is harmless).
        shown = bounded(message, limits.XDS_MAX_NACK_MESSAGE_CHARS)  # the whole one was read for blame
        return Nack(type_url, flight.nonce, flight.version, shown, tuple(sorted(blamed)))

    def _interested(self, type_url: str, ts: TypeState, name: str) -> bool:
        return name in ts.names or (ts.wildcard and name in self.snapshot.wildcard_names(type_url))

    def _forget_uninterested(self, type_url: str, ts: TypeState) -> None:
        # A SotW proxy drops what it no longer subscribes to; so do we.
        if type_url in FULL_STATE_TYPES:
            return
        for name in [n for n in ts.acked if not self._interested(type_url, ts, n)]:
            ts.drop(name)
            ts.answered.discard(name)
            ts.unconfirmed.discard(name)
            if type_url == ENDPOINT:
                self._eds_fresh_after.pop(name, None)

    # ---- what to send -------------------------------------------------------------------

    def _gating(self) -> bool:
        """Make-before-break applies to Envoy: an ADS client with a wildcard CDS subscription.
        A reconnecting Envoy may ask for routes before clusters (its CDS is paused while a
        cluster warms), so before any CDS request its user agent decides. Proxyless gRPC
        asks CDS by name only after RDS: gating it would deadlock."""
        if not self.ads:
            return False
        cds = self.types.get(CLUSTER)
        if cds is not None and cds.requested:
            return cds.wildcard
        return self.node is not None and self.node.user_agent_name == "envoy"

    def _ready_clusters(self) -> set[str]:
        """Clusters a route entry may newly name: ACKed, with endpoints sent after them."""
        cds = self.types.get(CLUSTER)
        eds = self.types.get(ENDPOINT) or TypeState()
        if cds is None:
            return set()
        ready = {
            n
            for n in cds.acked
            if n in eds.acked or ((r := cds.acked_res.get(n)) is not None and r.self_contained)
        }
        flight = cds.in_flight
        if flight is not None:
            # A cluster response on its way may remove clusters: they are not ready any more.
            if self.delta:
                ready -= flight.removed
            else:
                ready &= set(flight.resources)
        return ready

    def _routes_confirmed(self) -> bool:
        """Whether every route the proxy holds is one whose content we know."""
        rds = self.types.get(ROUTE)
        if rds is not None and rds.requested:
            return not rds.unconfirmed
        # No RDS request yet: known only once its listeners, ACKed here, are seen to use no
        # RDS. A listener that does is followed by a request for its routes, which may come
        # after the listener's ACK; until then the routes the proxy holds are unknown.
        lds = self.types.get(LISTENER)
        if lds is None or not lds.acked_here:
            return False
        return not any(res.routes or isinstance(res, Placeholder) for res in lds.acked_res.values())

    def _referenced_clusters(self) -> set[str]:
        """Clusters named by routes the proxy has or is being sent (or may have, from before)."""
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
        inherited = self._inherited_clusters
        if inherited is None or inherited:
            if not self._routes_confirmed():
                out |= set(self.snapshot.lingering) if inherited is None else inherited
            else:
                self._inherited_clusters = frozenset()
        return out

    def desired(self, type_url: str) -> dict[str, SnapshotResource]:
        """What this proxy should hold now for a type, with make-before-break applied."""
        return self._desired(type_url)[0]

    def _subscribed(self, type_url: str, ts: TypeState) -> dict[str, SnapshotResource]:
        """The snapshot's resources for the subscription, before any per-proxy rule."""
        every = self.snapshot.resources.get(type_url, {})
        wildcard_names = self.snapshot.wildcard_names(type_url)
        missing = self.capabilities.missing if type_url in (CLUSTER, LISTENER) else frozenset()
        if missing:
            every = _adapted_all(every, missing)  # as this proxy can take them (shared)
        if ts.wildcard and len(wildcard_names) == len(every) and all(n in every for n in ts.names):
            # A dict shared by every stream: callers copy it before any change.
            return every if isinstance(every, dict) else dict(every)
        wanted = set(ts.names)
        if ts.wildcard:
            wanted |= wildcard_names
        out: dict[str, SnapshotResource] = {}
        for name in wanted:
            res = every.get(name)
            if (
                res is None
                and type_url == ENDPOINT
                and name in ts.acked
                and name not in self.snapshot.lingering
            ):
                # The proxy still holds this cluster (kept for make-before-break): it keeps the
                # last assignment it ACKed; an empty one would blackhole its routes.
                res = Placeholder.of(ENDPOINT, name, ts.acked[name])
            elif res is None:
                res = self.snapshot.get(type_url, name)  # a lingering cluster's last, else empty
            if res is not None:
                out[name] = res
        return out

    def _desired(self, type_url: str) -> tuple[dict[str, SnapshotResource], set[str]]:
        """(resources, names not as the snapshot has them: held back, kept or refused)."""
        held_back: set[str] = set()
        ts = self.types.get(type_url)
        if ts is None:
            return {}, held_back
        out = self._subscribed(type_url, ts)
        withheld = (
            [n for n, r in out.items() if ts.withholds(n, r.version)]
            if type_url in FULL_STATE_TYPES and not self.delta and (ts.rejected or ts.suspects)
            else []
        )
        if withheld:
            out = dict(out)  # it may be shared by every stream
        for name in withheld:
            # Never re-send what the proxy refused: it keeps its version, or goes without.
            held_back.add(name)
            kept = ts.acked_res.get(name) or self._last_good(type_url, name, out[name].version)
            if kept is not None:
                out[name] = kept
            else:
                del out[name]
        if not self._gating():
            return out, held_back
        if type_url == CLUSTER:
            kept_names = [n for n in self._referenced_clusters() if n not in out]
            if kept_names:
                out = dict(out)
            for name in kept_names:
                kept = ts.acked_res.get(name)
                if kept is None and name in ts.acked and self.delta:
                    # Delta: the proxy declared it from before; keep it as it is (sending other
                    # content would re-warm it).
                    kept = Placeholder.of(CLUSTER, name, ts.acked[name])
                if kept is None:
                    # SotW: what it holds is not known; what a proxy here last took.
                    kept = self._last_good(CLUSTER, name, "")
                if kept is None:
                    continue  # never ACKed by anyone here: it cannot be holding it from us
                out[name] = kept
                held_back.add(name)  # to be removed later: not in sync yet
        elif type_url == ROUTE:
            ready = self._ready_clusters()
            if all(res.refs <= ready for res in out.values()):
                return out, held_back
            out = dict(out)
            cds = self.types.get(CLUSTER)
            refused = set(cds.rejected) if cds is not None else set()
            for name, res in list(out.items()):
                if res.refs <= ready:
                    continue
                held_back.add(name)
                held = ts.acked_res.get(name)
                if held is None and (name in ts.acked or not (res.refs - ready) <= refused):
                    # The proxy's route is one we do not know, or it has none and the clusters
                    # are on their way: send nothing partial; wait for them.
                    del out[name]
                else:
                    # Entry by entry: ready ones go out; the others stay as the proxy has them
                    # (or, for clusters the proxy refused, stay out).
                    out[name] = _blended(res, held, ready)
        return out, held_back

    def _last_good(self, type_url: str, name: str, refused: str) -> SnapshotResource | None:
        """For a cluster this proxy may hold but we cannot name the content of: the last
        definition a proxy ACKed (or, after a restart, one sent before it), unless that is
        the refused one."""
        if type_url != CLUSTER:
            return None
        good = self.memory.content(name)
        ts = self.types.get(CLUSTER)
        if good is None or good.version == refused or (ts is not None and ts.withholds(name, good.version)):
            return None
        return good

    def _pump(self, fast_from: int | None = None) -> Iterable[Event]:
        """Send what each type needs. With `fast_from`, the snapshot is a known successor of
        generation `fast_from`, and a type settled at that generation only looks at the
        names that changed: one cluster's change costs O(1) per stream, not O(clusters)."""
        if self.capabilities.unsupported:
            return  # too old to configure: it keeps what it has
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
            if ts.last_nacked and self._rejections_settled(type_url, ts):
                ts.last_nacked = False
                yield NackCleared(type_url)
            send = self._next_response(type_url, ts)
            if send is not None:
                yield send

    def _rejections_settled(self, type_url: str, ts: TypeState) -> bool:
        """Forget rejections (and suspects) of content no longer wanted; True once none is left."""
        every = self.snapshot.resources.get(type_url, {})
        missing = self.capabilities.missing if type_url in (CLUSTER, LISTENER) else frozenset()
        for memory in (ts.rejected, ts.suspects):
            for name in list(memory):
                res = every.get(name)
                if res is not None and missing:
                    res = _adapted(res, missing)
                if res is None or res.version != memory[name] or not self._interested(type_url, ts, name):
                    del memory[name]
        ts.probe(len(ts.probing & ts.suspects.keys()))
        return not ts.rejected and not ts.suspects

    def _changed_endpoints(self, ts: TypeState, changed: frozenset[str]) -> Send | None:
        """EDS after a snapshot that changed only `changed`, for a stream that was in sync."""
        updates: dict[str, SnapshotResource] = {}
        removed: set[str] = set()
        every = self.snapshot.resources.get(ENDPOINT, {})
        for name in changed:
            if name in ts.names:
                res = every.get(name)
                if res is None:
                    if name in ts.acked:
                        continue  # kept: the proxy keeps the last assignment it ACKed
                    res = self.snapshot.get(ENDPOINT, name)
                    assert res is not None  # EDS always has at least an empty assignment
                if ts.acked.get(name) != res.version and not ts.withholds(name, res.version):
                    updates[name] = res
            elif ts.wildcard:
                res = every.get(name)
                if res is not None and ts.acked.get(name) != res.version:
                    updates[name] = res
                elif res is None and name in ts.acked and self.delta:
                    removed.add(name)
        if not updates and not removed:
            return None
        return self._emit(ENDPOINT, ts, updates, frozenset(removed), ts.state_after(updates, removed))

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
            if key == ts.rejected_key and ts.suspects:
                # Nothing but the suspects left to try: they are what it refused.
                ts.rejected.update(ts.suspects)
                ts.suspects.clear()
                ts.probe(0)
                desired, held_back = self._desired(type_url)
                key = _key((n, r.version) for n, r in desired.items())
            if key == ts.rejected_key:
                return None  # exactly what it refused
            ts.last_subscription = subscription
            return self._emit(type_url, ts, desired, frozenset(), key, complete)
        fresh = self._eds_fresh_after if type_url == ENDPOINT else {}
        updates = {
            n: r
            for n, r in desired.items()
            if (ts.acked.get(n) != r.version or n in fresh)
            and not ts.withholds(n, r.version)
            and not isinstance(r, Placeholder)
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
            for name, res in resources.items():
                old = ts.acked.get(name)
                if old == res.version:
                    continue
                # New or updated: Envoy (re)warms it until an assignment arrives after it, and
                # holds its CDS ACK meanwhile. A new one is not ready before then; an updated
                # one keeps serving as it was.
                self._eds_fresh_after[name] = self._nonce
                if eds is not None:
                    if old is None:
                        eds.drop(name)
                    eds.unsettle()  # even an EDS response on its way is not fresh enough
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
        if ts.unacked_since is None:
            ts.unacked_since = self._now
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

    def routes_to(self, cluster: str) -> bool:
        """Whether a route the proxy has ACKed (or is being sent, or may hold from an earlier
        stream) names the cluster."""
        return cluster in self._referenced_clusters()

    def status(self, type_url: str) -> str:
        """SYNCED, STALE, NACKED or NOT_SENT for one type, as an operator reads it. O(1):
        the pump keeps `settled` current after every request and snapshot."""
        ts = self.types.get(type_url)
        if ts is None or not ts.requested or not (ts.responded or ts.acked):
            return "NOT_SENT"
        if ts.last_nacked:
            return "NACKED"
        if ts.in_flight is not None:
            return "STALE"
        return "SYNCED" if ts.settled == self.snapshot.generation else "STALE"

    def unacked_since(self, type_url: str) -> float | None:
        """When the oldest response of the type that the proxy has not yet answered (ACK or
        NACK) was sent, on the clock the calls were given; None when none awaits an answer."""
        ts = self.types.get(type_url)
        return None if ts is None else ts.unacked_since

    def reason(self, type_url: str) -> str:
        """Why a type is not SYNCED, in an operator's words ('' when it is)."""
        ts = self.types.get(type_url)
        status = self.status(type_url)
        if self.capabilities.unsupported and ts is not None:
            return self.capabilities.unsupported
        if ts is None or status in ("SYNCED", "NOT_SENT"):
            return ""
        if status == "NACKED":
            names = ", ".join(sorted(ts.rejected))
            why = f"rejected {names}: {ts.last_error}" if names else ts.last_error
            if ts.suspects:
                why += f" (finding the culprit among {len(ts.suspects)} changes)"
            return why
        if ts.in_flight is not None:
            return f"response {ts.in_flight.nonce} sent, not yet ACKed"
        _, held = self._desired(type_url)
        if type_url == ROUTE:
            desired = self._subscribed(type_url, ts)
            ready = self._ready_clusters()
            parts = []
            for name in sorted(held):
                res = desired.get(name)
                missing = sorted(res.refs - ready) if res is not None else []
                parts.append(f"route {name} held back: " + "; ".join(self._why_not_ready(c) for c in missing))
            return ", ".join(parts) or "not yet in sync"
        if type_url == CLUSTER and held:
            return "kept while a route the proxy has names it: " + ", ".join(sorted(held))
        return "not yet in sync"

    def _why_not_ready(self, cluster: str) -> str:
        cds, eds = self.types.get(CLUSTER), self.types.get(ENDPOINT)
        if cds is not None and cluster in cds.rejected:
            return f"cluster {cluster} was rejected by the proxy ({cds.last_error})"
        if cds is None or cluster not in cds.acked:
            return f"cluster {cluster} not yet ACKed by the proxy (warming, or the response is on its way)"
        if eds is None or cluster not in eds.acked:
            return f"endpoints of {cluster} not yet ACKed by the proxy"
        return f"cluster {cluster} is being removed"
