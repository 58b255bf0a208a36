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
- **The other pickers** (--peers): each serves its own requests in flight per server
  (controlplane.v1.PickerPeers, protos/controlplane/v1/picker.proto, on its --listen) and
  reads its peers' every --peers-interval, so several pickers rank by every picker's
  requests, not each by its own (choose.py). Only a peer with a client certificate (mutual
  TLS) or the shared token (--peer-token-file) is answered, and a peer's answer is checked
  (choose.PickerState.observe_peer) before it counts.
- **One stream, one request**: Envoy opens an ext_proc stream per request. A second
  request-headers message on a stream is refused (the stream ends, INVALID_ARGUMENT), and
  its pick ends with it: nothing a client sends can leave a request counted in flight after
  its stream closed.
- **Asked only about requests that go to a server**: the filter sends no response headers
  by default (Envoy would send those of a local reply, a quota's 429, to a picker never
  asked about the request); a pick asks for them (`mode_override`), so the picker sees the
  end of the requests it picked, and of no others.
- Every input has a bound (request.py, limits.py); one past it gets no pick, counted.
- gRPC health: SERVING once the first assignments arrived (readiness); the server answering
  at all is liveness. Metrics on --metrics-listen (docs/metrics.md#picker).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from itertools import islice
from typing import Any, TypeVar

import grpc
import structlog
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controlplane import limits
from controlplane.kvcache.blocks import prompt_keys
from controlplane.kvcache.index import MAX_BLOCKS
from controlplane.kvcache.mirror import KvMirror
from controlplane.kvcache.prompt import PromptError, Tokenizers, token_ids
from controlplane.net.tls import SIDE_FLAGS, ServerTls, client_credentials, server_credentials
from controlplane.obs.outage import Outage
from controlplane.picker.adapters import AdapterConfigError, ClusterAdapters, read_adapter_config
from controlplane.picker.choose import PREFIX_ENTRIES, PREFIX_LOAD_BOUND, KvAsk, Pick, PickerState, ServerLoad
from controlplane.picker.flow import (
    BYTES_PER_TOKEN,
    DEFAULT_TOKENS,
    RELEASED,
    SHED_FULL,
    SHED_TIMEOUT,
    ClusterFlow,
    FlowConfigError,
    Flows,
    Held,
    read_config,
    tenant_key,
)
from controlplane.picker.kv_events import KvMetrics, KvSubscriptions
from controlplane.picker.kv_process import CPU_SHARE, Deciding, KvProcess, KvProcessMetrics
from controlplane.picker.placement import IDLE_UNLOAD_S, LoadFailed, Placer
from controlplane.picker.request import (
    INPUTS,
    SERVED_ATTRIBUTE,
    Ask,
    Refused,
    attribute,
    header_bytes,
    map_header_bytes,
    metadata_string,
    read_ask,
)
from controlplane.process.side_service import serve_until_signalled
from controlplane.resources.names import (
    ADAPTERS_METADATA_NS,
    FLOW_METADATA_NS,
    KV_METADATA_NS,
    PICKED_HEADER,
    PICKED_METADATA_NS,
)
from controlplane.resources.types import CLUSTER, ENDPOINT
from controlplane.routing.translate import (
    ADAPTER_LOAD_WAIT_S,
    FLOW_PICKED_MODE,
    PICKED_MODE,
    PRIORITY_HEADER,
)
from controlplane.v1 import endpoint_pb2 as admin_endpoint_pb2
from controlplane.v1 import endpoint_pb2_grpc, picker_pb2, picker_pb2_grpc

log = structlog.get_logger("controlplane.picker")
T = TypeVar("T")

NODE_CLUSTER = "controlplane-picker"
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Pickers read each other's requests in flight here, on the same --listen (protos/).
PEER_SERVICE = "controlplane.v1.PickerPeers"
ERROR_MAX_CHARS = 300  # a peer's or the operator API's error as logged, cut at a word


class PickerMetrics:
    """The picker's own metrics, in a registry of its own (served on --metrics-listen)."""

    def __init__(self, kv_in_process: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.picks = Counter(
            "controlplane_picker_picks",
            "Requests the picker answered, by reason: least_loaded, kv_hit or approximate, or for a "
            "request naming a LoRA adapter adapter_resident, adapter_slot_free or adapter_evict (a "
            "server named), else why it named none and Envoy routes by the weights (no_cluster, "
            "unknown_cluster, no_eligible_server, not_ready, input_refused)",
            ["reason"],
            registry=r,
        )
        self.refused = Counter(
            "controlplane_picker_inputs_refused",
            "Inputs past their bound (docs/picker.md#hostile-input), by input: cluster, "
            "prefix_key, subset_hint (the request gets no pick), second_request_headers (the "
            "stream is refused), peer_credentials (a peer read without a certificate or token)",
            ["input"],
            registry=r,
        )
        for name in (*INPUTS, "second_request_headers", "peer_credentials"):
            self.refused.labels(name)
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
            "Reads of the other pickers' requests in flight (--peers), by result: ok, error "
            "(no answer), refused (an answer past its bounds: not counted)",
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
        # The KV events' own counters: from the index's process (kv_process.py), or this one's.
        self.kv = KvMetrics(r, events=kv_in_process)
        self.kv_process = KvProcessMetrics(r) if not kv_in_process else None
        self.flow_waiting = Gauge(
            "controlplane_picker_flow_waiting",
            "Requests waiting in the picker's queue for a slot (flow_control), by model, priority "
            'class and tenant (a tenant the fleet\'s quotas name, else other; "" for none)',
            ["model", "class", "tenant"],
            registry=r,
        )
        self.flow_top_waiting = Gauge(
            "controlplane_picker_flow_top_class_waiting",
            "Requests of a model's highest priority class waiting in the picker's queue",
            ["model"],
            registry=r,
        )
        self.flow_wait = Histogram(
            "controlplane_picker_flow_wait_seconds",
            "Time a request waited in the picker's queue before its pick, by model, class and tenant",
            ["model", "class", "tenant"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.flow_dispatched = Counter(
            "controlplane_picker_flow_dispatched",
            "Requests that left the picker's queue for a free slot, by model, class and tenant",
            ["model", "class", "tenant"],
            registry=r,
        )
        self.flow_shed = Counter(
            "controlplane_picker_flow_shed",
            "Requests of the queue answered 429, by model, class, tenant and reason: timeout (its "
            "class's longest wait passed), full (the queue's bound: the lowest class and newest "
            "first); and requests whose stream ended while queued (gone: the client went away, "
            "or Envoy stopped waiting for the picker)",
            ["model", "class", "tenant", "reason"],
            registry=r,
        )
        self.slots = Gauge(
            "controlplane_picker_server_slots",
            "A server's slots as the picker learned them (its page's running count while requests "
            "waited there): a server never seen full has none here (flow control counts it free "
            "until its page shows a request waiting)",
            ["server"],
            registry=r,
        )
        self.queue_reports = Counter(
            "controlplane_picker_flow_queue_reports",
            "Reports of this picker's queue lengths to the control plane's operator API (--admin), "
            "demand for its autoscaler, by result: ok, error",
            ["result"],
            registry=r,
        )
        self.flow_config_errors = Counter(
            "controlplane_picker_flow_config_errors",
            "Clusters whose flow control the picker could not read (their requests are picked as without it)",
            registry=r,
        )
        self.adapter_requests = Counter(
            "controlplane_picker_adapter_requests",
            "Requests naming a LoRA adapter the picker answered, by model and adapter (the fleet's names)",
            ["model", "adapter"],
            registry=r,
        )
        self.adapter_loads = Counter(
            "controlplane_picker_adapter_loads",
            "Adapter loads the picker asked a server for (placement: dynamic), by model, adapter and "
            "outcome: loaded, failed (no server it tried could: the request got 503), unloaded (gone "
            "cold: --adapter-idle-unload)",
            ["model", "adapter", "outcome"],
            registry=r,
        )
        self.adapter_evictions = Gauge(
            "controlplane_picker_adapter_evictions",
            "Adapter evictions the picker has seen its servers make since it started: an adapter "
            "entering a server whose max_lora slots were all taken (by the pages and its own requests)",
            registry=r,
        )
        self.adapter_config_errors = Counter(
            "controlplane_picker_adapter_config_errors",
            "Clusters whose adapters the picker could not read (their requests are picked as without them)",
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
        tls: ServerTls | None = None,
        peer_token: str | None = None,
        peer_server_name: str | None = None,
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
        self.tls = tls  # with a client CA: every caller (Envoy, a peer) has a certificate
        self.peer_token = peer_token
        self.peer_server_name = peer_server_name
        self.tokenizers = Tokenizers()
        self.tokenizer_of: dict[str, str] = {}  # cluster -> its model's tokenizer directory
        self.kv_subs: KvSubscriptions | KvProcess | None = None  # made on the running loop (follow)
        self.kv_cpu = CPU_SHARE  # the index process's CPU, in cores (--kv-index-cpu)
        self.deciding = Deciding()  # picks between headers and answer: the KV mirror waits for them
        self.flows = Flows()  # the queues of clusters with flow control (picker/flow.py)
        self.adapters_of: dict[str, ClusterAdapters] = {}  # cluster -> its model's adapters
        self.placer = Placer()  # adapters this picker loaded (placement: dynamic)
        self._flow_wake = asyncio.Event()  # a slot may have freed: dispatch
        self._flow_labels: set[tuple[str, str, str]] = set()  # flow_waiting's series set so far
        self._slots_shown: set[str] = set()  # servers with a controlplane_picker_server_slots series
        self._tokenizer_outage = Outage(
            log,
            "a tokenizer is unusable: its model's prompts are scored by the approximate index",
            error_chars=300,
        )

    # ---- ext_proc ---------------------------------------------------------------------------

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        picked: tuple[str, ...] = ()
        asked = read_back = deciding = False
        messages = aiter(request_iterator)
        pending: asyncio.Future[ep.ProcessingRequest] | None = None  # the next message, asked for
        try:
            while True:
                nxt, pending = pending or asyncio.ensure_future(anext(messages)), None
                try:
                    req = await nxt
                except StopAsyncIteration:
                    break
                if req.HasField("request_headers"):
                    if asked:  # one stream is one request: Envoy never sends two
                        self.metrics.refused.labels("second_request_headers").inc()
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "a second request_headers message on one stream: each request has "
                            "a stream of its own",
                        )
                    asked = True
                    t0 = time.perf_counter()
                    self.deciding.start()
                    deciding = True
                    ask = read_ask(req)
                    if isinstance(ask, Ask) and ask.model:
                        ask = self._with_adapter(ask)
                        if self._must_place(ask):  # placement: dynamic, and no server has it yet
                            deciding = self._decided(deciding)  # a placement is not a pick's moment
                            yield ep.ProcessingResponse(
                                override_message_timeout=_duration(ADAPTER_LOAD_WAIT_S)
                            )
                            placed = await self._place(ask)
                            if isinstance(placed, ep.ProcessingResponse):
                                yield placed  # no server could load it: a 503 naming the adapter
                                continue
                            resp, picked = self._answer(placed)
                            self.metrics.decision.observe(time.perf_counter() - t0)
                            yield resp
                            continue
                    kv = await self._kv_ask(ask) if isinstance(ask, Ask) and ask.prompt else None
                    flow = self._flow_of(ask)
                    if flow is None or not self._must_wait(ask, flow):  # type: ignore[arg-type]
                        resp, picked = self._answer(ask, kv)
                        self.metrics.decision.observe(time.perf_counter() - t0)
                        yield resp
                        deciding = self._decided(deciding)  # the answer is written
                        continue
                    assert isinstance(ask, Ask)
                    # While it waits, the stream is watched: Envoy ends it when the client goes.
                    pending = asyncio.ensure_future(anext(messages))
                    holding = self._hold(req, ask, kv, flow, pending)
                    first, _ = await holding.__anext__()  # Envoy told to wait (or a 429 at once)
                    self.metrics.decision.observe(time.perf_counter() - t0)
                    yield first
                    deciding = self._decided(deciding)  # it waits its turn: no longer deciding
                    async for resp, got in holding:
                        picked = got
                        yield resp
                elif req.HasField("response_headers"):
                    if picked:  # the request ended, or its response started: it is no more ours
                        served = attribute(req, SERVED_ATTRIBUTE)
                        if isinstance(ask, Ask) and ask.adapter and _status(req) == 404:
                            # The server no longer has the adapter (it restarted since the
                            # picker loaded it there): loaded again for the next request.
                            self.placer.lost(ask.adapter, served or picked[0])
                        if isinstance(ask, Ask) and ask.cluster in self.flows.clusters:
                            self._readback(picked, served)  # in flight until its trailers
                            read_back = True
                        else:
                            self._served(picked, served, adapter=_adapter(ask))
                            picked = ()
                    yield _unchanged(req)
                elif req.HasField("response_trailers"):  # a flow-controlled request's end
                    if picked:
                        self._served(picked, "", readback=not read_back, adapter=_adapter(ask))
                        picked = ()
                    yield _unchanged(req)
                else:  # a phase not asked for (a newer Envoy's mode override): change nothing
                    yield _unchanged(req)
        finally:
            self._decided(deciding)
            if pending is not None and not pending.done():
                pending.cancel()
            elif pending is not None and not pending.cancelled():
                pending.exception()  # the stream's end, seen while it waited: nothing to log
            if picked:  # the stream closed before a response (a reset, a cancel, a timeout), or
                # a flow-controlled request ended (its server's slot is free only now)
                self._served(picked, "", readback=not read_back, adapter=_adapter(ask))

    def _decided(self, deciding: bool) -> bool:
        """A pick's decision ended (if it was one): False, the stream's new `deciding`."""
        if deciding:
            self.deciding.end()
        return False

    def _served(
        self, picked: tuple[str, ...], served: str, *, readback: bool = True, adapter: str = ""
    ) -> None:
        """The request (of `adapter`, if it named one) picked for `picked` answered from
        `served` (the upstream.address Envoy reports: the Endpoint Picker Protocol's
        served-endpoint readback), "" if unknown."""
        self.state.done(picked[0], time.monotonic(), adapter)
        self.metrics.inflight.dec()
        self._flow_wake.set()  # a slot freed: a queued request may go
        if readback:
            self._readback(picked, served)

    def _readback(self, picked: tuple[str, ...], served: str) -> None:
        """Count where the request picked for `picked` went (`served`, "" if unknown)."""
        if not served:
            where = "unknown"
        elif served == picked[0]:
            where = "picked"
        elif served in picked:
            where = "fallback_list"
        else:
            where = "elsewhere"
        self.metrics.served.labels(where).inc()

    # ---- flow control (picker/flow.py) ------------------------------------------------------

    def _flow_of(self, ask: Ask | Refused) -> ClusterFlow | None:
        """The queue a request may wait in: its cluster's, if it has one (and the picker is
        fed). A request that may go only to some servers (a subset hint, an adapter on some
        servers only) waits for a slot on one of them."""
        if isinstance(ask, Refused) or not self.ready.is_set():
            return None
        return self.flows.clusters.get(ask.cluster)

    def _must_wait(self, ask: Ask, flow: ClusterFlow) -> bool:
        """Others wait already (a newcomer goes behind them), or no server it may go to has a
        slot free."""
        return bool(len(flow.queue)) or not self.state.free_slot(ask.cluster, time.monotonic(), ask.subset)

    async def _hold(
        self,
        req: ep.ProcessingRequest,
        ask: Ask,
        kv: KvAsk | None,
        flow: ClusterFlow,
        stream: asyncio.Future[ep.ProcessingRequest],
    ) -> AsyncIterator[tuple[ep.ProcessingResponse, tuple[str, ...]]]:
        """Queue the request: first tell Envoy to wait for up to its class's longest wait
        (override_message_timeout), then its pick (with the servers picked, counted in flight),
        or a 429. A request shed at once gets only its 429. `stream`: the stream's next
        message, asked for; if it comes (or the stream ends) while the request waits, its
        client went away: the request leaves the queue, unanswered."""
        now = time.monotonic()
        cfg = flow.config
        rank = cfg.rank(header_bytes(req, PRIORITY_HEADER).decode(errors="replace"))
        tenant = tenant_key(header_bytes(req, cfg.tenant_header))
        size = _content_length(req)
        tokens = kv.tokens if kv is not None else (size // BYTES_PER_TOKEN if size else DEFAULT_TOKENS)
        held = Held(
            asyncio.get_running_loop().create_future(), ask, kv, flow.label(tenant), cfg.classes[rank], now
        )
        id, shed = self.flows.enqueue(
            ask.cluster, held, rank=rank, tenant=tenant, now=now, size=size, tokens=tokens
        )
        for other, why in shed:
            if other is not held and not other.future.done():
                other.future.set_result(why)
        self._refresh_flow_gauges()
        if any(other is held for other, _ in shed):
            self._count_shed(ask.cluster, held, SHED_FULL)
            yield self._too_many(ask.cluster, held, SHED_FULL, cfg.max_wait_s[rank]), ()
            return
        wait = cfg.max_wait_s[rank]  # Envoy waits this long at most: a hung picker costs no more
        timeout = duration_pb2.Duration(seconds=int(wait), nanos=int(wait % 1 * 1e9))
        yield ep.ProcessingResponse(override_message_timeout=timeout), ()
        answered = False
        try:
            await asyncio.wait((held.future, stream), return_when=asyncio.FIRST_COMPLETED)
            if not held.future.done():
                return  # the stream ended while it waited: its client went away (finally)
            outcome = held.future.result()
            resp = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
            picked: tuple[str, ...] = ()
            if isinstance(outcome, Pick) and outcome.servers:
                self._name(resp, ask, outcome.servers, outcome.reason)
                picked = outcome.servers
            elif isinstance(outcome, Pick):
                self.metrics.picks.labels("no_eligible_server").inc()
            elif outcome == RELEASED:  # its cluster's queue is gone: picked as without one
                resp, picked = self._answer(ask, kv)
            else:
                self._count_shed(ask.cluster, held, str(outcome))
                resp = self._too_many(ask.cluster, held, str(outcome), cfg.max_wait_s[rank])
            answered = True
            yield resp, picked
        finally:
            if not held.future.done():  # its client went away while it waited
                held.future.cancel()
                self.flows.remove(ask.cluster, id)
                self._count_shed(ask.cluster, held, "gone")
                self._refresh_flow_gauges()
            elif not answered:  # picked as its stream closed: not in flight after all
                outcome = held.future.result()
                if isinstance(outcome, Pick) and outcome.servers:
                    self.state.done(outcome.servers[0], time.monotonic(), ask.adapter)
                    self._flow_wake.set()

    def _count_shed(self, cluster: str, held: Held, reason: str) -> None:
        self.metrics.flow_shed.labels(_model_of(cluster), held.klass, held.tenant_label, reason).inc()

    def _too_many(self, cluster: str, held: Held, reason: str, max_wait: float) -> ep.ProcessingResponse:
        """The 429 a queued request gets, with Retry-After and OpenAI's error body (as the
        quotas' 429: its SDK raises RateLimitError)."""
        model = _model_of(cluster)
        if reason == SHED_TIMEOUT:
            message = (
                f"Model {model} is at capacity: no server was free within this request's priority "
                f"class's longest wait ({max_wait:g}s). Please try again after the Retry-After delay."
            )
        else:
            message = (
                f"Model {model} is at capacity and its queue is full: this request was shed to make "
                "room for higher-priority or earlier ones. Please try again after the Retry-After delay."
            )
        body = json.dumps(
            {"error": {"message": message, "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
        )
        retry = str(max(1, math.ceil(min(max_wait, 60.0) / 2)))
        resp = ep.ProcessingResponse()
        im = resp.immediate_response
        im.status.code = http_status_pb2.TooManyRequests
        im.body = body.encode()
        im.details = f"flow_control_{reason}"
        for key, value in (
            ("retry-after", retry),
            ("content-type", "application/json"),
            ("x-flow-control", reason),
        ):
            im.headers.set_headers.add(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        return resp

    def _dispatch(self, now: float) -> None:
        """Answer what waited too long, then hand free slots to the queues' next requests."""
        for late, why in self.flows.expired(now):
            if not late.future.done():
                late.future.set_result(why)
        for cluster, flow in self.flows.clusters.items():
            free: dict[frozenset[str] | None, bool] = {}  # by subset, for this round

            def may_go(
                h: Held, cluster: str = cluster, free: dict[frozenset[str] | None, bool] = free
            ) -> bool:
                s = h.asked.subset
                if s not in free:
                    free[s] = self.state.free_slot(cluster, now, s)
                return free[s]

            while len(flow.queue) and self.state.free_slot(cluster, now):
                held = self.flows.next_up(cluster, may_go)
                free.clear()  # a request leaving takes a slot
                if held is None:
                    break  # those waiting may go only to servers with no slot free
                if held.future.done():
                    continue
                ask = held.asked
                chosen = self.state.pick(
                    cluster, now, prefix=ask.prefix, subset=ask.subset, kv=held.kv, adapter=ask.adapter
                )
                held.future.set_result(chosen)
                model = _model_of(cluster)
                if ask.adapter:
                    self.metrics.adapter_requests.labels(model, ask.adapter).inc()
                self.metrics.flow_wait.labels(model, held.klass, held.tenant_label).observe(
                    now - held.arrival
                )
                self.metrics.flow_dispatched.labels(model, held.klass, held.tenant_label).inc()
                if not chosen.servers:
                    break
        self._refresh_flow_gauges()

    def _refresh_flow_gauges(self) -> None:
        seen: set[tuple[str, str, str]] = set()
        for cluster, flow in self.flows.clusters.items():
            model = _model_of(cluster)
            counts: dict[tuple[str, str, str], int] = {}
            for held in flow.held.values():
                key = (model, held.klass, held.tenant_label)
                counts[key] = counts.get(key, 0) + 1
            for key, n in counts.items():
                self.metrics.flow_waiting.labels(*key).set(n)
                seen.add(key)
            top = flow.config.classes[0]
            self.metrics.flow_top_waiting.labels(model).set(sum(n for k, n in counts.items() if k[1] == top))
        for key in self._flow_labels - seen:
            self.metrics.flow_waiting.labels(*key).set(0)
        self._flow_labels = seen

    async def flow_dispatch(self) -> None:
        """Dispatch queued requests whenever a slot may have freed, and at every deadline, for
        ever (FLOW_TICK_S at most apart while any waits: a page's or a peer's news)."""
        while True:
            timeout = FLOW_TICK_S if self.flows.waiting() else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flow_wake.wait(), timeout)
            self._flow_wake.clear()
            self._dispatch(time.monotonic())

    def configure_flows(self, clusters: Iterable[cluster_pb2.Cluster]) -> None:
        """The clusters' flow control as the control plane now sends it; the requests of a
        queue that went (or changed) are picked at once."""
        configs = _cluster_configs(
            clusters,
            FLOW_METADATA_NS,
            read_config,
            FlowConfigError,
            self.metrics.flow_config_errors,
            "flow control",
        )
        for held in self.flows.configure(configs):
            if not held.future.done():
                held.future.set_result(RELEASED)
        self._refresh_flow_gauges()

    # ---- LoRA adapters (picker/adapters.py, picker/placement.py) ------------------------------

    def configure_adapters(self, clusters: Iterable[cluster_pb2.Cluster]) -> None:
        """The clusters' adapters as the control plane now sends them."""
        self.adapters_of = _cluster_configs(
            clusters,
            ADAPTERS_METADATA_NS,
            read_adapter_config,
            AdapterConfigError,
            self.metrics.adapter_config_errors,
            "adapters",
        )

    def _with_adapter(self, ask: Ask) -> Ask:
        """`ask` with its adapter, where its model names one of its cluster's, and narrowed to
        the servers that may serve it (the adapter's versions and endpoints; with placement
        dynamic, those this picker loaded it onto)."""
        cfg = self.adapters_of.get(ask.cluster)
        if cfg is None or ask.model not in cfg.rules:
            return ask
        servers, may = self._may_serve(ask.cluster, cfg, ask.model)
        subset = ask.subset
        for narrower in (
            may,
            self.placer.holding(ask.model, frozenset(servers)) if cfg.placement == "dynamic" else None,
        ):
            if narrower is not None:
                subset = narrower if subset is None else subset & narrower
        return dataclasses.replace(ask, adapter=ask.model, subset=subset)

    def _may_serve(
        self, cluster: str, cfg: ClusterAdapters, adapter: str
    ) -> tuple[list[str], frozenset[str] | None]:
        """The cluster's eligible servers, and those of them `adapter` may go to (None: all)."""
        servers = [c.address for c in self.state.clusters.get(cluster, ()) if c.eligible]
        return servers, cfg.servers(adapter, cluster.rsplit("@", 1)[-1], servers)

    def _must_place(self, ask: Ask) -> bool:
        """The request's adapter must be loaded first: its model's placement is dynamic and no
        server it may go to has it."""
        cfg = self.adapters_of.get(ask.cluster)
        return (
            bool(ask.adapter)
            and cfg is not None
            and cfg.placement == "dynamic"
            and self.ready.is_set()
            and not ask.subset
        )

    async def _place(self, ask: Ask) -> Ask | ep.ProcessingResponse:
        """Load the request's adapter onto the best server that may serve it; the request,
        narrowed to that server, or the 503 it gets when none could (with no server eligible,
        the request as it was: no pick, Envoy routes it by the weights)."""
        cfg = self.adapters_of[ask.cluster]
        rule = cfg.rules[ask.adapter]
        now = time.monotonic()
        servers, may = self._may_serve(ask.cluster, cfg, ask.adapter)
        candidates = [s for s in servers if may is None or s in may]
        if not candidates:  # nothing eligible to load onto: the weights route it, as any request
            return ask
        ranked = self.state.placement_order(candidates, ask.adapter, now)
        log.debug("adapter placement", adapter=ask.adapter, cluster=ask.cluster, order=ranked[:4])
        model = _model_of(ask.cluster)
        try:
            server = await self.placer.place(ask.adapter, rule.source or ask.adapter, ranked)
        except LoadFailed as e:
            self.metrics.adapter_loads.labels(model, ask.adapter, "failed").inc()
            return _unavailable(
                f"The adapter {ask.adapter} of model {model} could not be loaded on any server ({e}). "
                "Requests for the base model are not affected."
            )
        self.metrics.adapter_loads.labels(model, ask.adapter, "loaded").inc()
        return dataclasses.replace(ask, subset=frozenset({server}))

    async def _unload_cold(self) -> None:
        """Unload the adapters this picker loaded that went cold (placement.Placer.cold)."""
        now = time.monotonic()

        def busy(adapter: str, server: str) -> bool:
            s = self.state.adapters.servers.get(server)
            return s is not None and s.inflight.get(adapter, 0) > 0

        for adapter, server in self.placer.cold(now, busy):
            if await self.placer.unload(adapter, server):
                self.metrics.adapter_loads.labels(self._model_of_adapter(adapter), adapter, "unloaded").inc()

    def _model_of_adapter(self, adapter: str) -> str:
        return next((_model_of(c) for c, cfg in self.adapters_of.items() if adapter in cfg.rules), "")

    async def _kv_ask(self, ask: Ask) -> KvAsk | None:
        """The prompt's blocks, keyed for every block size the cluster's servers publish (16,
        vLLM's default, where none does yet: the approximate key), or None (no tokenizer for
        the cluster, a body without a prompt this reads). Tokenized off the event loop."""
        directory = self.tokenizer_of.get(ask.cluster)
        if directory is None:
            return None
        sizes = {
            size
            for c in self.state.clusters.get(ask.cluster, ())
            if (size := self.state.kv.block_size(c.address)) is not None
        } or {DEFAULT_BLOCK_SIZE}
        try:
            if len(ask.prompt) <= INLINE_PROMPT_CHARS:  # well under a millisecond: no thread hop
                return _kv_keys(self.tokenizers, directory, ask.prompt, sizes)
            return await asyncio.to_thread(_kv_keys, self.tokenizers, directory, ask.prompt, sizes)
        except PromptError as e:
            self.metrics.kv.tokenizer_errors.inc()
            self._tokenizer_outage.failed(e, tokenizer=directory)
            return None

    def _answer(
        self, ask: Ask | Refused, kv: KvAsk | None = None
    ) -> tuple[ep.ProcessingResponse, tuple[str, ...]]:
        resp = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        if isinstance(ask, Refused):
            self.metrics.refused.labels(ask.input).inc()
            reason = "input_refused"
        elif not self.ready.is_set():
            reason = "not_ready"
        elif not ask.cluster:
            reason = "no_cluster"
        elif ask.cluster not in self.state.clusters:
            reason = "unknown_cluster"
        else:
            chosen = self.state.pick(
                ask.cluster,
                time.monotonic(),
                prefix=ask.prefix,
                subset=ask.subset,
                kv=kv,
                adapter=ask.adapter,
            )
            if ask.adapter:
                self.metrics.adapter_requests.labels(_model_of(ask.cluster), ask.adapter).inc()
                if chosen.servers:
                    self.placer.sent(ask.adapter, chosen.servers[0], time.monotonic())
            reason = chosen.reason or "no_eligible_server"
            if kv is not None and chosen.servers:
                self.metrics.kv.matched.observe(chosen.kv_blocks)
            if chosen.servers:
                self._name(resp, ask, chosen.servers, reason)
                return resp, chosen.servers
        self.metrics.picks.labels(reason).inc()
        return resp, ()

    def _name(self, resp: ep.ProcessingResponse, ask: Ask, servers: tuple[str, ...], reason: str) -> None:
        """Name `servers` in `resp` (the header and the envoy.lb metadata), and ask Envoy for
        the response's headers: the request counts in flight until they come back."""
        value = ",".join(servers)
        mutation = resp.request_headers.response.header_mutation
        mutation.set_headers.add(
            header=base_pb2.HeaderValue(key=PICKED_HEADER, raw_value=value.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        resp.dynamic_metadata.fields[PICKED_METADATA_NS].struct_value.fields[
            PICKED_HEADER
        ].string_value = value
        flow = ask.cluster in self.flows.clusters  # its end is its trailers: FLOW_PICKED_MODE
        resp.mode_override.CopyFrom(FLOW_PICKED_MODE if flow else PICKED_MODE)
        self.metrics.picks.labels(reason).inc()
        self.metrics.inflight.inc()
        log.debug(
            "request picked", request_id=ask.request_id, cluster=ask.cluster, picked=value, reason=reason
        )

    async def kv_gauges(self) -> None:
        """The precise index's gauges (size, stale servers) and the servers' slots, every
        KV_GAUGES_S; and the subscriptions closed when the picker stops."""
        try:
            while True:
                if self.kv_subs is not None:
                    self.kv_subs.refresh_gauges()
                shown = {a: n for a, n in self.state.slots.items() if a in self.state.known()}
                for server in self._slots_shown - shown.keys():  # a server gone: its series too
                    self.metrics.slots.remove(server)
                for server, slots in shown.items():
                    self.metrics.slots.labels(server).set(slots)
                self._slots_shown = set(shown)
                self.metrics.adapter_evictions.set(self.state.adapters.evictions)
                await self._unload_cold()
                await asyncio.sleep(KV_GAUGES_S)
        finally:
            if self.kv_subs is not None:
                await self.kv_subs.close()
            await self.placer.close()

    # ---- the other pickers -------------------------------------------------------------------

    def peer_service(self) -> PeerService:
        return PeerService(self)

    def _peer_channel(self, peer: str) -> grpc.aio.Channel:
        options: list[tuple[str, str | int]] = [
            ("grpc.max_receive_message_length", limits.PICKER_PEER_MAX_BYTES)
        ]
        if self.tls is not None and self.tls.client_ca is not None:
            if self.peer_server_name:
                options.append(("grpc.ssl_target_name_override", self.peer_server_name))
            return grpc.aio.secure_channel(peer, client_credentials(self.tls, SIDE_FLAGS), options=options)
        return grpc.aio.insecure_channel(peer, options=options)

    async def follow_peer(self, peer: str) -> None:
        """Read another picker's requests in flight every peers_interval_s, for ever. No
        answer (the peer down, or refusing us, or an answer over PICKER_PEER_MAX_BYTES) is
        an error (its last counts age out); an answer that is not a PickerPeers message, or
        is past its bounds (choose.PickerState.observe_peer), is refused, and the peer counts
        for nothing until it answers sensibly; both are counted and logged once per run."""
        unread = Outage(log, "a peer's requests in flight unread")
        refused = Outage(log, "a peer's requests in flight refused")
        md = [("authorization", f"Bearer {self.peer_token}")] if self.peer_token else []
        async with self._peer_channel(peer) as channel:
            # The answer's bytes, parsed here: a peer's nonsense is counted, never a crash.
            call = channel.unary_unary(
                f"/{PEER_SERVICE}/InFlight", request_serializer=picker_pb2.InFlightRequest.SerializeToString
            )
            while True:
                try:
                    raw = await call(picker_pb2.InFlightRequest(), metadata=md, timeout=1.0)
                except grpc.RpcError as e:
                    self.metrics.peer_reads.labels("error").inc()
                    unread.failed(rpc_error(e), peer=peer)  # its last counts age out
                else:
                    unread.ok()
                    why = self._take_peer(peer, raw)
                    if why is None:
                        self.metrics.peer_reads.labels("ok").inc()
                        refused.ok()
                    else:
                        self.metrics.peer_reads.labels("refused").inc()
                        refused.failed(why, peer=peer)
                await asyncio.sleep(self.peers_interval_s)

    def _take_peer(self, peer: str, raw: object) -> str | None:
        """A peer's answer, as bytes: taken (None), or why not."""
        try:
            if not isinstance(raw, bytes):
                raise DecodeError(type(raw).__name__)
            resp = picker_pb2.InFlightResponse.FromString(raw)
        except DecodeError:
            self.state.peers.pop(peer, None)
            return "not a controlplane.v1.PickerPeers answer"
        pairs = [(e.address, e.requests) for e in islice(resp.servers, limits.PICKER_PEER_MAX_SERVERS + 1)]
        return self.state.observe_peer(peer, pairs, time.monotonic())

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
                    outage.failed(rpc_error(e), admin=self.admin)
                else:
                    if resp is None:  # grpc.aio's answer to bytes it could not parse
                        self.metrics.load_reads.labels("error").inc()
                        outage.failed("not a ListEndpointsResponse", admin=self.admin)
                        await asyncio.sleep(self.loads_interval_s)
                        continue
                    self.metrics.load_reads.labels("ok").inc()
                    outage.ok()
                    self.state.observe(server_loads(resp.endpoints, time.monotonic()))
                    self._flow_wake.set()
                    if self.flows.clusters:
                        await self._report_queued(stub, md)
                await asyncio.sleep(self.loads_interval_s)

    async def _report_queued(
        self, stub: endpoint_pb2_grpc.EndpointServiceStub, md: list[tuple[str, str]]
    ) -> None:
        """Tell the control plane how many requests wait in this picker's queues, per model:
        demand for its autoscaler (docs/flow-control.md#autoscaling). A failure costs nothing
        but the report (counted)."""
        queued: dict[str, int] = {}
        for cluster, flow in self.flows.clusters.items():
            model = _model_of(cluster)
            queued[model] = queued.get(model, 0) + len(flow.queue)
        try:
            await stub.ReportQueued(
                admin_endpoint_pb2.ReportQueuedRequest(picker=self.node_id, queued=queued),
                metadata=md,
                timeout=1.0,
            )
        except grpc.RpcError:
            self.metrics.queue_reports.labels("error").inc()
        else:
            self.metrics.queue_reports.labels("ok").inc()

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
                clusters = [_unpack(a, cluster_pb2.Cluster) for a in resp.resources]
                names = sorted(
                    c.eds_cluster_config.service_name or c.name
                    for c in clusters
                    if c.type == cluster_pb2.Cluster.EDS
                )
                self.tokenizer_of = {
                    c.eds_cluster_config.service_name or c.name: tokenizer
                    for c in clusters
                    if (tokenizer := metadata_string(c.metadata, KV_METADATA_NS, "tokenizer"))
                }
                self.configure_flows(clusters)
                self.configure_adapters(clusters)
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
                self.placer.keep_only(self.state.known())
                if self.kv_subs is None:
                    if self.metrics.kv_process is not None:  # the index in a process of its own
                        self.kv_subs = KvProcess(
                            self.state,
                            self.metrics.kv,
                            self.metrics.kv_process,
                            deciding=self.deciding,
                            cpu_share=self.kv_cpu,
                        )
                    else:
                        self.kv_subs = KvSubscriptions(self.state, self.metrics.kv)
                named = publishers(assignments)
                self.state.kv_publishers = set(named)
                self.kv_subs.update(named)
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


FLOW_TICK_S = 0.02  # while requests wait, a look for a free slot at least this often


def _cluster_configs(
    clusters: Iterable[cluster_pb2.Cluster],
    namespace: str,
    read: Callable[[str], T],
    error: type[Exception],
    errors: Counter,
    what: str,
) -> dict[str, T]:
    """Each cluster's `config` in its `namespace` metadata, read by `read`; a cluster whose
    config `read` refuses (with `error`) is counted in `errors`, logged, and picked without it."""
    configs: dict[str, T] = {}
    for c in clusters:
        text = metadata_string(c.metadata, namespace, "config")
        if not text:
            continue
        name = c.eds_cluster_config.service_name or c.name
        try:
            configs[name] = read(text)
        except error as e:
            errors.inc()
            log.warning(
                "cluster config unreadable: the cluster is picked without it",
                what=what,
                cluster=name,
                error=str(e)[:300],
            )
    return configs


def _status(req: ep.ProcessingRequest) -> int:
    """A response-headers message's HTTP status (0 if absent or not a number)."""
    value = map_header_bytes(req.response_headers.headers, ":status")
    return int(value) if value.isdigit() and len(value) <= 3 else 0


def _adapter(ask: Ask | Refused | None) -> str:
    """The adapter a request named, "" if none (or it was refused)."""
    return ask.adapter if isinstance(ask, Ask) else ""


def _duration(seconds: float) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=int(seconds), nanos=int(seconds % 1 * 1e9))


def _unavailable(message: str) -> ep.ProcessingResponse:
    """A 503 in Envoy's place, with OpenAI's error body (its SDK raises an APIStatusError)."""
    resp = ep.ProcessingResponse()
    im = resp.immediate_response
    im.status.code = http_status_pb2.ServiceUnavailable
    im.body = json.dumps(
        {"error": {"message": message, "type": "adapter_unavailable", "param": "model", "code": 503}}
    ).encode()
    im.details = "adapter_load_failed"
    im.headers.set_headers.add(
        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    return resp


def _model_of(cluster: str) -> str:
    """The model of a cluster (`model@version`, names.cluster_name)."""
    return cluster.rsplit("@", 1)[0]


def _content_length(req: ep.ProcessingRequest) -> int:
    """The request's Content-Length (0: none, or not a number below 2**40)."""
    value = header_bytes(req, "content-length")
    return int(value) if value.isdigit() and len(value) <= 12 else 0


DEFAULT_BLOCK_SIZE = 16  # vLLM's
# A prompt up to this long is tokenized on the event loop (a few hundred microseconds); a
# longer one in a thread, so the loop serves other picks meanwhile. A thread hop costs a GIL
# handoff each way, milliseconds when the loop is busy (applying KV events).
INLINE_PROMPT_CHARS = 16 << 10
# The GIL's switch interval (5 ms by default): how long a thread that wants it (the gRPC
# poller, a tokenizing thread) may wait while the loop runs. A picker answers in milliseconds.
SWITCH_INTERVAL_S = 0.0005
KV_GAUGES_S = 1.0


def _kv_keys(tokenizers: Tokenizers, directory: str, prompt: str, sizes: set[int]) -> KvAsk | None:
    ids = token_ids(tokenizers.get(directory), prompt.encode(errors="surrogatepass"))
    if ids is None:
        return None
    return KvAsk({size: prompt_keys(ids, size) for size in sizes}, len(ids))


def publishers(
    assignments: Iterable[endpoint_pb2.ClusterLoadAssignment],
) -> dict[str, tuple[str, str | None]]:
    """Each server's KV-event publisher and replay socket, as the control plane named them."""
    out: dict[str, tuple[str, str | None]] = {}
    for cla in assignments:
        for locality in cla.endpoints:
            for lb in locality.lb_endpoints:
                events = metadata_string(lb.metadata, KV_METADATA_NS, "events")
                if not events:
                    continue
                sock = lb.endpoint.address.socket_address
                host = f"[{sock.address}]" if ":" in sock.address else sock.address
                out[f"{host}:{sock.port_value}"] = (
                    events,
                    metadata_string(lb.metadata, KV_METADATA_NS, "replay") or None,
                )
    return out


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
            prefill_s_per_token=e.prefill_seconds_per_token
            if e.HasField("prefill_seconds_per_token")
            else None,
            decode_s_per_request=e.decode_seconds_per_request
            if e.HasField("decode_seconds_per_request")
            else None,
            # A page without LoRA's series has no adapter slots: its lists say nothing then.
            **(
                {
                    "lora_running": tuple(e.running_adapters),
                    "lora_waiting": tuple(e.waiting_adapters),
                    "max_lora": e.max_adapters,
                }
                if e.HasField("max_adapters")
                else {}
            ),
        )
    return out


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


def rpc_error(e: grpc.RpcError) -> str:
    """A failed call as one log field: its status code and gRPC's details, cut at a word (never
    mid-word) past ERROR_MAX_CHARS."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or ""
    text = " ".join(f"{code.name if code is not None else 'UNKNOWN'}: {details}".split())
    if len(text) > ERROR_MAX_CHARS:
        text = text[:ERROR_MAX_CHARS].rsplit(" ", 1)[0] + " ..."
    return text


class PeerService(picker_pb2_grpc.PickerPeersServicer):
    """controlplane.v1.PickerPeers: this picker's own requests in flight, for its peers only:
    with --peer-token-file a caller must send that token; without it, only a caller the TLS
    handshake verified (mutual TLS, --tls-client-ca) is answered."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    def _refusal(self, context: Any) -> str | None:
        """Why the caller may not read the counts, or None."""
        token = self.picker.peer_token
        if token:
            sent = dict(context.invocation_metadata() or ()).get("authorization", "")
            if hmac.compare_digest(str(sent).encode(), f"Bearer {token}".encode()):
                return None
            return "a peer read needs this picker's --peer-token-file token (authorization: Bearer ...)"
        tls = self.picker.tls
        if tls is not None and tls.client_ca is not None:
            return None  # the handshake required a certificate the client CA signed
        return (
            "this picker serves its requests in flight only to peers with a client certificate "
            "(--tls-client-ca) or its token (--peer-token-file)"
        )

    async def InFlight(
        self, request: picker_pb2.InFlightRequest, context: Any
    ) -> picker_pb2.InFlightResponse:
        why = self._refusal(context)
        if why is not None:
            self.picker.metrics.refused.labels("peer_credentials").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        return picker_pb2.InFlightResponse(
            servers=[
                picker_pb2.ServerInFlight(address=a, requests=n)
                for a, n in self.picker.state.inflight.items()
            ]
        )


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
    kv_index_blocks: int = MAX_BLOCKS,
    prefix_bound: float = PREFIX_LOAD_BOUND,
    peers: Iterable[str] = (),
    peers_interval_s: float = 0.05,
    tls: ServerTls | None = None,
    peer_token: str | None = None,
    peer_server_name: str | None = None,
    adapter_affinity: bool = True,
    adapter_idle_unload_s: float = IDLE_UNLOAD_S,
    kv_in_process: bool = False,
    kv_index_cpu: float = CPU_SHARE,
) -> None:
    """Run a picker until SIGINT or SIGTERM (OSError naming the flag if it cannot listen;
    TlsConfigInvalid naming the flag if a TLS file cannot be used). The servers' KV events are
    read by a process of its own (kv_process.py), or with `kv_in_process` by this one."""
    credentials = server_credentials(tls, SIDE_FLAGS) if tls is not None else None
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    metrics = PickerMetrics(kv_in_process)
    picker = Picker(
        control_plane,
        node_id or f"picker-{os.getpid()}",
        metrics,
        admin=admin,
        token=token,
        loads_interval_s=loads_interval_s,
        peers_interval_s=peers_interval_s,
        tls=tls,
        peer_token=peer_token,
        peer_server_name=peer_server_name,
    )
    picker.state.prefix_entries = prefix_entries
    picker.state.prefix_bound = prefix_bound
    picker.state.adapter_affinity = adapter_affinity
    picker.placer.idle_unload_s = adapter_idle_unload_s
    picker.kv_cpu = kv_index_cpu
    if kv_in_process:
        picker.state.kv.max_blocks = kv_index_blocks
    else:
        picker.state.kv = KvMirror(kv_index_blocks)
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", limits.PICKER_MAX_MESSAGE_BYTES),
        ]
    )
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health_pb2_grpc.add_HealthServicer_to_server(picker.health, server)
    picker_pb2_grpc.add_PickerPeersServicer_to_server(picker.peer_service(), server)
    # What start-up made (the modules, their protobuf descriptors: some 60,000 objects) lives
    # as long as the process: moved out of the collector's reach, so that a full collection
    # walks only what came since (it took 17-36 ms on the picks' loop, measured under a flood).
    gc.collect()
    gc.freeze()
    await picker.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await picker.health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    background = [picker.follow(), picker.kv_gauges(), picker.flow_dispatch()]
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
            "picker listening",
            listen=listen,
            control_plane=control_plane,
            metrics=metrics_listen,
            tls="mutual" if tls is not None and tls.client_ca is not None else "on" if tls else "off",
        ),
        credentials=credentials,
    )
