"""Bearer-token authentication for the operator API.

Every `controlplane.v1` method needs `authorization: Bearer <token>`. The admin token may
call everything; the optional read-only token only the methods that change nothing.
Reflection and `grpc.health.v1` stay open, so `grpcurl list` and probes work without one.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from controlplane.admin.defaults import TOKEN_FILE_NAME

PROTECTED_PREFIX = "/controlplane.v1."
READ_ONLY_METHODS = frozenset(
    {
        "/controlplane.v1.RolloutService/Get",
        "/controlplane.v1.RolloutService/List",
        "/controlplane.v1.RolloutService/Watch",
        "/controlplane.v1.RolloutService/History",
        "/controlplane.v1.EndpointService/List",
        # a picker's queue lengths: demand for the autoscaler, bounded (flow/demand.py)
        "/controlplane.v1.EndpointService/ReportQueued",
        "/controlplane.v1.ProxyService/List",
        "/controlplane.v1.ProxyService/ServerVersion",
        "/controlplane.v1.AutoscalingService/List",
    }
)
USER_METADATA = "x-cpctl-user"  # optional, sent by cpctl: recorded in the audit trail


class TokenFileError(Exception):
    pass


def read_token(path: Path) -> str:
    """The token in `path` (surrounding whitespace ignored); TokenFileError naming the problem."""
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise TokenFileError(f"{path}: cannot read the token file ({e.strerror or e})") from None
    if not token:
        raise TokenFileError(f"{path}: the token file is empty")
    if any(c.isspace() for c in token):
        raise TokenFileError(f"{path}: a token is one word, with no whitespace inside")
    return token


def load_or_create_token(token_file: Path | None, state_dir: Path) -> tuple[str, Path, bool]:
    """(token, where it is, whether it was just created). Without `token_file`, use
    `<state_dir>/admin-token`, creating it with mode 0600 on first start."""
    if token_file is not None:
        return read_token(token_file), token_file, False
    path = state_dir / TOKEN_FILE_NAME
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(path), path, False
    with os.fdopen(fd, "w") as f:
        token = secrets.token_urlsafe(32)
        f.write(token + "\n")
    return token, path, True


@dataclass(frozen=True)
class Tokens:
    admin: str
    read_only: str | None = None

    def role_of(self, authorization: str | None) -> str | None:
        """admin, read-only, or None for a missing or wrong credential."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        token = token.strip()
        if hmac.compare_digest(token.encode(), self.admin.encode()):
            return "admin"
        if self.read_only is not None and hmac.compare_digest(token.encode(), self.read_only.encode()):
            return "read-only"
        return None


def _denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        unary, handler.request_deserializer, handler.response_serializer
    )


class TokenAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answers UNAUTHENTICATED without a valid token, PERMISSION_DENIED for a read-only token
    on a method that changes state."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith(PROTECTED_PREFIX):
            return handler
        md = dict(details.invocation_metadata or ())
        role = self.tokens.role_of(md.get("authorization"))
        if role is None:
            why = "no authorization metadata" if not md.get("authorization") else "the token is not valid"
            return _denied(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{why}: send 'authorization: Bearer <token>' (cpctl: --token-file or CPCTL_TOKEN)",
            )
        if role == "read-only" and method not in READ_ONLY_METHODS:
            return _denied(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method.rsplit('/', 1)[-1]} changes state; the read-only token cannot call it",
            )
        return handler
