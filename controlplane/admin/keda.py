"""KEDA's external scaler, served on --scaler-listen (thin I/O shell over autoscaling/).

A ScaledObject names the model (and optionally a version) in its trigger's metadata:

    triggers:
      - type: external-push
        metadata: {scalerAddress: controlplane.inference:9090, model: llama-3-8b}

- `IsActive` / `StreamIsActive`: the model has had work (running, waiting or held) within
  its `autoscaling.idle_grace`. KEDA scales a workload to zero only while it is inactive.
- `GetMetricSpec`: one metric, `desired-replicas-<model>[-<version>]`, whose target is 1.
- `GetMetrics`: its value is the desired replicas. With KEDA's default `AverageValue` target
  the HPA computes ceil(value / 1) = the desired replicas: the control plane's windows decide.

The port is read-only and carries no secret (desired replicas and activity per model), so it
takes no credential; like every port here it listens on loopback unless told otherwise.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from controlplane import limits
from controlplane.autoscaling.autoscaler import MODEL, Autoscaler
from controlplane.autoscaling.kpa import Decision
from controlplane.fleet.model import Fleet, ScalingPolicy
from controlplane.keda import externalscaler_pb2 as pb
from controlplane.keda import externalscaler_pb2_grpc as pb_grpc

log = structlog.get_logger("controlplane.autoscaling")

SERVICE_NAME = "externalscaler.ExternalScaler"
STREAM_POLL_S = 0.25  # how often a StreamIsActive stream looks for a change (a round is 1 s)
_UNSAFE = re.compile(r"[^a-z0-9-]+")


def metric_name(model: str, version: str = "") -> str:
    """A metric name Kubernetes accepts, one per model (and version)."""
    raw = f"desired-replicas-{model}" + (f"-{version}" if version else "")
    return _UNSAFE.sub("-", raw.lower()).strip("-")[:200]


class ScalerError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ExternalScaler(pb_grpc.ExternalScalerServicer):
    def __init__(self, autoscaler: Autoscaler, fleet: Callable[[], Fleet | None]) -> None:
        self.autoscaler = autoscaler
        self.fleet = fleet

    def _decision(self, ref: pb.ScaledObjectRef) -> tuple[str, str, Decision, ScalingPolicy]:
        meta = ref.scalerMetadata
        model = meta.get("model", "")
        version = meta.get("version", "")
        if not model:
            raise ScalerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "scalerMetadata.model: required (the fleet's model name, in the trigger's metadata)",
            )
        for field, value in (("model", model), ("version", version)):
            if len(value) > limits.API_NAME_MAX_CHARS:
                raise ScalerError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"scalerMetadata.{field}: {len(value)} characters; at most {limits.API_NAME_MAX_CHARS}",
                )
        fleet = self.fleet()
        if fleet is None:
            raise ScalerError(grpc.StatusCode.UNAVAILABLE, "the fleet config has not loaded yet")
        try:
            m = fleet.model(model)
        except KeyError:
            known = ", ".join(sorted(x.name for x in fleet.models)[:20])
            raise ScalerError(
                grpc.StatusCode.NOT_FOUND, f"scalerMetadata.model: no model {model!r} (models: {known})"
            ) from None
        if version and version not in {v.name for v in m.versions}:
            raise ScalerError(
                grpc.StatusCode.NOT_FOUND,
                f"scalerMetadata.version: model {model!r} has no version {version!r} "
                f"(versions: {', '.join(v.name for v in m.versions)})",
            )
        d = self.autoscaler.decisions.get((model, version or MODEL))
        if d is None:
            raise ScalerError(
                grpc.StatusCode.UNAVAILABLE, f"no decision for {model!r} yet; retry in a second"
            )
        return model, version, d, fleet.scaling_of(m)

    async def _answer(
        self, context: grpc.aio.ServicerContext, ref: pb.ScaledObjectRef
    ) -> tuple[str, str, Decision, ScalingPolicy]:
        try:
            return self._decision(ref)
        except ScalerError as e:
            await context.abort(e.code, str(e))
            raise  # not reached: abort raises

    async def IsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> pb.IsActiveResponse:
        _, _, d, policy = await self._answer(context, request)
        return pb.IsActiveResponse(result=d.active(policy))

    async def StreamIsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.IsActiveResponse]:
        last: bool | None = None
        while True:
            _, _, d, policy = await self._answer(context, request)
            active = d.active(policy)
            if active != last:
                yield pb.IsActiveResponse(result=active)
                last = active
            await asyncio.sleep(STREAM_POLL_S)

    async def GetMetricSpec(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricSpecResponse:
        model, version, _, _ = await self._answer(context, request)
        spec = pb.MetricSpec(metricName=metric_name(model, version), targetSize=1, targetSizeFloat=1.0)
        return pb.GetMetricSpecResponse(metricSpecs=[spec])

    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricsResponse:
        model, version, d, _ = await self._answer(context, request.scaledObjectRef)
        value = pb.MetricValue(
            metricName=metric_name(model, version), metricValue=d.desired, metricValueFloat=float(d.desired)
        )
        return pb.GetMetricsResponse(metricValues=[value])
