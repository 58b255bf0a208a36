"""grpc.aio servicers for ADS (SotW and delta) and the per-type discovery services.

A thin shell around `XdsStream`: it reads requests, waits for snapshots, writes the bytes
the protocol returns, and turns protocol events into logs and metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog
from envoy.service.discovery.v3 import discovery_pb2
from prometheus_client.core import GaugeMetricFamily

from controlplane import limits
from controlplane.net.tls import identity_mismatch
from controlplane.obs.metrics import Metrics
from controlplane.resources.types import CLUSTER, ENDPOINT, LISTENER, ROUTE, TYPE_URLS, type_label
from controlplane.xds import memory as xds_memory
from controlplane.xds.cache import SnapshotCache
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
from controlplane.xds.protocol import CLUSTER_REMOVAL_GRACE_S, XdsStream
from controlplane.xds.snapshot import Snapshot

log = structlog.get_logger("controlplane.xds")

ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
# service name -> (type served, SotW method, delta method)
PER_TYPE_SERVICES: dict[str, tuple[str, str, str]] = {
    "envoy.service.cluster.v3.ClusterDiscoveryService": (
        CLUSTER,
        "StreamClusters",
        "DeltaClusters",
    ),
    "envoy.service.endpoint.v3.EndpointDiscoveryService": (
        ENDPOINT,
        "StreamEndpoints",
        "DeltaEndpoints",
    ),
    "envoy.service.listener.v3.ListenerDiscoveryService": (
        LISTENER,
        "StreamListeners",
        "DeltaListeners",
    ),
    "envoy.service.route.v3.RouteDiscoveryService": (ROUTE, "StreamRoutes", "DeltaRoutes"),
}
ADS_LABEL = "ads"  # ConnectedStream.service of an ADS stream


class Inbox:
    """Requests read ahead of the protocol on one stream, bounded in count and in bytes
    (docs/limits.md): a client that sends faster than it is answered waits (HTTP/2 flow
    control pushes back on it) instead of growing the server's memory."""

    def __init__(
        self, max_requests: int = limits.XDS_INBOX_MAX_REQUESTS, max_bytes: int = limits.XDS_INBOX_MAX_BYTES
    ) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._items: deque[tuple[Any, int]] = deque()
        self.bytes = 0
        self.room = asyncio.Event()  # set while another request may be read
        self.room.set()

    def put(self, request: Any) -> None:
        size = request.ByteSize() if hasattr(request, "ByteSize") else 0
        self._items.append((request, size))
        self.bytes += size
        if len(self._items) >= self.max_requests or self.bytes >= self.max_bytes:
            self.room.clear()

    def take(self) -> Any:
        request, size = self._items.popleft()
        self.bytes -= size
        return request

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def drained(self) -> None:
        """The protocol has taken what was read: reading goes on."""
        if len(self._items) < self.max_requests and self.bytes < self.max_bytes:
            self.room.set()


T = TypeVar("T")
_SERVICE_LABEL = {
    ADS_SERVICE: ADS_LABEL,
    **{name: type_label(t) for name, (t, _, _) in PER_TYPE_SERVICES.items()},
}


@dataclass
class ConnectedStream:
    """One live xDS stream, as shown to operators."""

    stream_id: int
    peer: str
    service: str
    transport: str
    connected_at: float
    protocol: XdsStream
    cluster: str = ""
    user_agent: str = ""
    nacks: dict[str, str] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    identified: bool = False  # counted in ProxyRegistry.nodes

    def describe(self) -> dict[str, Any]:
        """A JSON-ready view: node, peer, and per type the ACKed version and status."""
        types = {}
        for type_url in TYPE_URLS:
            ts = self.protocol.types.get(type_url)
            if ts is None:
                continue
            types[type_label(type_url)] = {
                "status": self.protocol.status(type_url),
                "reason": self.protocol.reason(type_url),
                "acked_version": ts.acked_version,
                "last_nack": ts.last_error,
                "resources": len(ts.acked),
                "responses_sent": self.sent.get(type_url, 0),
            }
        return {
            "stream_id": self.stream_id,
            "node_id": self.protocol.node_id,
            "node_cluster": self.cluster,
            "user_agent": self.user_agent,
            "version": self.protocol.capabilities.version,
            "notes": self.protocol.capabilities.notes(),
            "peer": self.peer,
            "service": self.service,
            "transport": self.transport,
            "connected_seconds": round(time.monotonic() - self.connected_at, 3),
            "types": types,
        }


