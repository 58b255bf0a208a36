"""The operator API's servicers: protobuf in, controller call, protobuf out (thin shell)."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import grpc

import controlplane
from controlplane import limits
from controlplane.admin.auth import USER_METADATA, Tokens
from controlplane.admin.scaling import scaling_messages
from controlplane.balancing.controller import WeightController
from controlplane.drain.controller import EndpointDrains
from controlplane.flow.demand import PickerQueues
from controlplane.obs.metrics import Metrics
from controlplane.resources.names import cluster_name
from controlplane.resources.types import TYPE_URLS, type_label
from controlplane.rollout import machine
from controlplane.rollout.controller import CommandRejected, RolloutController
from controlplane.rollout.overlay import active
from controlplane.signals.store import EndpointSignals
from controlplane.v1 import (
    autoscaling_pb2,
    autoscaling_pb2_grpc,
    endpoint_pb2,
    endpoint_pb2_grpc,
    proxy_pb2,
    proxy_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from controlplane.xds.server import ProxyRegistry

SERVICE_NAMES = tuple(
    f"controlplane.v1.{s}"
    for s in ("RolloutService", "EndpointService", "ProxyService", "AutoscalingService")
)
T = TypeVar("T")
_CODES = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "ABORTED": grpc.StatusCode.ABORTED,
}


class _Base:
    def __init__(self, controller: RolloutController, tokens: Tokens, metrics: Metrics) -> None:
        self.controller = controller
        self.tokens = tokens
        self.metrics = metrics

    def who(self, context: grpc.aio.ServicerContext) -> str:
        md = dict(context.invocation_metadata() or ())
        role = self.tokens.role_of(md.get("authorization")) or "unknown"
        user = str(md.get(USER_METADATA) or "operator")[:64]
        return f"{user} ({role} token, {context.peer()})"

    async def call(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        fn: Callable[[], Awaitable[T]],
        request: Any = None,
    ) -> T:
        """Check the request's names and reasons against their bounds, then run `fn`,
        answering a rejected command with its status and message."""
        try:
            if request is not None:
                check_request(request)
            out = await fn()
        except CommandRejected as e:
            self.metrics.rollouts.admin_requests.labels(method, e.code).inc()
            await context.abort(_CODES[e.code], str(e))
            raise  # unreachable: abort raises
        self.metrics.rollouts.admin_requests.labels(method, "OK").inc()
        return out


# Fields of operator requests that name something (echoed in errors and stored in history)
# or explain something (stored in history): bounded, so no request can grow the history or
# an error beyond what every client can read.
_NAME_FIELDS = ("model", "to_version", "address")


def check_request(request: Any) -> None:
    """Raise CommandRejected(INVALID_ARGUMENT) for a name or reason over its bound, or a
    number that is not finite; the message never echoes the oversized value."""
    for name in _NAME_FIELDS:
        value = getattr(request, name, None)
        if isinstance(value, str) and len(value) > limits.API_NAME_MAX_CHARS:
            raise CommandRejected(
                "INVALID_ARGUMENT",
                f"{name}: at most {limits.API_NAME_MAX_CHARS} characters, got {len(value)}",
            )
    reason = getattr(request, "reason", None)
    if isinstance(reason, str) and len(reason) > limits.API_REASON_MAX_CHARS:
        raise CommandRejected(
            "INVALID_ARGUMENT", f"reason: at most {limits.API_REASON_MAX_CHARS} characters, got {len(reason)}"
        )
    for field, value in request.ListFields() if hasattr(request, "ListFields") else ():
        if isinstance(value, float) and not math.isfinite(value):
            raise CommandRejected("INVALID_ARGUMENT", f"{field.name}: expected a finite number, got {value}")


async def _ready(value: T) -> T:
    """A value as an awaitable, for `call`."""
    return value


def rollout_message(c: RolloutController, r: machine.Rollout) -> rollout_pb2.Rollout:
    s = r.spec
    msg = rollout_pb2.Rollout(
        model=s.model,
        stable_version=s.stable,
        canary_version=s.canary,
        phase=r.phase,
        step=r.step + 1,
        steps=list(s.steps),
        weights=r.weights,
        reason=r.reason,
        interval_seconds=s.interval_s or 0.0,
        manual=s.interval_s is None,
        max_error_rate=s.max_error_rate,
        max_latency_ratio=s.max_latency_ratio,
        min_requests=s.min_requests,
        step_started_at=r.step_started_at,
        ack_deadline_seconds=s.ack_deadline_s,
        shadow_percent=s.shadow_percent,
        finishing=r.finishing,
    )
    note = c.inconclusive.get(s.model)
    if note is not None and r.phase == "Progressing" and not r.finishing:
        # Not stored: what the running step's analysis lacks so far (a manual step never
        # pauses for it; a timed one does once its interval has elapsed).
        msg.reason = f"{r.reason}; analysis so far {note}"
    f = c.figures.get(s.model)
    if f is not None and active(r):
        for field, version, fig in (("canary", s.canary, f[0]), ("stable", s.stable, f[1])):
            va = getattr(msg, field)
            va.version = version
            va.requests = fig.requests
            va.error_rate = fig.error_rate
            if fig.p99_s is not None:
                va.p99_seconds = fig.p99_s
    return msg


def _start_request(req: rollout_pb2.StartRolloutRequest) -> machine.RolloutSpec:
    """The spec to start (its stable is filled in by the controller); proto defaults apply
    only where the request leaves a field out."""
    if not req.model:
        raise CommandRejected("INVALID_ARGUMENT", "model: required")
    if not req.to_version:
        raise CommandRejected("INVALID_ARGUMENT", "to_version: required (the version to roll to)")
    if req.manual and req.interval_seconds:
        raise CommandRejected("INVALID_ARGUMENT", "give either an interval or manual gates, not both")
    d = machine.RolloutSpec(req.model, "", req.to_version)
    return replace(
        d,
        steps=tuple(req.steps) or d.steps,
        interval_s=None if req.manual else (req.interval_seconds or d.interval_s),
        max_error_rate=req.max_error_rate if req.HasField("max_error_rate") else d.max_error_rate,
        max_latency_ratio=req.max_latency_ratio if req.HasField("max_latency_ratio") else d.max_latency_ratio,
        min_requests=req.min_requests if req.HasField("min_requests") else d.min_requests,
        ack_deadline_s=req.ack_deadline_seconds if req.HasField("ack_deadline_seconds") else d.ack_deadline_s,
        shadow_percent=req.shadow_percent,
    )


class RolloutService(_Base, rollout_pb2_grpc.RolloutServiceServicer):
    def _get(self, model: str) -> machine.Rollout:
        self.controller._model(model)
        r = self.controller.rollouts.get(model)
        if r is None:
            raise CommandRejected(
                "NOT_FOUND", f"model {model} has no rollout; start one with `cpctl rollout start`"
            )
        return r

    async def Start(self, request: rollout_pb2.StartRolloutRequest, context: Any) -> rollout_pb2.Rollout:
        who = self.who(context)
        r = await self.call(
            context, "Start", lambda: self.controller.start(_start_request(request), who), request=request
        )
        return rollout_message(self.controller, r)

    async def Get(self, request: rollout_pb2.GetRolloutRequest, context: Any) -> rollout_pb2.Rollout:
        r = await self.call(context, "Get", lambda: _ready(self._get(request.model)), request=request)
        return rollout_message(self.controller, r)

    async def List(
        self, request: rollout_pb2.ListRolloutsRequest, context: Any
    ) -> rollout_pb2.ListRolloutsResponse:
        rs = await self.call(
            context,
            "List",
            lambda: _ready(sorted(self.controller.rollouts.values(), key=lambda r: r.spec.model)),
        )
        return rollout_pb2.ListRolloutsResponse(rollouts=[rollout_message(self.controller, r) for r in rs])

    async def Watch(
        self, request: rollout_pb2.GetRolloutRequest, context: Any
    ) -> AsyncIterator[rollout_pb2.Rollout]:
        r = await self.call(context, "Watch", lambda: _ready(self._get(request.model)), request=request)
        while True:
            yield rollout_message(self.controller, r)
            if not active(r):
                return
            await self.controller.wait_change(1.0)
            r = self.controller.rollouts[request.model]

    async def _command(
        self, context: Any, method: str, request: rollout_pb2.RolloutCommand, cmd: machine.Command
    ) -> rollout_pb2.Rollout:
        who = self.who(context)
        r = await self.call(
            context, method, lambda: self.controller.command(request.model, cmd, who), request=request
        )
        return rollout_message(self.controller, r)

    async def Pause(self, request: rollout_pb2.RolloutCommand, context: Any) -> rollout_pb2.Rollout:
        return await self._command(
            context, "Pause", request, machine.Pause(request.reason or "paused by operator")
        )

    async def Resume(self, request: rollout_pb2.RolloutCommand, context: Any) -> rollout_pb2.Rollout:
        return await self._command(context, "Resume", request, machine.Resume())

    async def Promote(self, request: rollout_pb2.RolloutCommand, context: Any) -> rollout_pb2.Rollout:
        return await self._command(context, "Promote", request, machine.Promote(full=request.full))

    async def Abort(self, request: rollout_pb2.RolloutCommand, context: Any) -> rollout_pb2.Rollout:
        return await self._command(
            context, "Abort", request, machine.Abort(request.reason or "aborted by operator")
        )

    async def Undo(self, request: rollout_pb2.RolloutCommand, context: Any) -> rollout_pb2.Rollout:
        who = self.who(context)
        r = await self.call(
            context, "Undo", lambda: self.controller.undo(request.model, who), request=request
        )
        return rollout_message(self.controller, r)

    async def History(
        self, request: rollout_pb2.GetRolloutRequest, context: Any
    ) -> rollout_pb2.HistoryResponse:
        records = await self.call(
            context, "History", lambda: self.controller.history(request.model), request=request
        )
        return rollout_pb2.HistoryResponse(
            records=[
                rollout_pb2.AuditRecord(
                    model=a.model,
                    at=a.at,
                    who=a.who,
                    phase=a.phase,
                    step=a.step + 1,
                    weight=a.weight,
                    reason=a.reason,
                )
                for a in records
            ]
        )


MAX_QUEUED_MODELS = 10_000  # a picker's report names at most this many models


class EndpointService(_Base, endpoint_pb2_grpc.EndpointServiceServicer):
    def __init__(
        self,
        controller: RolloutController,
        tokens: Tokens,
        metrics: Metrics,
        source_of: Callable[[str, str, str], tuple[str, float | None]] = lambda m, v, a: ("file", None),
        drains: EndpointDrains | None = None,  # None: listing only (Drain and Undrain refuse)
        picker_queues: PickerQueues | None = None,  # None: ReportQueued refuses
    ) -> None:
        super().__init__(controller, tokens, metrics)
        self.source_of = source_of  # discovery: where an endpoint comes from, when last seen
        self.drains = drains
        self.picker_queues = picker_queues

    def _drains(self) -> EndpointDrains:
        if self.drains is None:
            raise CommandRejected("FAILED_PRECONDITION", "this server does not drain endpoints")
        return self.drains

    def _endpoints(self, model_filter: str) -> list[endpoint_pb2.Endpoint]:
        c = self.controller
        fleet = c.file_fleet
        if fleet is None:
            return []
        if model_filter:
            c._model(model_filter)
        served = c.reconciler.fleet
        in_eds = {
            (m.name, v.name, ep.address)
            for m in (served.models if served else ())
            for v in m.versions
            for ep in v.endpoints
        }
        now_mono = time.monotonic()
        out = []
        for m in fleet.models:
            if model_filter and m.name != model_filter:
                continue
            layer = c.layers.get(m.name)
            for v in m.versions:
                weights = c.reconciler.weights.get(cluster_name(m.name, v.name), {})
                vstate = (
                    layer.versions.get(v.name, (None, 0.0))[0]
                    if layer and layer.file_stable == m.stable
                    else None
                )
                for ep in v.endpoints:
                    load = c.signals.load((m.name, ep.address), fleet.declared_capacity(ep) or 1.0, now_mono)
                    in_flight = c.signals.lrs_totals((m.name, ep.address), now_mono)[0]
                    w = int(weights.get(ep.address, 1))
                    d = c.drains.get(ep.address)
                    if (m.name, v.name, ep.address) not in in_eds:
                        state = "DRAINED" if d is not None else "RETIRED"
                    elif d is not None or vstate == "draining":
                        state = "DRAINING"
                    elif vstate == "leaving":
                        state = "LEAVING"
                    elif w <= 0:
                        state = "HELD_OUT"
                    else:
                        state = "SERVING"
                    sig = c.signals.endpoints.get((m.name, ep.address))
                    msg = endpoint_pb2.Endpoint(
                        model=m.name,
                        version=v.name,
                        address=ep.address,
                        gpu=ep.gpu or "",
                        state=state,
                        weight=max(w, 0) if state in ("SERVING", "LEAVING", "DRAINING", "HELD_OUT") else 0,
                        capacity=load.capacity,
                        in_flight=in_flight,
                        signal_age_seconds=load.age_s if math.isfinite(load.age_s) else -1.0,
                        drain_started_at=d.started_at if d is not None else 0.0,
                        sight="SEEN" if load.in_sight else "OUT_OF_SIGHT",
                        note=_endpoint_note(sig, state, now_mono),
                    )
                    # A figure never read stays unset: unknown, not idle.
                    for name, figure in (
                        ("running", load.running),
                        ("waiting", load.waiting),
                        ("kv_use", load.kv_use),
                        ("latency_seconds", load.latency_s),
                        ("error_rate", load.error_rate),
                        ("prefill_seconds_per_token", load.prefill_s_per_token),
                        ("decode_seconds_per_request", load.decode_s_per_request),
                    ):
                        if figure is not None:
                            setattr(msg, name, figure)
                    # Adapters: max_adapters set says they are known (empty lists alone cannot).
                    if load.max_lora is not None:
                        msg.max_adapters = load.max_lora
                        msg.running_adapters.extend(load.lora_running or ())
                        msg.waiting_adapters.extend(load.lora_waiting or ())
                    if sig is not None and sig.scrape_error is not None:
                        msg.scrape_error = sig.scrape_error
                        msg.scrape_error_reason = sig.scrape_error_reason or ""
                    msg.source, seen = self.source_of(m.name, v.name, ep.address)
                    if seen is not None:
                        msg.last_seen_seconds = seen
                    out.append(msg)
        return out

    async def List(
        self, request: endpoint_pb2.ListEndpointsRequest, context: Any
    ) -> endpoint_pb2.ListEndpointsResponse:
        eps = await self.call(
            context, "List", lambda: _ready(self._endpoints(request.model)), request=request
        )
        return endpoint_pb2.ListEndpointsResponse(endpoints=eps)

    async def ReportQueued(
        self, request: endpoint_pb2.ReportQueuedRequest, context: Any
    ) -> endpoint_pb2.ReportQueuedResponse:
        """A picker's requests waiting per model: autoscaling demand (flow/demand.py)."""

        def take() -> endpoint_pb2.ReportQueuedResponse:
            if len(request.queued) > MAX_QUEUED_MODELS:
                raise CommandRejected(
                    "INVALID_ARGUMENT", f"queued names more than {MAX_QUEUED_MODELS} models"
                )
            if self.picker_queues is None:
                raise CommandRejected("FAILED_PRECONDITION", "this server does not take queue reports")
            fleet = self.controller.file_fleet
            models = {m.name for m in fleet.models} if fleet is not None else set()
            self.picker_queues.report(request.picker, dict(request.queued), models)
            return endpoint_pb2.ReportQueuedResponse()

        return await self.call(context, "ReportQueued", lambda: _ready(take()), request=request)

    def _one(self, address: str) -> endpoint_pb2.Endpoint:
        found = [e for e in self._endpoints("") if e.address == address]
        if not found:
            raise CommandRejected("NOT_FOUND", f"no endpoint {address!r} in the fleet")
        return found[0]

    async def Drain(self, request: endpoint_pb2.DrainRequest, context: Any) -> endpoint_pb2.Endpoint:
        who = self.who(context)

        async def drain() -> endpoint_pb2.Endpoint:
            await self._drains().drain(request.address, request.timeout_seconds or None, request.reason, who)
            return self._one(request.address)

        return await self.call(context, "Drain", drain, request=request)

    async def Undrain(self, request: endpoint_pb2.DrainRequest, context: Any) -> endpoint_pb2.Endpoint:
        who = self.who(context)

        async def undrain() -> endpoint_pb2.Endpoint:
            await self._drains().undrain(request.address, request.reason, who)
            return self._one(request.address)

        return await self.call(context, "Undrain", undrain, request=request)


