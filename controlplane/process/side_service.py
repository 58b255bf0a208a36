"""How a side process (`controlplane picker`, `controlplane ratelimit`) runs its gRPC server:
listen (in plaintext, or with TLS credentials), serve its own Prometheus registry, run its
background loops, and stop everything cleanly on SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Coroutine
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from controlplane.obs.http import split_host_port
from controlplane.process.stop import stop_on_signals


def _bind_error(listen: str) -> str | None:
    """Why `listen` cannot be bound now (the OS's words: "Address already in use"), or None.
    Asked before gRPC binds: gRPC's own failure is a long line of its internals, logged on
    stderr by its C core besides."""
    try:
        host, port = split_host_port(listen)
    except ValueError as e:
        return str(e)
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return e.strerror or str(e)
    for family, kind, proto, _, address in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                s.bind(address)
            except OSError as e:
                return e.strerror or str(e)
    return None


async def serve_until_signalled(
    server: grpc.aio.Server,
    listen: str,
    metrics_listen: str | None,
    registry: CollectorRegistry,
    background: list[Coroutine[Any, Any, None]],
    on_started: Any = None,
    *,
    credentials: grpc.ServerCredentials | None = None,
    listen_flag: str = "--listen",
) -> None:
    """Serve `server` on `listen` (with TLS `credentials` if given), `registry` on
    `metrics_listen`, and the `background` loops, until SIGINT or SIGTERM; then cancel the
    loops and stop both servers. `on_started()` runs once everything listens (a log line).
    An address that cannot be listened on raises OSError with one line naming its flag
    (`listen_flag`, or --metrics-listen) and the reason, having started nothing."""
    try:
        reason = _bind_error(listen)
        if reason is None:
            try:
                bound = (
                    server.add_secure_port(listen, credentials)
                    if credentials is not None
                    else server.add_insecure_port(listen)
                )
            except RuntimeError:  # gRPC's words say nothing the check above did not
                bound = 0
            reason = None if bound else "gRPC could not bind it"
        if reason is not None:
            raise OSError(f"{listen_flag} {listen}: cannot listen ({reason})")
        await server.start()
        status = None
        if metrics_listen:
            try:
                host, port = split_host_port(metrics_listen)
                status, _ = start_http_server(port, host, registry=registry)
            except (OSError, ValueError) as e:
                await server.stop(None)
                why = (e.strerror if isinstance(e, OSError) else None) or str(e)
                raise OSError(f"--metrics-listen {metrics_listen}: cannot listen ({why})") from None
    except BaseException:
        for coro in background:
            coro.close()
        raise
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
