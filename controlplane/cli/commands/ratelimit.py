"""`controlplane ratelimit`: the rate-limit service that counts the fleet's per-tenant quotas
(docs/quotas.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `ratelimit` and its flags to `sub`."""
    rl = sub.add_parser(
        "ratelimit",
        help="run the rate-limit service that counts the fleet's per-tenant quotas",
        description="Run the rate-limit service: every proxy asks it (Envoy's rate-limit protocol) "
        "before each request of a model, with the model and the tenant (the fleet's quotas.key "
        "header), and answers 429 with OpenAI-style x-ratelimit-* headers and error body once the "
        "tenant is over its quotas. Counters are in memory: run one, and list it in the fleet "
        "file's quotas.service.endpoints. Re-reads the fleet file when it changes. Runs until "
        "SIGINT or SIGTERM. See docs/quotas.md.",
    )
    rl.add_argument("--config", type=Path, required=True, metavar="FILE", help="the fleet file (its quotas:)")
    rl.add_argument(
        "--listen",
        default="127.0.0.1:18081",
        metavar="HOST:PORT",
        help="where proxies reach it over gRPC (default: %(default)s, loopback only)",
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
        help="a bearer token `cpctl quota status` must send (the control plane's admin or "
        "read-only token, so cpctl's usual one works); without it, status is refused",
    )
    rl.add_argument("--log-format", choices=("console", "json"), default="console")
    rl.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    """`controlplane ratelimit`: check --store and --token-file (exit 2), then serve until a signal."""
    from controlplane.fleet import FleetConfigInvalid
    from controlplane.obs.logging import configure_logging
    from controlplane.quota.service import serve

    configure_logging(args.log_format, args.log_level)
    try:
        if args.store != "memory" and not args.store.startswith(("redis://", "rediss://", "unix://")):
            print(
                "controlplane ratelimit: --store: expected memory or redis://HOST:PORT[/DB], "
                f"got {args.store!r}",
                file=sys.stderr,
            )
            return 2
        token = None
        if args.token_file is not None:
            try:
                token = args.token_file.read_text().strip()
            except OSError as e:
                print(f"controlplane ratelimit: --token-file: {e}", file=sys.stderr)
                return 2
        asyncio.run(serve(args.config, args.listen, args.metrics_listen, args.store, token))
    except FleetConfigInvalid as e:
        print(f"controlplane ratelimit: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"controlplane ratelimit: {e}", file=sys.stderr)
        return 1
    return 0
