"""`cpctl quota status`: each tenant's buckets, asked of the rate-limit service
(`controlplane ratelimit`), not of the control plane."""

from __future__ import annotations

import argparse
import json
import os

from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands.client import Client, rpc_error_line
from controlplane.cli.cpctl_commands.command import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Formatter,
    Leaves,
    add_output_flag,
    emit,
)


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
        "in use, or TENANT's: requests or tokens per minute, what is left now and how long until "
        "it is whole again. The service must run with --token-file holding the token cpctl sends "
        "(its usual one). Tenants not seen since the service started (or for two minutes, on "
        "Redis) have their whole allowance and are not listed.",
        "cpctl quota status acme --quota-service 127.0.0.1:18081",
    )
    s.add_argument("tenant", nargs="?", default=None, metavar="TENANT", help="only this tenant")
    s.add_argument(
        "--quota-service",
        default=os.environ.get("CPCTL_QUOTA_SERVICE", "127.0.0.1:18081"),
        metavar="HOST:PORT",
        help="the rate-limit service's --listen (default: $CPCTL_QUOTA_SERVICE or %(default)s)",
    )
    add_output_flag(s)
    s.set_defaults(func=cmd_quota_status)


def cmd_quota_status(c: Client, args: argparse.Namespace) -> int:
    import grpc

    from controlplane.quota.service import STATUS_SERVICE

    if ":" not in args.quota_service:
        raise CliError(f"--quota-service: expected HOST:PORT, got {args.quota_service!r}", EXIT_USAGE)
    with grpc.insecure_channel(args.quota_service) as channel:
        call = channel.unary_unary(f"/{STATUS_SERVICE}/Status")
        try:
            raw = call(json.dumps({"tenant": args.tenant}).encode(), timeout=c.timeout, metadata=c.metadata)
        except grpc.RpcError as e:
            line, code = rpc_error_line(e, args.quota_service, c.token_source)
            raise CliError(line.removeprefix("cpctl: "), code) from None
    rows = json.loads(raw)["buckets"]
    if args.output != "table":
        emit(out.dump({"buckets": rows}, args.output))
    elif not rows:
        emit("no bucket in use" + (f" for {args.tenant}" if args.tenant else ""))
    else:
        cells = [
            [
                r["tenant"] or "(no key)",
                r["model"],
                r["kind"],
                str(r["limit_per_minute"]),
                str(r["remaining"]),
                f"{r['reset_seconds']:g}s",
            ]
            for r in rows
        ]
        emit(out.table(["TENANT", "MODEL", "KIND", "LIMIT/MIN", "REMAINING", "RESET"], cells))
    return EXIT_OK
