"""How a side process (`controlplane picker`, `controlplane ratelimit`) runs its gRPC server:
listen, serve its own Prometheus registry, run its background loops, and stop everything
cleanly on SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from controlplane.obs.http import split_host_port
from controlplane.process.stop import stop_on_signals


async def serve_until_signalled(
    server: grpc.aio.Server,
    listen: str,
    metrics_listen: str | None,
    registry: CollectorRegistry,
    background: list[Coroutine[Any, Any, None]],
    on_started: Any = None,
) -> None:
    """Serve `server` on `listen` (OSError if it cannot), `registry` on `metrics_listen`, and
    the `background` loops, until SIGINT or SIGTERM; then cancel the loops and stop both
    servers. `on_started()` runs once everything listens (a log line)."""
    if server.add_insecure_port(listen) == 0:
        for coro in background:
            coro.close()
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    status = None
    if metrics_listen:
        host, port = split_host_port(metrics_listen)
        status, _ = start_http_server(port, host, registry=registry)
    if on_started is not None:
        on_started()
    tasks = [asyncio.create_task(coro) for coro in background]
    try:
        with stop_on_signals() as stop:
            await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.stop(1.0)
        if status is not None:
            status.shutdown()
