"""`controlplane ratelimit`: the rate-limit service that counts the fleet's per-tenant quotas
(docs/quotas.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.net.tls import ServerTls


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `ratelimit` and its flags to `sub`."""
    rl = sub.add_parser(
        "ratelimit",
        help="run the rate-limit service that counts the fleet's per-tenant quotas",
        description="Run the rate-limit service: every proxy asks it (Envoy's rate-limit protocol) "
        "before each request of a model, with the model and the tenant (the fleet's quotas.key "
        "header), and answers 429 with OpenAI-style x-ratelimit-* headers and error body once the "
        "tenant is over its quotas. Counters are in memory: run one, and list it in the fleet "
        "file's quotas.service.endpoints. Watches the fleet file as serve does (an edit that "
        "removes a limit waits until the file holds still). Runs until SIGINT or SIGTERM. See "
        "docs/quotas.md.",
    )
    rl.add_argument("--config", type=Path, required=True, metavar="FILE", help="the fleet file (its quotas:)")
    rl.add_argument(
        "--listen",
        default="127.0.0.1:18081",
        metavar="HOST:PORT",
        help="where proxies reach it over gRPC, and cpctl quota status asks it (default: "
        "%(default)s, loopback only). Beyond loopback it needs --tls-client-ca, or "
        "--allow-unauthenticated-clients",
    )
    rl.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="serve --listen over TLS with this certificate (PEM), with --tls-key; the fleet's "
        "quotas.service.tls tells proxies to verify it (docs/quotas.md#trust)",
    )
    rl.add_argument("--tls-key", type=Path, metavar="FILE", help="the private key of --tls-cert (PEM)")
    rl.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help="mutual TLS: every caller (each proxy, cpctl quota status) must present a "
        "certificate this CA signed",
    )
    rl.add_argument(
        "--allow-unauthenticated-clients",
        action="store_true",
        help="listen beyond loopback without --tls-client-ca: anyone who reaches --listen can then "
        "charge or refill any tenant's quota and grow the service's memory up to its bounds; only "
        "for a network that only proxies reach",
    )
    rl.add_argument(
        "--metrics-listen", metavar="HOST:PORT", help="serve Prometheus metrics here (default: none)"
    )
    rl.add_argument(
        "--store",
        default="memory",
        metavar="memory|redis://HOST:PORT[/DB]",
        help="where the counters live: this process's memory (one service), or Redis, shared by "
        "every service pointing at it, so several (one per control-plane replica) count as one. "
        "Redis down: requests are served without a limit (default: %(default)s)",
    )
    rl.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="a bearer token `cpctl quota status` must send. Give it the control plane's admin "
        "token file (serve's <state-dir>/admin-token) and cpctl's usual token works; any other "
        "file, and cpctl must be given the same one. Without it, status is refused",
    )
    rl.add_argument("--log-format", choices=("console", "json"), default="console")
    rl.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def check(args: argparse.Namespace) -> tuple[ServerTls | None, str | None]:
    """Every flag checked before anything starts: the addresses, --store, the TLS files, where
    it may listen without client certificates, the token. Returns (tls, token); ValueError
    with the one line to print."""
    from controlplane.admin.auth import TokenFileError, read_token
    from controlplane.net.tls import SIDE_FLAGS, ServerTls, TlsConfigInvalid, is_loopback, server_credentials
    from controlplane.obs.http import split_host_port

    for flag, value in (("--listen", args.listen), ("--metrics-listen", args.metrics_listen)):
        if value is not None:
            try:
                split_host_port(value)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
    if args.store != "memory" and not args.store.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--store: expected memory or redis://HOST:PORT[/DB], got {args.store!r}")
    tls = None
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together (--tls-client-ca needs both)")
        tls = ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)
        try:
            server_credentials(tls, SIDE_FLAGS)
        except TlsConfigInvalid as e:
            raise ValueError(str(e)) from None
    mutual = tls is not None and tls.client_ca is not None
    host = args.listen.rpartition(":")[0].strip("[]")
    if not mutual and not is_loopback(host) and not args.allow_unauthenticated_clients:
        raise ValueError(
            f"--listen {args.listen} is reachable from other machines, and without --tls-client-ca "
            "anyone who reaches it can charge or refill any tenant's quota: give --tls-cert, "
            "--tls-key and --tls-client-ca (mutual TLS), or --allow-unauthenticated-clients if only "
            "proxies reach that network (docs/quotas.md#trust)"
        )
    token = None
    if args.token_file is not None:
        try:
            token = read_token(args.token_file)
        except TokenFileError as e:
            raise ValueError(f"--token-file: {e}") from None
    return tls, token


def run(args: argparse.Namespace) -> int:
    """`controlplane ratelimit`: check every flag (exit 2), then serve until a signal; a fleet
    file it cannot use, or an address it cannot listen on, is one line and exit 2, as for serve."""
    from controlplane.fleet import FleetConfigInvalid
    from controlplane.obs.logging import configure_logging
    from controlplane.quota.service import serve

    configure_logging(args.log_format, args.log_level)
    try:
        tls, token = check(args)
    except ValueError as e:
        print(f"controlplane ratelimit: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(args.config, args.listen, args.metrics_listen, args.store, token, tls))
    except FleetConfigInvalid as e:
        print(f"controlplane ratelimit: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"controlplane ratelimit: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
