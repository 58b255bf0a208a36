"""cpctl's connection to the operator API: the connection flags, where the server and the
token are found, the gRPC `Client` every command calls through, and a failed call's one line
and exit code (`rpc_error_line`)."""

from __future__ import annotations

import argparse
import contextlib
import getpass
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.admin.defaults import DEFAULT_ADMIN_LISTEN, DEFAULT_STATE_DIR, TOKEN_FILE_NAME
from controlplane.cli.argtypes import parse_duration
from controlplane.cli.cpctl_commands.command import EXIT_AUTH, EXIT_ERROR, EXIT_USAGE, CliError

DEFAULT_TOKEN_FILE = DEFAULT_STATE_DIR / TOKEN_FILE_NAME
DEFAULT_RPC_TIMEOUT_S = 10.0


def connection_flags(legacy_timeout: bool) -> argparse.ArgumentParser:
    """The global flags; SUPPRESS keeps a subcommand's unset flag from hiding one set before
    it. `--timeout` is the old spelling of --request-timeout, except on `endpoints drain`,
    where it always was the drain's own timeout."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument(
        "--server",
        metavar="HOST:PORT",
        default=argparse.SUPPRESS,
        help=f"the control plane's operator API (--admin-listen); default: $CPCTL_SERVER or "
        f"{DEFAULT_ADMIN_LISTEN}",
    )
    g.add_argument(
        "--token-file",
        metavar="FILE",
        type=Path,
        default=argparse.SUPPRESS,
        help=f"file holding the bearer token; default: the token in $CPCTL_TOKEN, else the file "
        f"$CPCTL_TOKEN_FILE, else {DEFAULT_TOKEN_FILE}",
    )
    g.add_argument(
        "--request-timeout",
        metavar="DURATION",
        type=parse_duration,
        default=argparse.SUPPRESS,
        help="deadline of each call to the server, e.g. 5s (default: 10s; a watch has none); "
        "--timeout, its old name, still works but is deprecated",
    )
    if legacy_timeout:
        g.add_argument(
            "--timeout",
            dest="request_timeout",
            metavar="DURATION",
            type=parse_duration,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,  # deprecated: the old name of --request-timeout
        )
    return p


def server_address(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """--server, else $CPCTL_SERVER, else the default address; a usage error (exit 2, from
    `parser`) if it is not HOST:PORT."""
    server = getattr(args, "server", None) or os.environ.get("CPCTL_SERVER") or DEFAULT_ADMIN_LISTEN
    if ":" not in server:
        parser.error(f"--server: expected HOST:PORT, got {server!r}")
    return server


@dataclass(frozen=True)
class Credential:
    """The bearer token, and where it was read (named in the hint for a refused token)."""

    token: str
    source: str  # the file's path, or $CPCTL_TOKEN


def resolve_token(token_file: Path | None, env: Mapping[str, str]) -> Credential:
    """--token-file, else $CPCTL_TOKEN (the token), else $CPCTL_TOKEN_FILE, else the default
    token file; CliError(exit 4) if none."""
    from controlplane.admin.auth import TokenFileError, read_token

    how = "pass --token-file FILE, or set CPCTL_TOKEN_FILE or CPCTL_TOKEN"
    if token_file is None and env.get("CPCTL_TOKEN", "").strip():
        token = env["CPCTL_TOKEN"].strip()
        if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
            raise CliError("CPCTL_TOKEN: a token is one word of printable ASCII", EXIT_AUTH)
        return Credential(token, "$CPCTL_TOKEN")
    if token_file is None and env.get("CPCTL_TOKEN_FILE", "").strip():
        token_file = Path(env["CPCTL_TOKEN_FILE"].strip()).expanduser()
    path = token_file or DEFAULT_TOKEN_FILE
    try:
        token = read_token(path)
    except TokenFileError as e:
        raise CliError(f"{e}; {how} (serve writes it to <state-dir>/{TOKEN_FILE_NAME})", EXIT_AUTH) from None
    if not token.isascii() or not token.isprintable():
        raise CliError(f"{path}: a token is one word of printable ASCII", EXIT_AUTH)
    return Credential(token, str(path))


def _user() -> str:
    user = os.environ.get("USER", "")
    if not user:
        with contextlib.suppress(Exception):
            user = getpass.getuser()
    return "".join(c if c.isascii() and c.isprintable() else "?" for c in user) or "unknown"


class Client:
    """A gRPC channel to the operator API, and its calls with token and user metadata."""

    def __init__(self, server: str, credential: Credential, timeout: float) -> None:
        import grpc

        from controlplane.v1 import autoscaling_pb2_grpc, endpoint_pb2_grpc, proxy_pb2_grpc, rollout_pb2_grpc

        self.server = server
        self.timeout = timeout
        self.token_source = credential.source
        self.metadata = (("authorization", f"Bearer {credential.token}"), ("x-cpctl-user", _user()))
        self.channel = grpc.insecure_channel(server)
        self.rollouts = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.endpoints = endpoint_pb2_grpc.EndpointServiceStub(self.channel)
        self.proxies = proxy_pb2_grpc.ProxyServiceStub(self.channel)
        self.autoscaling = autoscaling_pb2_grpc.AutoscalingServiceStub(self.channel)

    def call(self, method: Callable[..., Any], request: Any) -> Any:
        return method(request, timeout=self.timeout, metadata=self.metadata)

    def stream(self, method: Callable[..., Any], request: Any) -> Any:
        return method(request, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def connect(args: argparse.Namespace, server: str, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> Client:
    """A Client of `server` with the token found as resolve_token finds it (CliError if none)
    and --request-timeout, else `timeout`, as each call's deadline."""
    credential = resolve_token(getattr(args, "token_file", None), os.environ)
    return Client(server, credential, getattr(args, "request_timeout", timeout))


def rpc_error_line(e: Exception, server: str, token_source: str = "") -> tuple[str, int]:
    """A gRPC error as (the one line to print, the exit code). A refused token's line names
    where the token was read (`token_source`), since a stale file is the usual cause."""
    import grpc

    code = e.code() if isinstance(e, grpc.Call) else None
    details = (e.details() if isinstance(e, grpc.Call) else None) or str(e) or "no details"
    details = " ".join(str(details).split())
    name = code.name if code is not None else "UNKNOWN"
    if code == grpc.StatusCode.UNAVAILABLE:
        details += f"; is the control plane running at {server}? (--server or CPCTL_SERVER)"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        details += " (raise --request-timeout?)"
    elif code == grpc.StatusCode.UNAUTHENTICATED and token_source:
        details += (
            f"; cpctl sent the token from {token_source}: is it the one {server} uses? "
            f"(`serve --state-dir DIR` keeps it in DIR/{TOKEN_FILE_NAME})"
        )
    elif code == grpc.StatusCode.PERMISSION_DENIED and token_source:
        details += f" (the token from {token_source})"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        exit_code = EXIT_AUTH
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        exit_code = EXIT_USAGE  # the server found a bad argument: a usage error, as if found here
    else:
        exit_code = EXIT_ERROR
    return f"cpctl: {name}: {details}", exit_code
