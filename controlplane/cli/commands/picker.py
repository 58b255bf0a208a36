"""`controlplane picker`: a per-request endpoint picker (Envoy ext_proc) for models with
`balancing: picker` (docs/picker.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from controlplane.cli import argtypes


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `picker` and its flags to `sub`."""
    pk = sub.add_parser(
        "picker",
        help="run a per-request endpoint picker for models with balancing: picker",
        description="Run an endpoint picker: Envoy asks it (ext_proc) which server takes each "
        "request of a model with `balancing: picker`, and routes by the control plane's weights "
        "whenever it does not answer in time. It learns the servers, their weights and which are "
        "held out or draining from the control plane over ADS. Several may run; list them all "
        "in the fleet file's picker.endpoints. Runs until SIGINT or SIGTERM. See docs/picker.md.",
    )
    pk.add_argument(
        "--control-plane",
        required=True,
        metavar="HOST:PORT",
        help="the control plane's xDS address (its serve --xds-listen)",
    )
    pk.add_argument(
        "--listen",
        default="127.0.0.1:18090",
        metavar="HOST:PORT",
        help="where Envoy reaches this picker over gRPC (default: %(default)s, loopback only)",
    )
    pk.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on this address (default: none)",
    )
    pk.add_argument(
        "--admin",
        metavar="HOST:PORT",
        help="the control plane's operator API (its serve --admin-listen): read every server's "
        "running and waiting requests and capacity there, so that picks follow the servers' own "
        "pages (default: none; then picks follow the EDS weights)",
    )
    pk.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="a token of the operator API for --admin (the read-only one is enough)",
    )
    pk.add_argument(
        "--loads-interval",
        type=argtypes.number(0.05, 60),
        default=0.25,
        metavar="SECONDS",
        help="how often the loads are read from --admin (default: %(default)s)",
    )
    pk.add_argument(
        "--prefix-entries",
        type=argtypes.number(0, 10_000_000),
        default=65536,
        metavar="N",
        help="prefix keys remembered, least recently used dropped first; each is about 200 bytes "
        "(default: %(default)s; 0 turns the prefix index off). Keys come from the gateway's "
        "prefix hash, for models with affinity: {prefix: ...}",
    )
    pk.add_argument(
        "--prefix-load-bound",
        type=argtypes.number(1.0, 100),
        default=1.5,
        metavar="X",
        help="a request goes back to the server its prefix went to while that server's expected "
        "time is at most X times the mean of the eligible servers' (default: %(default)s)",
    )
    pk.add_argument(
        "--peers",
        default="",
        metavar="HOST:PORT,...",
        help="the other pickers' --listen addresses: each reads the others' requests in flight "
        "every --peers-interval and ranks by all of them, so several pickers choose as one "
        "would (default: none)",
    )
    pk.add_argument(
        "--peers-interval",
        type=argtypes.number(0.01, 10),
        default=0.05,
        metavar="SECONDS",
        help="how often the --peers are read (default: %(default)s)",
    )
    pk.add_argument("--node-id", help="its node id on the control plane (default: picker-PID)")
    pk.add_argument("--log-format", choices=("console", "json"), default="console")
    pk.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    """`controlplane picker`: read the token for --admin (exit 2), then serve until a signal."""
    from controlplane.obs.logging import configure_logging
    from controlplane.picker.service import serve

    configure_logging(args.log_format, args.log_level)
    token = None
    if args.admin is not None:
        if args.token_file is None:
            print(
                "controlplane picker: --admin needs --token-file (the read-only token is enough)",
                file=sys.stderr,
            )
            return 2
        try:
            token = args.token_file.read_text().strip()
        except OSError as e:
            print(f"controlplane picker: --token-file: {e}", file=sys.stderr)
            return 2
    try:
        asyncio.run(
            serve(
                args.control_plane,
                args.listen,
                args.metrics_listen,
                args.node_id,
                admin=args.admin,
                token=token,
                loads_interval_s=args.loads_interval,
                prefix_entries=int(args.prefix_entries),
                prefix_bound=args.prefix_load_bound,
                peers=[p.strip() for p in args.peers.split(",") if p.strip()],
                peers_interval_s=args.peers_interval,
            )
        )
    except OSError as e:
        print(f"controlplane picker: {e}", file=sys.stderr)
        return 1
    return 0
