"""The operator API's gRPC server and KEDA's external scaler server (I/O shell): built,
authenticated and bound here; app.py starts and stops them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controlplane.admin import auth, keda
from controlplane.admin.defaults import DEFAULT_STATE_DIR, TOKEN_FILE_NAME
from controlplane.admin.keda import ExternalScaler
from controlplane.admin.service import (
    SERVICE_NAMES,
    AutoscalingService,
    EndpointService,
    ProxyService,
    RolloutService,
)
from controlplane.autoscaling.autoscaler import Autoscaler
from controlplane.balancing.controller import WeightController
from controlplane.drain.controller import EndpointDrains
from controlplane.fleet.model import Fleet
from controlplane.keda import externalscaler_pb2_grpc
from controlplane.obs.metrics import Metrics
from controlplane.rollout.controller import RolloutController
from controlplane.v1 import autoscaling_pb2_grpc, endpoint_pb2_grpc, proxy_pb2_grpc, rollout_pb2_grpc
from controlplane.xds.server import ProxyRegistry

log = structlog.get_logger("controlplane")


def admin_server(
    listen: str,
    token_file: Path | None,
    readonly_token_file: Path | None,
    state_dir: Path,
    rollouts: RolloutController,
    drains: EndpointDrains,
    source_of: Callable[[str, str, str], tuple[str, float | None]],
    registry: ProxyRegistry,
    weights: WeightController,
    metrics: Metrics,
    health_servicer: health.aio.HealthServicer,
) -> tuple[grpc.aio.Server, int]:
    """The operator API: bearer-token auth (the token created on first start), reflection and
    health (both open); and its bound port. OSError naming --admin-listen if it cannot listen;
    auth.TokenFileError for a token file that cannot be used."""
    token, where, created = auth.load_or_create_token(token_file, state_dir)
    read_only = auth.read_token(readonly_token_file) if readonly_token_file else None
    # cpctl finds the token by itself only at its default path.
    hint = (
        "cpctl reads it from there"
        if where == DEFAULT_STATE_DIR / TOKEN_FILE_NAME
        else "point cpctl at it: --token-file or CPCTL_TOKEN_FILE"
    )
    log.info(
        "admin token created (mode 0600)" if created else "admin token loaded",
        token_file=str(where),
        cpctl=hint,
    )
    tokens = auth.Tokens(token, read_only)
    server = grpc.aio.server(interceptors=[auth.TokenAuth(tokens)], options=[("grpc.so_reuseport", 0)])
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutService(rollouts, tokens, metrics), server)
    endpoint_pb2_grpc.add_EndpointServiceServicer_to_server(
        EndpointService(rollouts, tokens, metrics, source_of, drains, weights.picker_queues), server
    )
    proxy_pb2_grpc.add_ProxyServiceServicer_to_server(
        ProxyService(rollouts, tokens, metrics, registry), server
    )
    autoscaling_pb2_grpc.add_AutoscalingServiceServicer_to_server(
        AutoscalingService(rollouts, tokens, metrics, weights), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as e:
        raise OSError(f"--admin-listen {listen}: cannot listen ({e})") from e
    return server, port


def scaler_server(
    listen: str,
    autoscaler: Autoscaler,
    fleet: Callable[[], Fleet | None],
    health_servicer: health.aio.HealthServicer,
) -> tuple[grpc.aio.Server, int]:
    """KEDA's external scaler: read-only desired replicas and activity per model; and its
    bound port. OSError naming --scaler-listen if it cannot listen."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    externalscaler_pb2_grpc.add_ExternalScalerServicer_to_server(ExternalScaler(autoscaler, fleet), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (keda.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as e:
        raise OSError(f"--scaler-listen {listen}: cannot listen ({e})") from e
    return server, port
