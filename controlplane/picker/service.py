"""The picker process (thin I/O shell around picker/choose.py): an ext_proc server Envoy asks
per request, and an ADS client of the control plane that keeps what it may pick from.

- **What it may pick from** comes from the control plane over ADS, as an Envoy gets it: every
  cluster (CDS wildcard), then every cluster's assignment (EDS). Held-out and draining
  servers arrive as such and are never picked. Disconnected, it keeps the last assignments
  and reconnects with back-off; before the first, it picks nothing (Envoy routes by weights).
- **Per request** (ext_proc, request headers only): the cluster the route chose (the
  `xds.cluster_name` attribute) names the servers; the best by choose.rank is sent back as
  the `x-gateway-destination-endpoint` header and the same value under the `envoy.lb`
  metadata (the Endpoint Picker Protocol's names), followed by up to two fallbacks for
  Envoy's retries. The request counts in flight on its server until Envoy closes the
  processing stream, which Envoy 1.40 does as soon as it has the pick (headers only), not when
  the request ends (tests/integration/test_picker.py). So the load it ranks by comes from the
  servers' own pages instead: with --admin and --token-file it reads every endpoint's
  running, waiting and capacity from the control plane's operator API (what `cpctl endpoints
  list` shows) every --loads-interval, and counts its picks since each reading on top
  (choose.py). Without them, or while that API does not answer (a reading ages out after 5 s),
  it ranks by the EDS weights and its own picks.
- Anything it cannot pick for (no cluster attribute, a cluster it does not know, no eligible
  server, not yet fed) gets an answer that changes nothing: the cluster's weights route it.
- gRPC health: SERVING once the first assignments arrived (readiness); the server answering
  at all is liveness. Metrics on --metrics-listen (docs/metrics.md#picker).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
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
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from controlplane.obs.http import split_host_port
from controlplane.picker.choose import PickerState, ServerLoad
from controlplane.routing.names import PICKED_HEADER, PICKED_METADATA_NS
from controlplane.routing.translate import CLUSTER, ENDPOINT
from controlplane.v1 import endpoint_pb2 as admin_endpoint_pb2
from controlplane.v1 import endpoint_pb2_grpc

log = structlog.get_logger("controlplane.picker")

CLUSTER_ATTRIBUTE = "xds.cluster_name"
NODE_CLUSTER = "controlplane-picker"
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class PickerMetrics:
    """The picker's own metrics, in a registry of its own (served on --metrics-listen)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.picks = Counter(
            "controlplane_picker_picks",
            "Requests the picker answered, by outcome: picked (a server named), and the reasons "
            "it named none (Envoy then routes by the weights): no_cluster, unknown_cluster, "
            "no_eligible_server, not_ready",
            ["outcome"],
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
    ) -> None:
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
        picked: str | None = None
        try:
            async for req in request_iterator:
                if req.HasField("request_headers"):
                    t0 = time.perf_counter()
                    resp, picked = self._answer(req)
                    self.metrics.decision.observe(time.perf_counter() - t0)
                    yield resp
                else:  # a phase not asked for (a newer Envoy's mode override): change nothing
                    yield _unchanged(req)
        finally:
            if picked is not None:  # Envoy closed the stream: it has the pick (see above)
                self.state.done(picked)
                self.metrics.inflight.dec()

    def _answer(self, req: ep.ProcessingRequest) -> tuple[ep.ProcessingResponse, str | None]:
        resp = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        cluster = _attribute(req, CLUSTER_ATTRIBUTE)
        if not self.ready.is_set():
            outcome = "not_ready"
        elif not cluster:
            outcome = "no_cluster"
        elif cluster not in self.state.clusters:
            outcome = "unknown_cluster"
        else:
            chosen = self.state.pick(cluster, time.monotonic())
            if not chosen:
                outcome = "no_eligible_server"
            else:
                value = ",".join(chosen)
                mutation = resp.request_headers.response.header_mutation
                mutation.set_headers.add(
                    header=base_pb2.HeaderValue(key=PICKED_HEADER, raw_value=value.encode()),
                    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                )
                resp.dynamic_metadata.fields[PICKED_METADATA_NS].struct_value.fields[
                    PICKED_HEADER
                ].string_value = value
                self.metrics.picks.labels("picked").inc()
                self.metrics.inflight.inc()
                log.debug(
                    "picker.pick", request_id=_header(req, "x-request-id"), cluster=cluster, picked=value
                )
                return resp, chosen[0]
        self.metrics.picks.labels(outcome).inc()
        return resp, None

    # ---- the control plane ------------------------------------------------------------------

    async def follow_loads(self) -> None:
        """Read every endpoint's load from the operator API, every loads_interval_s, for ever."""
        assert self.admin is not None
        md = [("authorization", f"Bearer {self.token}"), ("x-cpctl-user", self.node_id)]
        failing = False
        async with grpc.aio.insecure_channel(self.admin) as channel:
            stub = endpoint_pb2_grpc.EndpointServiceStub(channel)
            while True:
                try:
                    resp = await stub.List(
                        admin_endpoint_pb2.ListEndpointsRequest(), metadata=md, timeout=1.0
                    )
                except grpc.RpcError as e:
                    self.metrics.load_reads.labels("error").inc()
                    if not failing:  # once per outage, not every interval
                        log.warning(
                            "picker.loads_unread", admin=self.admin, error=str(e.details() or e.code())
                        )
                    failing = True
                else:
                    self.metrics.load_reads.labels("ok").inc()
                    failing = False
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
                log.warning("picker.control_plane_stream_ended", error=str(e).splitlines()[0][:300])
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
                    log.info("picker.ready", clusters=len(self.state.clusters))


def server_loads(endpoints: Iterable[Any], now: float) -> dict[str, ServerLoad]:
    """The operator API's endpoints as loads: running + waiting where the page gave either
    (unknown is left out, not zero), read `signal_age_seconds` before `now`."""
    out = {}
    for e in endpoints:
        if not (e.HasField("running") or e.HasField("waiting")) or not math.isfinite(e.signal_age_seconds):
            continue
        queued = (e.running if e.HasField("running") else 0.0) + (e.waiting if e.HasField("waiting") else 0.0)
        out[e.address] = ServerLoad(queued, now - e.signal_age_seconds, e.capacity or None)
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
    )
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health_pb2_grpc.add_HealthServicer_to_server(picker.health, server)
    await picker.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await picker.health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    status = None
    if metrics_listen:
        host, port = split_host_port(metrics_listen)
        status, _ = start_http_server(port, host, registry=metrics.registry)
    log.info("picker.listening", listen=listen, control_plane=control_plane, metrics=metrics_listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(picker.follow())]
    if admin is not None:
        tasks.append(asyncio.create_task(picker.follow_loads()))
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.stop(1.0)
        if status is not None:
            status.shutdown()