class ProxyRegistry:
    """Every connected stream, for status pages and the proxies_nacked gauge.

    Streams live on the event loop. Other threads (the HTTP status server) read them only
    through `on_loop`, which runs the reader there: iterating the tables from another thread
    while the loop mutates them fails ("dictionary changed size during iteration")."""

    def __init__(self) -> None:
        self.streams: dict[int, ConnectedStream] = {}
        self.nodes: dict[str, int] = {}  # node id -> its identified streams here
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stale: tuple[float, dict[str, tuple[int, float]]] = (0.0, {})
        self.clock: Callable[[], float] = time.monotonic  # the streams' clock (the server's)
        self._stale_lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the streams live on (set when the server starts)."""
        self.loop = loop

    def on_loop(self, read: Callable[[], T], timeout_s: float = 5.0) -> T:
        """Run `read` on the streams' loop and return its result (from any other thread)."""
        loop = self.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop or loop.is_closed():
            return read()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            try:
                done.set_result(read())
            except Exception as e:
                done.set_exception(e)

        loop.call_soon_threadsafe(call)
        return done.result(timeout_s)

    def describe(self) -> list[dict[str, Any]]:
        return [s.describe() for s in sorted(self.streams.values(), key=lambda s: s.stream_id)]

    def holds_stream(self, node_id: str) -> bool:
        """Whether a proxy with this node id holds an xDS stream here (on the loop)."""
        return self.nodes.get(node_id, 0) > 0

    # ---- what rollouts and drains ask of the proxies (on the loop) --------------------------

    def routing_to(self, cluster: str, envoys_only: bool = False) -> tuple[str, ...]:
        """Connected proxies whose ACKed routes (or routes on their way) name the cluster. With
        `envoys_only`, proxyless gRPC clients are left out (they follow the stable version,
        which moves only when a rollout completes)."""
        out = {
            s.protocol.node_id or s.peer
            for s in self.streams.values()
            if not (envoys_only and not self._every_cluster(s)) and s.protocol.routes_to(cluster)
        }
        return tuple(sorted(out))

    def lacking(self, cluster: str) -> tuple[str, ...]:
        """Connected Envoys (ADS, every cluster) that have not ACKed the cluster and its
        endpoints. Proxyless gRPC clients are left out: they follow the stable version only."""
        out = {
            s.protocol.node_id or s.peer
            for s in self.streams.values()
            if self._every_cluster(s) and not s.protocol.holds_cluster(cluster)
        }
        return tuple(sorted(out))

    def all_synced(self, type_url: str) -> bool:
        """Whether every connected stream that asked for the type has ACKed its latest."""
        return all(
            s.protocol.status(type_url) == "SYNCED"
            for s in self.streams.values()
            if type_url in s.protocol.types and s.protocol.types[type_url].requested
        )

    @staticmethod
    def _every_cluster(s: ConnectedStream) -> bool:
        return s.service == ADS_LABEL and s.protocol.wants_every_cluster

    def identified(self, node_id: str) -> None:
        self.nodes[node_id] = self.nodes.get(node_id, 0) + 1

    def closed(self, node_id: str) -> None:
        left = self.nodes.get(node_id, 0) - 1
        if left > 0:
            self.nodes[node_id] = left
        else:
            self.nodes.pop(node_id, None)

    def stale_counts(self, max_age_s: float = 0.25) -> dict[str, tuple[int, float]]:
        """Per type: connected streams whose config is STALE, and the age of the oldest
        response not yet ACKed or NACKed (0: none awaits). Computed on the loop at most once
        per `max_age_s` however many scrapes ask at once."""
        with self._stale_lock:
            at, counts = self._stale
            if counts and time.monotonic() - at < max_age_s:
                return counts
            counts = self.on_loop(self._count_stale)
            self._stale = (time.monotonic(), counts)
            return counts

    def _count_stale(self) -> dict[str, tuple[int, float]]:
        now = self.clock()
        stale = dict.fromkeys((type_label(t) for t in TYPE_URLS), 0)
        oldest = dict.fromkeys((type_label(t) for t in TYPE_URLS), 0.0)
        for stream in self.streams.values():
            for t in TYPE_URLS:
                if t not in stream.protocol.types:
                    continue
                label = type_label(t)
                if stream.protocol.status(t) == "STALE":
                    stale[label] += 1
                since = stream.protocol.unacked_since(t)
                if since is not None:
                    oldest[label] = max(oldest[label], now - since)
        return {label: (stale[label], oldest[label]) for label in stale}


