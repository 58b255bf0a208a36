"""The picker process (thin I/O shell around picker/choose.py): an ext_proc server Envoy asks
per request, and an ADS client of the control plane that keeps what it may pick from.

- **What it may pick from** comes from the control plane over ADS, as an Envoy gets it: every
  cluster (CDS wildcard), then every cluster's assignment (EDS). Held-out and draining
  servers arrive as such and are never picked. Disconnected, it keeps the last assignments
  and reconnects with back-off; before the first, it picks nothing (Envoy routes by weights).
- **Per request** (ext_proc, request headers, then response headers; never a body): the
  cluster the route chose (the `xds.cluster_name` attribute) names the servers, the
  request's prefix key (the gateway's `controlplane.affinity_prefix` metadata) and subset
  hint narrow them; the best by choose.PickerState.pick is sent back as the
  `x-gateway-destination-endpoint` header and the same value under the `envoy.lb` metadata
  (the Endpoint Picker Protocol's names), followed by up to two fallbacks for Envoy's
  retries. The request counts in flight on its server until its response's headers come
  back (with `upstream.address`: where it really went) or the stream ends: for a response
  that is not streamed, its end; for a stream, its first token, after which the server's
  page shows it (choose.py).
- **The servers' pages**: with --admin and --token-file it reads every endpoint's running,
  waiting, KV use and capacity from the control plane's operator API (what `cpctl endpoints
  list` shows) every --loads-interval. Without them, or while that API does not answer (a
  reading ages out after 5 s), it ranks by its own requests in flight and the EDS weights.
- Anything it cannot pick for (no cluster attribute, a cluster it does not know, no eligible
  server, not yet fed) gets an answer that changes nothing: the cluster's weights route it.
- **The other pickers** (--peers): each serves its own requests in flight per server (JSON,
  PEER_SERVICE on its --listen) and reads its peers' every --peers-interval, so several
  pickers rank by every picker's requests, not each by its own (choose.py).
- gRPC health: SERVING once the first assignments arrived (readiness); the server answering
  at all is liveness. Metrics on --metrics-listen (docs/metrics.md#picker).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import structlog
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controlplane.obs.outage import Outage
from controlplane.picker.choose import PREFIX_ENTRIES, PREFIX_LOAD_BOUND, PickerState, ServerLoad
from controlplane.process.side_service import serve_until_signalled
from controlplane.resources.names import METADATA_NS, PICKED_HEADER, PICKED_METADATA_NS, SUBSET_METADATA_NS
from controlplane.resources.types import CLUSTER, ENDPOINT
from controlplane.v1 import endpoint_pb2 as admin_endpoint_pb2
from controlplane.v1 import endpoint_pb2_grpc

log = structlog.get_logger("controlplane.picker")

CLUSTER_ATTRIBUTE = "xds.cluster_name"
SERVED_ATTRIBUTE = "upstream.address"  # sent with the response headers: where the request went
PREFIX_KEY = "affinity_prefix"  # the prefix key the gateway's Lua filter sets (routing/prefix_key.lua)
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
NODE_CLUSTER = "controlplane-picker"
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Pickers read each other's requests in flight here, on the same --listen (JSON in and out).
PEER_SERVICE = "controlplane.picker.v1.Peers"


class PickerMetrics:
    """The picker's own metrics, in a registry of its own (served on --metrics-listen)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.picks = Counter(
            "controlplane_picker_picks",
            "Requests the picker answered, by reason: least_loaded or prefix_hit (a server "
            "named), else why it named none and Envoy routes by the weights (no_cluster, "
            "unknown_cluster, no_eligible_server, not_ready)",
            ["reason"],
            registry=r,
        )
        self.served = Counter(
            "controlplane_picker_served",
            "Picked requests by where Envoy says they went (the served-endpoint readback): "
            "picked (the first server named), fallback_list (a later one, on a retry), "
            "elsewhere (the weights: the named servers were not healthy in Envoy's view), "
            "unknown (the stream ended before a response)",
            ["where"],
            registry=r,
        )
        self.decision = Histogram(
            "controlplane_picker_decision_seconds",
            "Time from a request's headers arriving to the pick being sent",
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025),
            registry=r,
        )
        self.inflight = Gauge(
            "controlplane_picker_inflight_requests", "Requests picked and not yet ended", registry=r
        )
        self.clusters = Gauge(
            "controlplane_picker_clusters",
            "Clusters in the last assignments from the control plane",
            registry=r,
        )
        self.connected = Gauge(
            "controlplane_picker_control_plane_connected",
            "1 while the ADS stream to the control plane is up",
            registry=r,
        )
        self.peer_reads = Counter(
            "controlplane_picker_peer_reads",
            "Reads of the other pickers' requests in flight (--peers), by result (ok, error)",
            ["result"],
            registry=r,
        )
        self.load_reads = Counter(
            "controlplane_picker_load_reads",
            "Reads of the servers' loads from the control plane's operator API, by result (ok, error)",
            ["result"],
            registry=r,
        )
        self.updates = Counter(
            "controlplane_picker_assignment_updates",
            "Assignment sets received from the control plane",
            registry=r,
        )


