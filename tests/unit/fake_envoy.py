"""A pure model of how Envoy consumes ADS, to drive XdsStream in unit tests.

Faithful where blackholes come from (each point checked against Envoy 1.40's source and
seen on the real binary):
- CDS: a new cluster warms until an assignment arrives after it; a cluster whose
  definition changed *re-warms* (the old one keeps serving) until a fresh assignment
  arrives; an unchanged one is left alone. While any cluster warms after initialisation,
  the CDS ACK (and any CDS request) is held (ClusterManagerImpl::updateClusterCounts).
- A CDS response with a cluster Envoy refuses while applying it is applied in part: valid
  clusters are added or updated, removals happen, the refused one is skipped, and the NACK
  names it ("Error adding/updating cluster(s) NAME: REASON"). A cluster that fails to
  decode (a negative duration) makes Envoy refuse the whole response, naming nothing.
- A route entry works only if every cluster it names is active (not merely warming) and
  has at least one endpoint. After every response applied, each routed cluster is checked:
  `violations` records every moment a request routed there would fail.
- `reconnect()` keeps everything and opens a new stream the way Envoy does: delta sends
  `initial_resource_versions`, SotW the last accepted `version_info`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.service.discovery.v3 import discovery_pb2

from controlplane.routing.translate import CLUSTER, ENDPOINT, LISTENER, ROUTE, cluster_refs

_MSG = {
    CLUSTER: cluster_pb2.Cluster,
    ENDPOINT: endpoint_pb2.ClusterLoadAssignment,
    LISTENER: listener_pb2.Listener,
    ROUTE: route_pb2.RouteConfiguration,
}

Request = discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest


def undecodable(c: cluster_pb2.Cluster) -> str:
    """Why Envoy cannot even decode a cluster ('' if it can). Decoding (duration and proto
    constraint checks) runs before any resource is applied, so such a cluster makes Envoy
    refuse the whole response, and its message names no cluster."""
    t = c.connect_timeout
    if c.HasField("connect_timeout") and t.seconds < 0:
        return f"Invalid duration: Expected positive duration: seconds: {t.seconds}\n"
    return ""


@dataclass
class FakeEnvoy:
    delta: bool
    node_id: str = "envoy-1"
    # Active clusters: name -> serialised definition. Warming: name -> the pending definition.
    clusters: dict[str, bytes] = field(default_factory=dict)
    warming: dict[str, bytes] = field(default_factory=dict)
    assignments: dict[str, endpoint_pb2.ClusterLoadAssignment] = field(default_factory=dict)
    listeners: dict[str, listener_pb2.Listener] = field(default_factory=dict)
    routes: dict[str, route_pb2.RouteConfiguration] = field(default_factory=dict)
    subscriptions: dict[str, set[str]] = field(default_factory=dict)
    nonces: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)  # SotW: last accepted version_info
    # Delta: per type, the version of each resource held (what a reconnect declares).
    held_versions: dict[str, dict[str, str]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    reject_clusters: set[str] = field(default_factory=set)  # refused by name, beside `invalid`
    # Clusters allowed to be empty (the fleet itself has no endpoint for them).
    may_be_empty: set[str] = field(default_factory=set)
    outbox: deque[Request] = field(default_factory=deque)
    held_cds: deque[Request] = field(default_factory=deque)
    routes_late: bool = False  # the route request waits for the first listener ACK
    initialized: bool = False
    responses: int = 0
    nacks: list[str] = field(default_factory=list)

    def start(self) -> None:
        """Envoy's first requests: CDS and LDS wildcard."""
        self._request(CLUSTER, first=True)
        self._request(LISTENER, first=True)

    def reconnect(self, routes_late: bool = False) -> None:
        """The stream broke; Envoy keeps its config and opens a new one, asking again for every
        type it subscribes to (in that order), with what it holds. With `routes_late`, the
        route request comes only after the first listener response's ACK (an Envoy whose RDS
        is paused while it applies listeners): until then the server cannot know the routes."""
        self.outbox.clear()
        self.held_cds.clear()
        self.nonces.clear()
        self.routes_late = routes_late and ROUTE in self.subscriptions
        for type_url in (CLUSTER, ENDPOINT, LISTENER, ROUTE):
            if type_url == ROUTE and self.routes_late:
                continue
            if type_url in (CLUSTER, LISTENER) or type_url in self.subscriptions:
                self._request(type_url, first=True, initial=True)

    # ---- requests ---------------------------------------------------------------------------

    def _request(
        self,
        type_url: str,
        *,
        first: bool = False,
        subscribe: set[str] | None = None,
        unsubscribe: set[str] | None = None,
        error: str = "",
        initial: bool = False,
    ) -> None:
        nonce = self.nonces.get(type_url, "")
        req: Request
        if self.delta:
            if initial:
                subscribe = set(self.subscriptions.get(type_url, set()))
            req = discovery_pb2.DeltaDiscoveryRequest(
                type_url=type_url,
                response_nonce=nonce,
                resource_names_subscribe=sorted(subscribe or ()),
                resource_names_unsubscribe=sorted(unsubscribe or ()),
            )
            if initial:
                for name, version in self.held_versions.get(type_url, {}).items():
                    req.initial_resource_versions[name] = version
        else:
            req = discovery_pb2.DiscoveryRequest(
                type_url=type_url,
                response_nonce=nonce,
                version_info=self.versions.get(type_url, ""),
                resource_names=sorted(self.subscriptions.get(type_url, ())),
            )
        if first:
            req.node.id = self.node_id
            req.node.user_agent_name = "envoy"  # what Envoy sends unless its bootstrap says otherwise
        if error:
            req.error_detail.CopyFrom(_status(error))
        if type_url == CLUSTER and self.initialized and self.warming:
            self.held_cds.append(req)  # CDS is paused while a cluster warms
        else:
            self.outbox.append(req)

    def _set_subscription(self, type_url: str, names: set[str]) -> None:
        old = self.subscriptions.get(type_url, set())
        if old == names and type_url in self.subscriptions:
            return
        first = type_url not in self.subscriptions
        self.subscriptions[type_url] = set(names)
        if self.delta:
            self._request(type_url, subscribe=names - old, unsubscribe=old - names, first=first)
            held = self.held_versions.get(type_url, {})
            for name in old - names:
                held.pop(name, None)
        else:
            self._request(type_url, first=first)

    # ---- responses --------------------------------------------------------------------------

    def receive(self, payload: bytes) -> None:
        """Apply one response, as Envoy would, and queue its ACK/NACK and new subscriptions."""
        self.responses += 1
        removed: set[str] = set()
        items: dict[str, tuple[str, object]] = {}
        if self.delta:
            d = discovery_pb2.DeltaDiscoveryResponse.FromString(payload)
            type_url, nonce = d.type_url, d.nonce
            items = {r.name: (r.version, _unpack(type_url, r.resource.value)) for r in d.resources}
            removed = set(d.removed_resources)
            version = d.system_version_info
        else:
            s = discovery_pb2.DiscoveryResponse.FromString(payload)
            type_url, nonce, version = s.type_url, s.nonce, s.version_info
            for a in s.resources:
                msg = _unpack(type_url, a.value)
                items[_name(msg)] = ("", msg)
        self.nonces[type_url] = nonce
        error = ""
        if type_url == CLUSTER:
            error = self._apply_clusters(items, removed)
        elif type_url == ENDPOINT:
            for name, (_, msg) in items.items():
                assert isinstance(msg, endpoint_pb2.ClusterLoadAssignment)
                self.assignments[name] = msg
                pending = self.warming.pop(name, None)
                if pending is not None:
                    self.clusters[name] = pending  # warm: the new definition takes over
            if self.delta:
                for name in removed:
                    self.assignments.pop(name, None)
        elif type_url == LISTENER:
            self._apply_listeners(items, removed)
        elif type_url == ROUTE:
            for name, (_, msg) in items.items():
                assert isinstance(msg, route_pb2.RouteConfiguration)
                self.routes[name] = msg
            for name in removed:
                self.routes.pop(name, None)
        if self.delta:
            held = self.held_versions.setdefault(type_url, {})
            for name in removed:
                held.pop(name, None)
            if not error:  # a rejected response records no version, even of what was applied
                held.update({name: v for name, (v, _) in items.items()})
        if not error:
            self.versions[type_url] = version
        else:
            self.nacks.append(error)
        self._request(type_url, error=error)
        if type_url == LISTENER and self.routes_late:
            self.routes_late = False
            self._request(ROUTE, first=True, initial=True)
        self._resubscribe()
        if not self.warming:
            if not self.initialized and self.clusters:
                self.initialized = True
            self.outbox.extend(self.held_cds)
            self.held_cds.clear()
        self.check(f"after a {type_url.rsplit('.', 1)[-1]} response")

    def _apply_clusters(self, items: dict[str, tuple[str, object]], removed: set[str]) -> str:
        for _, msg in items.values():
            assert isinstance(msg, cluster_pb2.Cluster)
            why = undecodable(msg)
            if why:
                return why  # nothing applied, nothing removed
        errors = []
        if not self.delta:
            removed = (set(self.clusters) | set(self.warming)) - set(items)
        for name in removed:
            self.clusters.pop(name, None)
            self.warming.pop(name, None)
            self.assignments.pop(name, None)
        for name, (_, msg) in items.items():
            assert isinstance(msg, cluster_pb2.Cluster)
            if name in self.reject_clusters:
                why = "refused by this test"
                errors.append(f"{name}: {why}")
                continue
            data = msg.SerializeToString(deterministic=True)
            if self.clusters.get(name) == data:
                self.warming.pop(name, None)  # back to what is active: nothing to warm
                continue
            self.warming[name] = data  # new, or changed: (re)warms until fresh endpoints arrive
        return f"Error adding/updating cluster(s) {', '.join(errors)}" if errors else ""

    def _apply_listeners(self, items: dict[str, tuple[str, object]], removed: set[str]) -> None:
        if self.delta:
            for name in removed:
                self.listeners.pop(name, None)
            for name, (_, msg) in items.items():
                assert isinstance(msg, listener_pb2.Listener)
                self.listeners[name] = msg
        else:
            self.listeners = {n: m for n, (_, m) in items.items() if isinstance(m, listener_pb2.Listener)}

    def _resubscribe(self) -> None:
        self._set_subscription(ENDPOINT, set(self.clusters) | set(self.warming))
        route_names = set()
        for lst in self.listeners.values():
            for fc in lst.filter_chains:
                for f in fc.filters:
                    hcm = hcm_pb2.HttpConnectionManager()
                    f.typed_config.Unpack(hcm)
                    route_names.add(hcm.rds.route_config_name)
        if route_names or ROUTE in self.subscriptions:
            self._set_subscription(ROUTE, route_names)
        for name in set(self.routes) - route_names:
            self.routes.pop(name)

    # ---- what a request would meet ------------------------------------------------------------

    def check(self, when: str) -> None:
        """Record every routed cluster a request would fail on right now."""
        for rname, rc in self.routes.items():
            for cluster in sorted(cluster_refs(rc)):
                why = self.would_fail(cluster)
                if why:
                    self.violations.append(f"{when}: route {rname} -> {cluster}: {why}")

    def would_fail(self, cluster: str) -> str:
        if cluster not in self.clusters:
            return "no such cluster" + (" (still warming)" if cluster in self.warming else "")
        cla = self.assignments.get(cluster)
        if cluster in self.may_be_empty:
            return ""
        if cla is None or not any(loc.lb_endpoints for loc in cla.endpoints):
            return "no endpoints (503 no healthy upstream)"
        return ""

    def active_clusters(self) -> set[str]:
        return set(self.clusters)

    def routed_clusters(self) -> set[str]:
        out: set[str] = set()
        for rc in self.routes.values():
            out |= cluster_refs(rc)
        return out


def _status(message: str) -> object:
    from google.rpc import status_pb2

    return status_pb2.Status(code=3, message=message)


def _unpack(type_url: str, value: bytes) -> object:
    return _MSG[type_url].FromString(value)


def _name(msg: object) -> str:
    if isinstance(msg, endpoint_pb2.ClusterLoadAssignment):
        return msg.cluster_name
    return str(getattr(msg, "name"))  # noqa: B009
