"""What proxies of this process ACKed, shared by every stream, and kept across restarts.

A proxy that reconnects holds config the new stream cannot see: SotW says only a hash of
it, delta names and versions. Its routes may still name a cluster that left the fleet
meanwhile, or one whose current definition it refuses. The memory holds the last
definition of each cluster that a proxy ACKed and the route configurations proxies ACKed
recently, so a declared route version is resolved at once and a cluster a proxy may route
to is never dropped for want of content.

`dump` and `load` (pure) turn it, with each cluster's last assignment, into bytes the server
writes to the state directory, so a restarted control plane (kill -9 included) remembers
too: the clusters of a version replaced while it was down are still there for the proxy
that routes to them until its new routes arrive.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import DecodeError, Message

from controlplane.resources.types import CLUSTER, ENDPOINT, ROUTE
from controlplane.xds import wire
from controlplane.xds.snapshot import Placeholder, Snapshot, SnapshotResource, encode_resource, pair_hash

MAGIC = b"controlplane-xds-memory 2\n"
MAGIC_V1 = b"controlplane-xds-memory 1\n"  # without the section of clusters not known ACKed


class ClusterMemory:
    """The last definition of each cluster a proxy ACKed, and recent route configurations
    by version. `changes` counts what was new, for whoever persists it."""

    def __init__(self, limit: int = 65536, routes: int = 256) -> None:
        self.limit = limit
        self.route_limit = routes
        self.changes = 0
        self._good: OrderedDict[str, SnapshotResource] = OrderedDict()
        # Restored from the file: clusters sent (or about to be) that no proxy was known to
        # have ACKed when it was written. Content for a cluster a proxy may hold, never proof
        # that a proxy took it (NACK attribution reads only `get`).
        self._sent: dict[str, SnapshotResource] = {}
        self._routes: OrderedDict[str, SnapshotResource] = OrderedDict()
        self._last: object = None

    def record(self, resources: Mapping[str, SnapshotResource]) -> None:
        """A proxy ACKed these clusters (a shared dict is recorded once, however many ACK it)."""
        if resources is self._last:
            return
        self._last = resources
        for name, res in resources.items():
            if isinstance(res, Placeholder) or self._good.get(name) is res:
                continue
            old = self._good.get(name)
            self._good[name] = res
            self._good.move_to_end(name)
            if old is None or old.version != res.version:
                self.changes += 1
        while len(self._good) > self.limit:
            self._good.popitem(last=False)

    def record_routes(self, resources: Iterable[SnapshotResource]) -> None:
        """A proxy ACKed these route configurations."""
        for res in resources:
            if isinstance(res, Placeholder):
                continue
            if res.version not in self._routes:
                self.changes += 1
            self._routes[res.version] = res
            self._routes.move_to_end(res.version)
        while len(self._routes) > self.route_limit:
            self._routes.popitem(last=False)

    def get(self, name: str) -> SnapshotResource | None:
        """The last definition of `name` a proxy ACKed."""
        return self._good.get(name)

    def content(self, name: str) -> SnapshotResource | None:
        """The last definition a proxy may hold: ACKed, else one sent before a restart."""
        return self._good.get(name) or self._sent.get(name)

    def restore_sent(self, resources: Iterable[SnapshotResource]) -> None:
        for res in resources:
            self._sent[res.name] = res
        while len(self._sent) > self.limit:
            self._sent.pop(next(iter(self._sent)))

    def sent(self) -> list[SnapshotResource]:
        return [r for n, r in self._sent.items() if n not in self._good]

    def names(self) -> Set[str]:
        return self._good.keys()

    def clusters(self) -> list[SnapshotResource]:
        return list(self._good.values())

    def routes(self) -> list[SnapshotResource]:
        return list(self._routes.values())

    def route(self, name: str, version: str) -> SnapshotResource | None:
        """A route configuration a proxy ACKed at `version` (delta's resource version)."""
        res = self._routes.get(version)
        return res if res is not None and res.name == name else None

    def route_by_state(self, name: str, state: str) -> SnapshotResource | None:
        """The route configuration `name` whose SotW state version is `state`, if a proxy
        held only that one of its type."""
        for res in reversed(self._routes.values()):
            if res.name == name and f"{pair_hash(name, res.version):016x}" == state:
                return res
        return None


@dataclass(frozen=True)
class Remembered:
    """What `load` found: the assignment each remembered cluster last had."""

    clusters: int
    routes: int
    assignments: dict[str, SnapshotResource]


def _unacked(memory: ClusterMemory, snapshot: Snapshot | None) -> list[SnapshotResource]:
    """Clusters of the snapshot, lingering after it, or sent before a restart, that no
    proxy is known to have ACKed."""
    acked = memory.names()
    out: dict[str, SnapshotResource] = {r.name: r for r in memory.sent()}
    if snapshot is not None:
        for g in snapshot.lingering.values():
            if g.cluster is not None and g.cluster.name not in acked:
                out[g.cluster.name] = g.cluster
        for n, r in snapshot.resources.get(CLUSTER, {}).items():
            if n not in acked and not isinstance(r, Placeholder):
                out[n] = r
    return list(out.values())


def dump(memory: ClusterMemory, snapshot: Snapshot | None) -> bytes:
    """`dump_named` without the names."""
    return dump_named(memory, snapshot)[0]


def dump_named(memory: ClusterMemory, snapshot: Snapshot | None) -> tuple[bytes, set[str]]:
    """(the file's bytes, the cluster names it holds): the memory, with each remembered
    cluster's current (or last) non-empty assignment, as four DiscoveryResponses (ACKed
    clusters, assignments, routes, clusters not known ACKed), each length-prefixed.

    The snapshot's clusters (and lingering ones) that no proxy has ACKed yet are written in
    their own section: a proxy may ACK one a moment before a kill -9, before the next write,
    and route to it. Written ahead of the snapshot's publication (XdsServer.write_ahead), the
    file names every cluster a proxy can hold. Cheap: resources are already serialised; this
    only joins them."""
    acked = memory.clusters()
    unacked = _unacked(memory, snapshot)
    assignments = []
    if snapshot is not None:
        for c in (*acked, *unacked):
            a = snapshot.get(ENDPOINT, c.name)
            if a is not None and a.message is not None and _has_endpoints(a.message):
                assignments.append(a)
    parts = [
        wire.sotw_response("", CLUSTER, "", (r.sotw_field for r in acked)),
        wire.sotw_response("", ENDPOINT, "", (r.sotw_field for r in assignments)),
        wire.sotw_response("", ROUTE, "", (r.sotw_field for r in memory.routes())),
        wire.sotw_response("", CLUSTER, "", (r.sotw_field for r in unacked)),
    ]
    names = {r.name for r in acked} | {r.name for r in unacked}
    return MAGIC + b"".join(struct.pack(">I", len(p)) + p for p in parts), names


_TYPES: dict[str, type[Message]] = {
    CLUSTER: cluster_pb2.Cluster,
    ENDPOINT: endpoint_pb2.ClusterLoadAssignment,
    ROUTE: route_pb2.RouteConfiguration,
}


def load(memory: ClusterMemory, data: bytes) -> Remembered:
    """Fill `memory` from `dump`'s bytes; raise ValueError saying what is wrong with them."""
    if data.startswith(MAGIC):
        sections = 4
    elif data.startswith(MAGIC_V1):
        sections = 3
    else:
        raise ValueError("not an xDS memory file (unknown header)")
    rest = data[len(MAGIC) :]
    by_type: dict[str, list[SnapshotResource]] = {}
    unacked: list[SnapshotResource] = []
    for i in range(sections):
        if len(rest) < 4:
            raise ValueError("truncated")
        (n,) = struct.unpack(">I", rest[:4])
        chunk, rest = rest[4 : 4 + n], rest[4 + n :]
        if len(chunk) != n:
            raise ValueError("truncated")
        try:
            resp = discovery_pb2.DiscoveryResponse.FromString(chunk)
            kind = _TYPES[resp.type_url]
            msgs = [kind.FromString(a.value) for a in resp.resources]
        except (DecodeError, KeyError) as e:
            raise ValueError(f"an unreadable section: {e!r}") from e
        found = [encode_resource(resp.type_url, _name(m), m) for m in msgs]
        if i == 3:
            unacked = found
        else:
            by_type[resp.type_url] = found
    clusters = by_type.get(CLUSTER, [])
    memory.record({c.name: c for c in clusters})
    memory.restore_sent(unacked)
    routes = by_type.get(ROUTE, [])
    memory.record_routes(routes)
    return Remembered(
        len(clusters) + len(unacked), len(routes), {a.name: a for a in by_type.get(ENDPOINT, [])}
    )


def _name(msg: Message) -> str:
    if isinstance(msg, endpoint_pb2.ClusterLoadAssignment):
        return str(msg.cluster_name)
    return str(getattr(msg, "name"))  # noqa: B009


def _has_endpoints(msg: Message) -> bool:
    return isinstance(msg, endpoint_pb2.ClusterLoadAssignment) and any(
        loc.lb_endpoints for loc in msg.endpoints
    )
