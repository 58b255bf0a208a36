"""The per-stream xDS protocol as a pure object (sans-IO), for SotW and delta, ADS or one type.

Feed it requests (`receive`) and snapshots (`set_snapshot`); it returns events: bytes to
send, ACKs, NACKs, stale nonces. It never does I/O, so every protocol corner is unit-tested.
The per-type bookkeeping it keeps is in typestate.py, the events it returns in events.py, and
the per-proxy variants of resources it sends (shared by streams) in variants.py.

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

import re
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from controlplane import limits
from controlplane.resources.types import CLUSTER, ENDPOINT, LISTENER, ROUTE, TYPE_URLS
from controlplane.xds import capabilities, variants, wire
from controlplane.xds.capabilities import Capabilities
from controlplane.xds.events import (
    Ack,
    Event,
    Nack,
    NackCleared,
    NodeIdentified,
    Refused,
    Send,
    StaleNonce,
    UnknownType,
)
from controlplane.xds.memory import ClusterMemory
from controlplane.xds.snapshot import Placeholder, Snapshot, SnapshotResource, pair_hash
from controlplane.xds.typestate import InFlight, TypeState, content_key

FULL_STATE_TYPES = frozenset({LISTENER, CLUSTER})
WILDCARD = "*"
# Bounds on what one client can make a stream hold (docs/limits.md).
MAX_NAMES_PER_TYPE = limits.XDS_MAX_NAMES_PER_TYPE
MAX_UNKNOWN_TYPES_REPORTED = 8
# How long a cluster stays on an Envoy after the last route naming it was replaced (or, after
# a reconnect, after a route sent here was ACKed). Envoy ACKs a route at once, but a request
# keeps the route table it started with until its router picks a cluster (after the filters
# before it, the body read for model routing, and its retries): removing the cluster at the
# ACK failed such a request with `no_cluster` 503 (6 ms after the ACK, seen under load).
CLUSTER_REMOVAL_GRACE_S = 2.0


def bounded(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters with a note of how much was left out: what a proxy
    sends is shown and logged, and must not grow every status page and log line."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


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
        removal_grace_s: float = 0.0,
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
        # Clusters no route names any more, kept until a time on the calls' clock (a route
        # ACKed is not yet a route every request uses): name -> until.
        self.removal_grace_s = removal_grace_s
        self._retiring: dict[str, float] = {}

    # ---- inputs -------------------------------------------------------------------------

    def set_snapshot(self, snapshot: Snapshot, now: float) -> list[Event]:
        """A new desired state: send what changed, in make-before-break order."""
        previous = self.snapshot.generation
        self.snapshot = snapshot
        self._now = now
        return list(self._pump(fast_from=previous if snapshot.parent == previous else None))

    def next_deadline(self) -> float | None:
        """When a cluster kept for requests on an old route may go: call `tick` then."""
        return min(self._retiring.values()) if self._retiring else None

    def tick(self, now: float) -> list[Event]:
        """Time passed: send the removals whose grace ended."""
        self._now = now
        expired = [n for n, until in self._retiring.items() if until <= now]
        if not expired:
            return []
        for name in expired:
            del self._retiring[name]
        return list(self._pump())

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
        retire = self.removal_grace_s > 0 and type_url in (ROUTE, LISTENER) and self._gating()
        refs_before = self._acked_refs() if retire else frozenset()
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
        if retire:
            self._retire(refs_before - self._acked_refs())
        return [
            Ack(
                type_url,
                nonce,
                flight.version,
                flight.generation,
                max(0.0, now - flight.created_at),
            )
        ]

    def _nack(self, type_url: str, ts: TypeState, flight: InFlight, message: str) -> Nack:
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

    def _acked_refs(self) -> frozenset[str]:
        """Clusters named by the routes and listeners the proxy has ACKed."""
        out: set[str] = set()
        for t in (ROUTE, LISTENER):
            ts = self.types.get(t)
            if ts is not None:
                for res in ts.acked_res.values():
                    out |= res.refs
        return frozenset(out)

    def _retire(self, names: Iterable[str]) -> None:
        """No route the proxy has names these any more: keep them for the grace."""
        until = self._now + self.removal_grace_s
        for name in names:
            if self._retiring.get(name, 0.0) < until:
                self._retiring[name] = until

    def _referenced_clusters(self) -> set[str]:
        """Clusters named by routes the proxy has or is being sent (or may have, from before)."""
        out: set[str] = set(self._acked_refs())
        for t in (ROUTE, LISTENER):
            ts = self.types.get(t)
            if ts is not None and ts.in_flight is not None:
                for res in ts.in_flight.resources.values():
                    out |= res.refs
        inherited = self._inherited_clusters
        if inherited is None or inherited:
            if not self._routes_confirmed():
                out |= set(self.snapshot.lingering) if inherited is None else inherited
            else:
                self._inherited_clusters = frozenset()
                if self.removal_grace_s > 0:
                    # The routes it brought are replaced: requests may still be on them.
                    self._retire(set(self.snapshot.lingering) if inherited is None else inherited)
        return out

    def _kept_clusters(self) -> set[str]:
        """Clusters the proxy must keep: those its routes name, and those a replaced route
        named, until their grace ends (requests on the old route may still pick them)."""
        out = self._referenced_clusters()
        if self._retiring:
            out |= {n for n, until in self._retiring.items() if until > self._now}
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
            every = variants.adapted_all(every, missing)  # as this proxy can take them (shared)
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
            kept_names = [n for n in self._kept_clusters() if n not in out]
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
                    out[name] = variants.blended(res, held, ready)
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
                    res = variants.adapted(res, missing)
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
            key = content_key((n, r.version) for n, r in desired.items())
            subscription = (ts.wildcard, frozenset(ts.names))
            if ts.responded and key == ts.acked_version and subscription == ts.last_subscription:
                return None
            if key == ts.rejected_key and ts.suspects:
                # Nothing but the suspects left to try: they are what it refused.
                ts.rejected.update(ts.suspects)
                ts.suspects.clear()
                ts.probe(0)
                desired, held_back = self._desired(type_url)
                key = content_key((n, r.version) for n, r in desired.items())
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
        ts.in_flight = InFlight(
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