class StaleProxiesCollector:
    """`controlplane_xds_proxies_stale{type}`, counted when scraped: connected streams whose
    config of a type is not the current one (a response in flight, one never ACKed, or a
    route held back because a cluster it needs is not ready on that proxy). Briefly above 0
    after every push; staying above 0 means a proxy is not converging."""

    def __init__(self, registry: ProxyRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "controlplane_xds_proxies_stale",
            "Connected proxies whose config of a type is not the current one (a response in "
            "flight or never ACKed, or a route held back for a cluster not ready on that proxy); "
            "above 0 for minutes means a proxy is not converging.",
            labels=["type"],
        )
        age = GaugeMetricFamily(
            "controlplane_xds_oldest_unacked_response_seconds",
            "Age of the oldest xDS response of a type that a connected proxy has neither ACKed nor "
            "NACKed (0: every response answered). A push in flight keeps it under a second; a "
            "proxy that does not converge makes it grow.",
            labels=["type"],
        )
        for label, (n, oldest) in self.registry.stale_counts().items():
            g.add_metric([label], n)
            age.add_metric([label], oldest)
        yield g
        yield age


class XdsServer:
    """Serves ADS and the per-type discovery services from a SnapshotCache."""

    def __init__(
        self,
        cache: SnapshotCache,
        metrics: Metrics,
        registry: ProxyRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.metrics = metrics
        self.registry = registry or ProxyRegistry()
        self.registry.clock = clock
        metrics.registry.register(StaleProxiesCollector(self.registry))
        self.clock = clock
        # What proxies of this process ACKed: reconnecting proxies are resolved against it.
        self.memory = ClusterMemory()
        # Mutual TLS: a stream's node id must be one of its client certificate's identities.
        self.check_identity = False
        self._write_lock = threading.Lock()  # the periodic write (a thread) and write_ahead
        self._written_names: Set[str] = frozenset()  # clusters the memory file names
        self._ids = itertools.count(1)
        self._metric_children: dict[tuple[str, str], _TypeMetrics] = {}

    def write_ahead(self, snapshot: Snapshot, path: Path) -> None:
        """Before `snapshot` is published: if it has clusters the memory file does not name,
        write the file now (a few ms, only when cluster names appear). A proxy may ACK a new
        cluster and route to it before the periodic write; after a kill -9 the restarted
        server must still know the cluster, or it would drop it from under the routes."""
        names = snapshot.resources.get(CLUSTER, {}).keys()
        if names <= self._written_names:
            return
        try:
            self._write(path, snapshot)
        except OSError as e:
            log.warning("xds memory not written ahead of a snapshot", path=str(path), error=str(e))

    def _write(self, path: Path, snapshot: Snapshot | None) -> None:
        data, names = xds_memory.dump_named(self.memory, snapshot)
        with self._write_lock:
            _write_atomic(path, data)
        self._written_names = names

    async def keep_memory(self, path: Path, interval_s: float = 0.1, refresh_s: float = 10.0) -> None:
        """Write the memory (what proxies ACKed, with each cluster's last assignment) to
        `path` whenever it learnt something, and every `refresh_s` while the fleet moves, so
        a restarted server remembers it. Until cancelled; a last write then."""
        written = (-1, -1)
        last = 0.0
        try:
            while True:
                await asyncio.sleep(interval_s)
                snap = self.cache.current
                state = (self.memory.changes, snap.generation if snap is not None else -1)
                now = time.monotonic()
                if state == written or (state[0] == written[0] and now - last < refresh_s):
                    continue
                await asyncio.to_thread(self._write, path, snap)
                written, last = state, now
        finally:
            with contextlib.suppress(OSError):
                self._write(path, self.cache.current)

    def handlers(self) -> Sequence[grpc.GenericRpcHandler]:
        """Generic handlers: requests are parsed, responses are already bytes."""
        out: list[grpc.GenericRpcHandler] = []
        services: dict[str, tuple[str | None, str, str]] = {
            ADS_SERVICE: (None, "StreamAggregatedResources", "DeltaAggregatedResources")
        }
        services.update({k: (t, s, d) for k, (t, s, d) in PER_TYPE_SERVICES.items()})
        for service, (type_url, sotw_method, delta_method) in services.items():
            out.append(
                grpc.method_handlers_generic_handler(
                    service,
                    {
                        sotw_method: grpc.stream_stream_rpc_method_handler(
                            self._handler(service, type_url, delta=False),
                            request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
                            response_serializer=_identity,
                        ),
                        delta_method: grpc.stream_stream_rpc_method_handler(
                            self._handler(service, type_url, delta=True),
                            request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
                            response_serializer=_identity,
                        ),
                    },
                )
            )
        return out

    def _handler(self, service: str, type_url: str | None, *, delta: bool) -> Callable[..., Any]:
        async def handle(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
            # Cancelled when the server stops or the RPC ends: nothing left to do.
            with contextlib.suppress(asyncio.CancelledError):
                await self._serve_stream(context, service, type_url, delta=delta)

        return handle

    async def _serve_stream(
        self,
        context: grpc.aio.ServicerContext,
        service: str,
        type_url: str | None,
        *,
        delta: bool,
    ) -> None:
        snapshot = self.cache.current
        if snapshot is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "no complete configuration yet: the fleet config has not loaded; "
                "the proxy keeps its current config and should retry",
            )
            return
        transport = "delta" if delta else "sotw"
        if self.registry.loop is None:
            self.registry.bind(asyncio.get_running_loop())
        proto = XdsStream(
            snapshot,
            delta=delta,
            ads=type_url is None,
            type_url=type_url,
            memory=self.memory,
            removal_grace_s=CLUSTER_REMOVAL_GRACE_S,
        )
        conn = ConnectedStream(
            stream_id=next(self._ids),
            peer=context.peer() or "",
            service=_SERVICE_LABEL[service],
            transport=transport,
            connected_at=self.clock(),
            protocol=proto,
        )
        self.registry.streams[conn.stream_id] = conn
        gauge = self.metrics.streams.labels(conn.service, transport)
        gauge.inc()
        slog = log.bind(stream=conn.stream_id, peer=conn.peer, transport=transport)
        slog.info("xds stream opened", service=conn.service)
        inbox = Inbox()
        wake = asyncio.Event()

        async def read_requests() -> None:
            # One reader per stream; the main loop below wakes on a request or a snapshot.
            try:
                while True:
                    await inbox.room.wait()
                    request = await context.read()
                    inbox.put(request)
                    wake.set()
                    if request is grpc.aio.EOF:
                        return
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                inbox.put(grpc.aio.EOF)
                wake.set()

        reader = asyncio.create_task(read_requests())
        self.cache.subscribe(wake.set)
        try:
            while True:
                deadline = proto.next_deadline()
                if deadline is None:
                    await wake.wait()
                else:  # a cluster kept for requests on a replaced route may go then
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), max(0.0, deadline - self.clock()))
                wake.clear()
                events: list[Event] = []
                current = self.cache.current
                if current is not None and current.generation != proto.snapshot.generation:
                    events.extend(proto.set_snapshot(current, self.clock()))
                closed = False
                while inbox:
                    request = inbox.take()
                    if request is grpc.aio.EOF:
                        closed = True
                        break
                    events.extend(proto.receive(request, self.clock()))
                inbox.drained()
                if (deadline := proto.next_deadline()) is not None and deadline <= self.clock():
                    events.extend(proto.tick(self.clock()))
                if self.check_identity:
                    for ev in events:
                        if isinstance(ev, NodeIdentified) and (why := identity_mismatch(context, ev.node_id)):
                            events.append(Refused("PERMISSION_DENIED", why))
                            break
                refused = next((e for e in events if isinstance(e, Refused)), None)
                if refused is not None:
                    slog.warning("xds stream refused", node=proto.node_id, reason=refused.message)
                    await context.abort(getattr(grpc.StatusCode, refused.code), refused.message)
                    break
                if events:
                    await self._handle_events(context, conn, events, slog)
                if closed:
                    break
        except grpc.aio.AioRpcError:
            pass  # the peer went away mid-write
        finally:
            self.cache.unsubscribe(wake.set)
            reader.cancel()
            gauge.dec()
            self.registry.streams.pop(conn.stream_id, None)
            if conn.identified:
                self.registry.closed(proto.node_id)
            if conn.nacks:  # only then can the count change; keeps mass disconnects O(N)
                self._refresh_nacked()
            slog.info("xds stream closed", node=proto.node_id)

    async def _handle_events(
        self,
        context: grpc.aio.ServicerContext,
        conn: ConnectedStream,
        events: list[Event],
        slog: Any,
    ) -> None:
        nack_changed = False
        for ev in events:
            if isinstance(ev, Send):
                started = time.perf_counter()
                await context.write(ev.payload)
                t = type_label(ev.type_url)
                conn.sent[ev.type_url] = conn.sent.get(ev.type_url, 0) + 1
                m = self._push_metrics(t, conn.transport)
                m.duration.observe(time.perf_counter() - started)
                m.pushes.inc()
                m.bytes.inc(len(ev.payload))
                slog.debug(
                    "xds push",
                    type=t,
                    version=ev.version,
                    nonce=ev.nonce,
                    resources=len(ev.names),
                    removed=len(ev.removed),
                )
            elif isinstance(ev, Ack):
                t = type_label(ev.type_url)
                m = self._push_metrics(t, conn.transport)
                m.acks.inc()
                m.convergence.observe(ev.latency_s)
                ts = conn.protocol.types.get(ev.type_url)
                still_refused = ts is not None and ts.last_nacked  # it took this, not what it refused
                if not still_refused and conn.nacks.pop(ev.type_url, None) is not None:
                    nack_changed = True
                slog.debug("xds ack", type=t, version=ev.version, node=conn.protocol.node_id)
            elif isinstance(ev, Nack):
                t = type_label(ev.type_url)
                self.metrics.nacks.labels(t).inc()
                conn.nacks[ev.type_url] = ev.message
                nack_changed = True
                slog.warning(
                    "xds nack: proxy rejected config and keeps its previous one; not re-sending",
                    type=t,
                    version=ev.version,
                    node=conn.protocol.node_id,
                    rejected=list(ev.rejected),
                    error=ev.message,
                )
            elif isinstance(ev, NackCleared):
                if conn.nacks.pop(ev.type_url, None) is not None:
                    nack_changed = True
            elif isinstance(ev, StaleNonce):
                self.metrics.stale_nonces.labels(type_label(ev.type_url)).inc()
            elif isinstance(ev, NodeIdentified):
                if not conn.identified:
                    conn.identified = True
                    self.registry.identified(ev.node_id)
                conn.cluster = ev.cluster
                conn.user_agent = ev.user_agent
                caps = conn.protocol.capabilities
                slog.info(
                    "xds node",
                    node=ev.node_id,
                    cluster=ev.cluster,
                    user_agent=ev.user_agent,
                    version=caps.version,
                )
                for note in caps.notes():
                    slog.warning("xds proxy lacks a feature; it gets a fallback", node=ev.node_id, note=note)
            elif isinstance(ev, UnknownType):
                slog.warning("xds request for a type this server does not serve", type_url=ev.type_url)
        if nack_changed:
            self._refresh_nacked()

    def _push_metrics(self, t: str, transport: str) -> _TypeMetrics:
        # Label lookups cost more than the increments; resolve each combination once.
        key = (t, transport)
        m = self._metric_children.get(key)
        if m is None:
            m = self._metric_children[key] = _TypeMetrics(
                pushes=self.metrics.pushes.labels(t, transport),
                bytes=self.metrics.push_bytes.labels(t, transport),
                duration=self.metrics.push_duration.labels(t),
                acks=self.metrics.acks.labels(t),
                convergence=self.metrics.convergence.labels(t),
            )
        return m

    def _refresh_nacked(self) -> None:
        for type_url in TYPE_URLS:
            count = sum(1 for s in self.registry.streams.values() if type_url in s.nacks)
            self.metrics.proxies_nacked.labels(type_label(type_url)).set(count)


@dataclass(frozen=True)
class _TypeMetrics:
    pushes: Any
    bytes: Any
    duration: Any
    acks: Any
    convergence: Any


def _identity(payload: bytes) -> bytes:
    return payload


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