def _endpoint_note(sig: EndpointSignals | None, state: str, now: float) -> str:
    """Why an endpoint is held out or out of sight, in words ("" when it serves normally)."""
    if sig is None:
        return ""
    if sig.out_of_sight_since is not None:
        why = f"out of sight for {now - sig.out_of_sight_since:.0f}s ({sig.last_error or 'no answer'})"
        if state == "HELD_OUT":
            return f"{why}; held out: the rest of its version is seen and ready"
        return f"{why}; kept serving on its last verdict: the control plane cannot vouch for its version"
    if state == "HELD_OUT" and sig.ready is False:
        return f"not ready: {sig.last_error or 'health check'}"
    return ""


class ProxyService(_Base, proxy_pb2_grpc.ProxyServiceServicer):
    def __init__(
        self, controller: RolloutController, tokens: Tokens, metrics: Metrics, registry: ProxyRegistry
    ) -> None:
        super().__init__(controller, tokens, metrics)
        self.registry = registry

    async def List(
        self, request: proxy_pb2.ListProxiesRequest, context: Any
    ) -> proxy_pb2.ListProxiesResponse:
        self.metrics.rollouts.admin_requests.labels("ListProxies", "OK").inc()
        out = []
        for d in self.registry.describe():
            p = proxy_pb2.Proxy(
                node_id=d["node_id"] or "",
                node_cluster=d["node_cluster"],
                address=d["peer"],
                user_agent=d["user_agent"],
                service=d["service"],
                transport=d["transport"],
                connected_seconds=d["connected_seconds"],
                version=d.get("version", ""),
                notes=d.get("notes", []),
            )
            for label in (type_label(t) for t in TYPE_URLS):
                t = d["types"].get(label)
                if t is None:
                    continue
                p.types.add(
                    type={"cluster": "cds", "endpoint": "eds", "listener": "lds", "route": "rds"}[label],
                    status=t["status"],
                    acked_version=t["acked_version"],
                    last_nack=t["last_nack"],
                    resources=t["resources"],
                    reason=t["reason"],
                )
            out.append(p)
        return proxy_pb2.ListProxiesResponse(proxies=out)

    async def ServerVersion(
        self, request: proxy_pb2.ServerVersionRequest, context: Any
    ) -> proxy_pb2.ServerVersionResponse:
        self.metrics.rollouts.admin_requests.labels("ServerVersion", "OK").inc()
        return proxy_pb2.ServerVersionResponse(version=controlplane.__version__)


class AutoscalingService(_Base, autoscaling_pb2_grpc.AutoscalingServiceServicer):
    """The autoscaler's latest decisions, read from the weight loop (which takes them every
    signals round), with the drains a scale-down would make and those under way."""

    def __init__(
        self, controller: RolloutController, tokens: Tokens, metrics: Metrics, weights: WeightController
    ) -> None:
        super().__init__(controller, tokens, metrics)
        self.weights = weights

    def _scaling(self, model: str) -> list[autoscaling_pb2.ModelScaling]:
        if model:
            self.controller._model(model)  # NOT_FOUND naming it, as the other services
        fleet = self.controller.reconciler.fleet  # as served: the autoscaler decides on it
        if fleet is None:
            return []
        return scaling_messages(
            fleet,
            self.weights.autoscaler.decisions,
            self.weights.weigher.views,
            self.controller.reconciler.overlay.draining,
            model,
        )

    async def List(
        self, request: autoscaling_pb2.ListAutoscalingRequest, context: Any
    ) -> autoscaling_pb2.ListAutoscalingResponse:
        rows = await self.call(
            context, "ListAutoscaling", lambda: _ready(self._scaling(request.model)), request=request
        )
        return autoscaling_pb2.ListAutoscalingResponse(scaling=rows)
