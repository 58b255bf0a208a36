"""`cpctl quota status`: each tenant's buckets, asked of the rate-limit service
(`controlplane ratelimit`, its `controlplane.v1.QuotaService`), not of the control plane, a
page at a time."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands.client import Client
from controlplane.cli.cpctl_commands.command import (
    EXIT_AUTH,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Formatter,
    Leaves,
    add_output_flag,
    emit,
)

PAGE_SIZE = 1000  # the most the service gives in one page
MAX_PAGES = 100_000  # a service that never ends its pages is cut off here


def add_parser(groups: argparse._SubParsersAction[argparse.ArgumentParser], leaves: Leaves) -> None:
    """Add the `quota` group and its commands to `groups`."""
    quota = groups.add_parser(
        "quota",
        help="per-tenant quotas: what each tenant has used and has left",
        description="Quotas (docs/quotas.md): the rate-limit service's buckets.",
        epilog="example:\n  cpctl quota status acme",
        formatter_class=Formatter,
    )
    qs = quota.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = leaves.add(
        qs,
        "status",
        "each tenant's limit, remaining and reset, per model and kind",
        "Asks the rate-limit service (`controlplane ratelimit`, --quota-service) for every bucket "
        "in use, or TENANT's, page by page: requests or tokens per minute, what is left now and "
        "how long until it is whole again. The service must run with --token-file holding the "
        "token cpctl sends: its usual one when that is the control plane's admin token file, "
        "else pass the service's file with --token-file. Tenants not seen since the service "
        "started (or for two minutes, on Redis) have their whole allowance and are not listed.",
        "cpctl quota status acme --quota-service 127.0.0.1:18081",
    )
    s.add_argument("tenant", nargs="?", default=None, metavar="TENANT", help="only this tenant")
    s.add_argument(
        "--quota-service",
        default=os.environ.get("CPCTL_QUOTA_SERVICE", "127.0.0.1:18081"),
        metavar="HOST:PORT",
        help="the rate-limit service's --listen (default: $CPCTL_QUOTA_SERVICE or %(default)s)",
    )
    s.add_argument(
        "--quota-tls-ca",
        type=Path,
        metavar="FILE",
        help="reach the service over TLS, trusting this CA (PEM) for its certificate (it runs with "
        "--tls-cert); docs/quotas.md#trust",
    )
    s.add_argument(
        "--quota-tls-cert",
        type=Path,
        metavar="FILE",
        help="the client certificate (PEM) to present, with --quota-tls-key: a service with "
        "--tls-client-ca requires one its CA signed",
    )
    s.add_argument("--quota-tls-key", type=Path, metavar="FILE", help="the private key of --quota-tls-cert")
    s.add_argument(
        "--quota-tls-server-name",
        metavar="NAME",
        help="the name to verify the service's certificate for (default: the host of --quota-service)",
    )
    add_output_flag(s)
    s.set_defaults(func=cmd_quota_status)


def _credentials(args: argparse.Namespace) -> Any:
    """TLS channel credentials from the --quota-tls-* flags, or None for plaintext."""
    import grpc

    if not (args.quota_tls_ca or args.quota_tls_cert or args.quota_tls_key or args.quota_tls_server_name):
        return None
    if args.quota_tls_ca is None:
        raise CliError(
            "--quota-tls-ca: needed to reach the service over TLS (the CA of its certificate)", EXIT_USAGE
        )
    if bool(args.quota_tls_cert) != bool(args.quota_tls_key):
        raise CliError("--quota-tls-cert and --quota-tls-key go together", EXIT_USAGE)

    def read(flag: str, path: Path | None) -> bytes | None:
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError as e:
            raise CliError(f"{flag} {path}: cannot read ({e.strerror or e})", EXIT_USAGE) from None

    return grpc.ssl_channel_credentials(
        root_certificates=read("--quota-tls-ca", args.quota_tls_ca),
        private_key=read("--quota-tls-key", args.quota_tls_key),
        certificate_chain=read("--quota-tls-cert", args.quota_tls_cert),
    )


def _error(e: Any, service: str, token_source: str) -> CliError:
    """A failed status call as one line naming what to check, with its exit code."""
    import grpc

    code = e.code() if isinstance(e, grpc.Call) else None
    details = " ".join(str((e.details() if isinstance(e, grpc.Call) else None) or e or "no details").split())
    name = code.name if code is not None else "UNKNOWN"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return CliError(
            f"{name}: {details}; cpctl sent the token from {token_source}: the rate-limit service at "
            f"{service} takes only the token in its --token-file (pass that file with --token-file)",
            EXIT_AUTH,
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return CliError(
            f"{name}: {details}; is the rate-limit service running at {service}? (--quota-service "
            "or CPCTL_QUOTA_SERVICE; over TLS, --quota-tls-ca and, for mutual TLS, "
            "--quota-tls-cert/--quota-tls-key)",
            EXIT_ERROR,
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CliError(f"{name}: {details} (raise --request-timeout?)", EXIT_ERROR)
    return CliError(
        f"{name}: {details}", EXIT_USAGE if code == grpc.StatusCode.INVALID_ARGUMENT else EXIT_ERROR
    )


def fetch_buckets(c: Client, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every page of the service's answer, as rows sorted by tenant, model and kind (a bucket
    a Redis scan gave twice, once)."""
    import grpc

    from controlplane.v1 import quota_pb2, quota_pb2_grpc

    if ":" not in args.quota_service:
        raise CliError(f"--quota-service: expected HOST:PORT, got {args.quota_service!r}", EXIT_USAGE)
    credentials = _credentials(args)
    options = (
        [("grpc.ssl_target_name_override", args.quota_tls_server_name)] if args.quota_tls_server_name else []
    )
    channel = (
        grpc.secure_channel(args.quota_service, credentials, options=options)
        if credentials is not None
        else grpc.insecure_channel(args.quota_service)
    )
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    with channel:
        stub = quota_pb2_grpc.QuotaServiceStub(channel)
        token = ""
        for _ in range(MAX_PAGES):
            request = quota_pb2.QuotaStatusRequest(
                tenant=args.tenant or "", page_size=PAGE_SIZE, page_token=token
            )
            try:
                page = stub.Status(request, timeout=c.timeout, metadata=c.metadata)
            except grpc.RpcError as e:
                raise _error(e, args.quota_service, c.token_source) from None
            for b in page.buckets:
                rows[(b.tenant, b.model, b.kind)] = {
                    "tenant": b.tenant,
                    "model": b.model,
                    "kind": b.kind,
                    "limit_per_minute": b.limit_per_minute,
                    "remaining": b.remaining,
                    "reset_seconds": b.reset_seconds,
                }
            token = page.next_page_token
            if not token:
                break
        else:
            raise CliError(
                f"the service at {args.quota_service} gave more than {MAX_PAGES} pages", EXIT_ERROR
            )
    return [rows[k] for k in sorted(rows)]


def cmd_quota_status(c: Client, args: argparse.Namespace) -> int:
    rows = fetch_buckets(c, args)
    if args.output == "json":
        emit(out.quota_json(rows))
    elif args.output != "table":
        emit(out.dump({"buckets": rows}, args.output))
    elif not rows:
        emit("no bucket in use" + (f" for {args.tenant}" if args.tenant else ""))
    else:
        emit(out.table(["TENANT", "MODEL", "KIND", "LIMIT/MIN", "REMAINING", "RESET"], out.quota_rows(rows)))
    return EXIT_OK
