"""A pure model of how Envoy consumes ADS, to drive XdsStream in unit tests.

It applies responses the way Envoy does (CDS replaces clusters, new clusters warm until
their EDS arrives, listeners subscribe their RDS names) and records every moment a route
named a cluster it did not have warm: the make-before-break violations.
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


@dataclass
class FakeEnvoy:
    delta: bool
    node_id: str = "envoy-1"
    clusters: dict[str, str] = field(default_factory=dict)  # name -> version
    warming: set[str] = field(default_factory=set)
    assignments: dict[str, endpoint_pb2.ClusterLoadAssignment] = field(default_factory=dict)
    listeners: dict[str, listener_pb2.Listener] = field(default_factory=dict)
    routes: dict[str, route_pb2.RouteConfiguration] = field(default_factory=dict)
    subscriptions: dict[str, set[str]] = field(default_factory=dict)
    nonces: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    reject_clusters: set[str] = field(default_factory=set)
    outbox: deque[Request] = field(default_factory=deque)
    responses: int = 0

    def start(self) -> None:
        """Envoy's first requests: CDS and LDS wildcard."""
        self._request(CLUSTER, first=True)
        self._request(LISTENER, first=True)

    # ---- requests ---------------------------------------------------------------------------

    def _request(
        self,
        type_url: str,
        *,
        first: bool = False,
        subscribe: set[str] | None = None,
        unsubscribe: set[str] | None = None,
        error: str = "",
    ) -> None:
        nonce = self.nonces.get(type_url, "")
        if self.delta:
            req = discovery_pb2.DeltaDiscoveryRequest(
                type_url=type_url,
                response_nonce=nonce,
                resource_names_subscribe=sorted(subscribe or ()),
                resource_names_unsubscribe=sorted(unsubscribe or ()),
            )
        else:
            req = discovery_pb2.DiscoveryRequest(
                type_url=type_url,
                response_nonce=nonce,
                version_info=self.versions.get(type_url, ""),
                resource_names=sorted(self.subscriptions.get(type_url, ())),
            )
        if first:
            req.node.id = self.node_id
            req.node.user_agent_name = "fake-envoy"
        if error:
            req.error_detail.CopyFrom(_status(error))
        self.outbox.append(req)

    def _set_subscription(self, type_url: str, names: set[str]) -> None:
        old = self.subscriptions.get(type_url, set())
        if old == names and type_url in self.subscriptions:
            return
        first = type_url not in self.subscriptions
        self.subscriptions[type_url] = set(names)
        if self.delta:
            self._request(type_url, subscribe=names - old, unsubscribe=old - names, first=first)
        else:
            self._request(type_url, first=first)

    # ---- responses --------------------------------------------------------------------------

    def receive(self, payload: bytes) -> None:
        """Apply one response, as Envoy would, and queue its ACK/NACK and new subscriptions."""
        self.responses += 1
        if self.delta:
            d = discovery_pb2.DeltaDiscoveryResponse.FromString(payload)
            type_url, nonce = d.type_url, d.nonce
            items = {r.name: (r.version, _unpack(type_url, r.resource.value)) for r in d.resources}
            removed = set(d.removed_resources)
            version = d.system_version_info
        else:
            s = discovery_pb2.DiscoveryResponse.FromString(payload)
            type_url, nonce, version = s.type_url, s.nonce, s.version_info
            items = {}
            for a in s.resources:
                msg = _unpack(type_url, a.value)
                items[_name(msg)] = ("", msg)
            removed = set()
        self.nonces[type_url] = nonce
        error = ""
        if type_url == CLUSTER:
            error = self._apply_clusters(items, removed)
        elif type_url == ENDPOINT:
            for name, (_, msg) in items.items():
                self.assignments[name] = msg
                self.warming.discard(name)
        elif type_url == LISTENER:
            self._apply_listeners(items, removed)
        elif type_url == ROUTE:
            for name, (_, msg) in items.items():
                missing = cluster_refs(msg) - self.active_clusters()
                if missing:
                    self.violations.append(f"route {name} names clusters not warm: {sorted(missing)}")
                self.routes[name] = msg
            for name in removed:
                self.routes.pop(name, None)
        if not error:
            self.versions[type_url] = version
        self._request(type_url, error=error)
        self._resubscribe()

    def _apply_clusters(self, items: dict[str, tuple[str, object]], removed: set[str]) -> str:
        bad = sorted(set(items) & self.reject_clusters)
        if self.delta:
            new = dict(self.clusters)
            for name in removed:
                new.pop(name, None)
        else:
            new = {}
            if bad:
                return f"rejected clusters {bad}"
        for name in items:
            if name in self.reject_clusters:
                continue
            if name not in self.clusters:
                self.warming.add(name)
            new[name] = "v"
        gone = set(self.clusters) - set(new)
        if self.delta and bad:
            self.clusters = new
            return f"rejected clusters {bad}"
        for name in gone:
            self.warming.discard(name)
            self.assignments.pop(name, None)
            for rname, rc in self.routes.items():
                if name in cluster_refs(rc):
                    self.violations.append(f"cluster {name} removed while route {rname} names it")
        self.clusters = new
        return ""

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
        self._set_subscription(ENDPOINT, set(self.clusters))
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

    def active_clusters(self) -> set[str]:
        return set(self.clusters) - self.warming

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
