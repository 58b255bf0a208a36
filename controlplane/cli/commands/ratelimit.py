"""`controlplane ratelimit`: the rate-limit service that counts the fleet's per-tenant quotas
(docs/quotas.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from controlplane.cli.commands.side_listen import SideService, add_listen_flags, check_listen

if TYPE_CHECKING:
    from controlplane.net.tls import ServerTls


RATELIMIT = SideService(
    default_listen="127.0.0.1:18081",
    callers="proxies reach it over gRPC, and cpctl quota status asks it",
    tls_field="quotas.service.tls",
    mutual_callers="each proxy, cpctl quota status",
    mutual_extra="",
    harm="charge or refill any tenant's quota",
    harm_help="charge or refill any tenant's quota and grow the service's memory up to its bounds",
    trusted="proxies",
    docs="docs/quotas.md#trust",
)


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
    add_listen_flags(rl, RATELIMIT)
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

    tls = check_listen(args, RATELIMIT)
    if args.store != "memory" and not args.store.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--store: expected memory or redis://HOST:PORT[/DB], got {args.store!r}")
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