class Picker(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ext_proc servicer and the ADS client that feeds it, on one event loop."""

    def __init__(
        self,
        control_plane: str,
        node_id: str,
        metrics: PickerMetrics | None = None,
        *,
        admin: str | None = None,
        token: str | None = None,
        loads_interval_s: float = 0.25,
        peers_interval_s: float = 0.05,
    ) -> None:
        self.peers_interval_s = peers_interval_s
        self.control_plane = control_plane
        self.node_id = node_id
        self.admin = admin
        self.token = token
        self.loads_interval_s = loads_interval_s
        self.metrics = metrics or PickerMetrics()
        self.state = PickerState()
        self.ready = asyncio.Event()
        self.health = health.aio.HealthServicer()

    # ---- ext_proc ---------------------------------------------------------------------------

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        picked: tuple[str, ...] = ()
        try:
            async for req in request_iterator:
                if req.HasField("request_headers"):
                    t0 = time.perf_counter()
                    resp, picked = self._answer(req)
                    self.metrics.decision.observe(time.perf_counter() - t0)
                    yield resp
                elif req.HasField("response_headers"):
                    if picked:  # the request ended, or its response started: it is no more ours
                        self._served(picked, _attribute(req, SERVED_ATTRIBUTE))
                        picked = ()
                    yield _unchanged(req)
                else:  # a phase not asked for (a newer Envoy's mode override): change nothing
                    yield _unchanged(req)
        finally:
            if picked:  # the stream closed before a response (a reset, a cancel, a timeout)
                self._served(picked, "")

    def _served(self, picked: tuple[str, ...], served: str) -> None:
        """The request picked for `picked` answered from `served` (the upstream.address Envoy
        reports: the Endpoint Picker Protocol's served-endpoint readback), "" if unknown."""
        self.state.done(picked[0], time.monotonic())
        self.metrics.inflight.dec()
        if not served:
            where = "unknown"
        elif served == picked[0]:
            where = "picked"
        elif served in picked:
            where = "fallback_list"
        else:
            where = "elsewhere"
        self.metrics.served.labels(where).inc()

    def _answer(self, req: ep.ProcessingRequest) -> tuple[ep.ProcessingResponse, tuple[str, ...]]:
        resp = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        cluster = _attribute(req, CLUSTER_ATTRIBUTE)
        if not self.ready.is_set():
            reason = "not_ready"
        elif not cluster:
            reason = "no_cluster"
        elif cluster not in self.state.clusters:
            reason = "unknown_cluster"
        else:
            chosen = self.state.pick(
                cluster, time.monotonic(), prefix=_metadata(req, METADATA_NS, PREFIX_KEY), subset=_subset(req)
            )
            reason = chosen.reason or "no_eligible_server"
            if chosen.servers:
                value = ",".join(chosen.servers)
                mutation = resp.request_headers.response.header_mutation
                mutation.set_headers.add(
                    header=base_pb2.HeaderValue(key=PICKED_HEADER, raw_value=value.encode()),
                    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                )
                resp.dynamic_metadata.fields[PICKED_METADATA_NS].struct_value.fields[
                    PICKED_HEADER
                ].string_value = value
                self.metrics.picks.labels(reason).inc()
                self.metrics.inflight.inc()
                log.debug(
                    "request picked",
                    request_id=_header(req, "x-request-id"),
                    cluster=cluster,
                    picked=value,
                    reason=reason,
                )
                return resp, chosen.servers
        self.metrics.picks.labels(reason).inc()
        return resp, ()

    # ---- the other pickers -------------------------------------------------------------------

    async def _inflight(self, request: bytes, context: Any) -> bytes:
        """PEER_METHOD: this picker's own requests in flight per server, as JSON."""
        return json.dumps(self.state.inflight).encode()

    def peer_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            PEER_SERVICE, {"InFlight": grpc.unary_unary_rpc_method_handler(self._inflight)}
        )

    async def follow_peer(self, peer: str) -> None:
        """Read another picker's requests in flight every peers_interval_s, for ever."""
        outage = Outage(log, "a peer's requests in flight unread", error_chars=300)
        async with grpc.aio.insecure_channel(peer) as channel:
            call = channel.unary_unary(f"/{PEER_SERVICE}/InFlight")
            while True:
                try:
                    raw = await call(b"", timeout=1.0)
                    counts = json.loads(raw)
                    if not isinstance(counts, dict):
                        raise ValueError("not a JSON object")
                    clean = {str(k): int(v) for k, v in counts.items() if isinstance(v, int) and v > 0}
                except (grpc.RpcError, ValueError, TypeError) as e:
                    self.metrics.peer_reads.labels("error").inc()
                    outage.failed(e, peer=peer)
                else:
                    self.metrics.peer_reads.labels("ok").inc()
                    outage.ok()
                    self.state.observe_peer(peer, clean, time.monotonic())
                await asyncio.sleep(self.peers_interval_s)

    # ---- the control plane ------------------------------------------------------------------

    async def follow_loads(self) -> None:
        """Read every endpoint's load from the operator API, every loads_interval_s, for ever."""
        assert self.admin is not None
        md = [("authorization", f"Bearer {self.token}"), ("x-cpctl-user", self.node_id)]
        # Logged once per outage, not every interval.
        outage = Outage(log, "the servers' loads unread from the control plane")
        async with grpc.aio.insecure_channel(self.admin) as channel:
            stub = endpoint_pb2_grpc.EndpointServiceStub(channel)
            while True:
                try:
                    resp = await stub.List(
                        admin_endpoint_pb2.ListEndpointsRequest(), metadata=md, timeout=1.0
                    )
                except grpc.RpcError as e:
                    self.metrics.load_reads.labels("error").inc()
                    outage.failed(e.details() or e.code(), admin=self.admin)
                else:
                    self.metrics.load_reads.labels("ok").inc()
                    outage.ok()
                    self.state.observe(server_loads(resp.endpoints, time.monotonic()))
                await asyncio.sleep(self.loads_interval_s)

    async def follow(self) -> None:
        """Keep an ADS stream to the control plane up, for ever; apply what it sends."""
        backoff = RECONNECT_MIN_S
        while True:
            started = time.monotonic()
            try:
                async with grpc.aio.insecure_channel(self.control_plane) as channel:
                    await self._stream(ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("control plane stream ended; reconnecting", error=str(e).splitlines()[0][:300])
            finally:
                self.metrics.connected.set(0)
            if time.monotonic() - started > 10 * RECONNECT_MAX_S:
                backoff = RECONNECT_MIN_S
            await asyncio.sleep(backoff)
            backoff = min(RECONNECT_MAX_S, backoff * 2)

    async def _stream(self, stub: ads_pb2_grpc.AggregatedDiscoveryServiceStub) -> None:
        node = base_pb2.Node(id=self.node_id, cluster=NODE_CLUSTER)
        out: asyncio.Queue[discovery_pb2.DiscoveryRequest] = asyncio.Queue()

        async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
            while True:
                yield await out.get()

        await out.put(discovery_pb2.DiscoveryRequest(node=node, type_url=CLUSTER))
        eds_names: list[str] = []
        eds_ack = ("", "")  # the last EDS version and nonce, sent with every EDS request
        call = stub.StreamAggregatedResources(requests())
        async for resp in call:
            self.metrics.connected.set(1)
            if resp.type_url == CLUSTER:
                names = sorted(
                    c.eds_cluster_config.service_name or c.name
                    for c in (_unpack(a, cluster_pb2.Cluster) for a in resp.resources)
                    if c.type == cluster_pb2.Cluster.EDS
                )
                await out.put(
                    discovery_pb2.DiscoveryRequest(
                        node=node, type_url=CLUSTER, version_info=resp.version_info, response_nonce=resp.nonce
                    )
                )
                if names != eds_names:
                    eds_names = names
                    await out.put(
                        discovery_pb2.DiscoveryRequest(
                            node=node,
                            type_url=ENDPOINT,
                            resource_names=eds_names,
                            version_info=eds_ack[0],
                            response_nonce=eds_ack[1],
                        )
                    )
            elif resp.type_url == ENDPOINT:
                assignments = [_unpack(a, endpoint_pb2.ClusterLoadAssignment) for a in resp.resources]
                self.state.assign(assignments)
                self.metrics.clusters.set(len(self.state.clusters))
                self.metrics.updates.inc()
                eds_ack = (resp.version_info, resp.nonce)
                await out.put(
                    discovery_pb2.DiscoveryRequest(
                        node=node,
                        type_url=ENDPOINT,
                        resource_names=eds_names,
                        version_info=resp.version_info,
                        response_nonce=resp.nonce,
                    )
                )
                if not self.ready.is_set():
                    self.ready.set()
                    await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
                    await self.health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
                    log.info("picker ready", clusters=len(self.state.clusters))


def server_loads(endpoints: Iterable[Any], now: float) -> dict[str, ServerLoad]:
    """The operator API's endpoints as loads: running + waiting where the page gave either
    (unknown is left out, not zero), read `signal_age_seconds` before `now`."""
    out = {}
    for e in endpoints:
        if not (e.HasField("running") or e.HasField("waiting")) or not math.isfinite(e.signal_age_seconds):
            continue
        running = e.running if e.HasField("running") else None
        waiting = e.waiting if e.HasField("waiting") else None
        out[e.address] = ServerLoad(
            (running or 0.0) + (waiting or 0.0),
            now - e.signal_age_seconds,
            e.capacity or None,
            running=running,
            waiting=waiting,
            kv_use=e.kv_use if e.HasField("kv_use") else None,
        )
    return out


def _attribute(req: ep.ProcessingRequest, key: str) -> str:
    """An attribute Envoy sent with the request (keyed by the filter's name), "" if none."""
    for attrs in req.attributes.values():
        value = attrs.fields.get(key)
        if value is not None and value.HasField("string_value"):
            return str(value.string_value)
    headers = req.request_headers
    for attr in getattr(headers, "attributes", {}).values():  # older Envoys put them here
        value = attr.fields.get(key)
        if value is not None and value.HasField("string_value"):
            return str(value.string_value)
    return ""


def _metadata(req: ep.ProcessingRequest, namespace: str, key: str) -> str:
    """A string Envoy forwarded from the request's dynamic metadata, "" if none."""
    ns = req.metadata_context.filter_metadata.get(namespace)
    if ns is None:
        return ""
    value = ns.fields.get(key)
    return str(value.string_value) if value is not None and value.HasField("string_value") else ""


def _subset(req: ep.ProcessingRequest) -> frozenset[str] | None:
    """The Endpoint Picker Protocol's subset hint: the servers the request may go to, from the
    `envoy.lb.subset_hint` metadata (a list, or a comma-separated string) or the
    x-gateway-destination-endpoint-subset header; None when the request names none."""
    found: list[str] = []
    ns = req.metadata_context.filter_metadata.get(SUBSET_METADATA_NS)
    value = ns.fields.get(SUBSET_HEADER) if ns is not None else None
    if value is not None and value.HasField("list_value"):
        found = [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    elif value is not None and value.HasField("string_value"):
        found = value.string_value.split(",")
    else:
        found = _header(req, SUBSET_HEADER).split(",")
    subset = frozenset(a.strip() for a in found if a.strip())
    return subset or None


def _header(req: ep.ProcessingRequest, name: str) -> str:
    """A request header's value, "" if absent."""
    for h in req.request_headers.headers.headers:
        if h.key == name:
            return h.raw_value.decode(errors="replace") if h.raw_value else str(h.value)
    return ""


def _unchanged(req: ep.ProcessingRequest) -> ep.ProcessingResponse:
    """The answer to a phase the picker does not act on: continue as is."""
    phase = req.WhichOneof("request")
    if phase in ("request_headers", "response_headers"):
        return ep.ProcessingResponse(**{phase: ep.HeadersResponse()})
    if phase in ("request_body", "response_body"):
        return ep.ProcessingResponse(**{phase: ep.BodyResponse()})
    if phase in ("request_trailers", "response_trailers"):
        return ep.ProcessingResponse(**{phase: ep.TrailersResponse()})
    return ep.ProcessingResponse()


def _unpack(a: Any, cls: type[Any]) -> Any:
    msg = cls()
    a.Unpack(msg)
    return msg


async def serve(
    control_plane: str,
    listen: str,
    metrics_listen: str | None = None,
    node_id: str | None = None,
    *,
    admin: str | None = None,
    token: str | None = None,
    loads_interval_s: float = 0.25,
    prefix_entries: int = PREFIX_ENTRIES,
    prefix_bound: float = PREFIX_LOAD_BOUND,
    peers: Iterable[str] = (),
    peers_interval_s: float = 0.05,
) -> None:
    """Run a picker until SIGINT or SIGTERM."""
    metrics = PickerMetrics()
    picker = Picker(
        control_plane,
        node_id or f"picker-{os.getpid()}",
        metrics,
        admin=admin,
        token=token,
        loads_interval_s=loads_interval_s,
        peers_interval_s=peers_interval_s,
    )
    picker.state.prefix_entries = prefix_entries
    picker.state.prefix_bound = prefix_bound
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health_pb2_grpc.add_HealthServicer_to_server(picker.health, server)
    server.add_generic_rpc_handlers((picker.peer_handler(),))
    await picker.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await picker.health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    background = [picker.follow()]
    if admin is not None:
        background.append(picker.follow_loads())
    background += [picker.follow_peer(peer) for peer in peers]
    await serve_until_signalled(
        server,
        listen,
        metrics_listen,
        metrics.registry,
        background,
        lambda: log.info(
            "picker listening", listen=listen, control_plane=control_plane, metrics=metrics_listen
        ),
    )
