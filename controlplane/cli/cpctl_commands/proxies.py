"""`cpctl proxies`: the connected proxies and their xDS sync status."""

from __future__ import annotations

import argparse

from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands.client import Client
from controlplane.cli.cpctl_commands.command import EXIT_OK, Leaves, add_output_flag, emit


def add_parser(groups: argparse._SubParsersAction[argparse.ArgumentParser], leaves: Leaves) -> None:
    """Add the `proxies` command to `groups`."""
    s = leaves.add(
        groups,
        "proxies",
        "connected proxies and their xDS sync status",
        "One row per connected xDS stream (Envoy or proxyless gRPC) with the status of each "
        "type: SYNCED, STALE (an update not ACKed yet), NACKED, NOT_SENT; then the last NACKs.",
        "cpctl proxies -o yaml",
    )
    add_output_flag(s)
    s.set_defaults(func=cmd_proxies)


def cmd_proxies(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import proxy_pb2

    ps = list(c.call(c.proxies.List, proxy_pb2.ListProxiesRequest()).proxies)
    if args.output == "table":
        emit(out.proxies_table(ps))
    else:
        emit(out.dump({"proxies": [out.proxy_to_dict(p) for p in ps]}, args.output))
    return EXIT_OK
