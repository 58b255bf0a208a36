"""`cpctl endpoints ...`: list the fleet's endpoints; drain one (--wait follows it to DRAINED)
and undrain it."""

from __future__ import annotations

import argparse
import time
from typing import Any

from controlplane.cli import argtypes
from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands.client import Client
from controlplane.cli.cpctl_commands.command import (
    EXIT_OK,
    CliError,
    Formatter,
    Leaves,
    add_output_flag,
    emit,
)

DEFAULT_DRAIN_TIMEOUT_S = 120.0  # the server's default (rollout.controller.DRAIN_TIMEOUT_S)
DRAIN_POLL_S = 0.5
DRAIN_GRACE_S = 30.0  # --wait gives up this long after the drain's own timeout


def add_parser(groups: argparse._SubParsersAction[argparse.ArgumentParser], leaves: Leaves) -> None:
    """Add the `endpoints` group and its commands to `groups`."""
    eps = groups.add_parser(
        "endpoints",
        help="list, drain and undrain GPU servers",
        description="Endpoints: their state, EDS weight and load; drain one for maintenance.",
        epilog="example:\n  cpctl endpoints list --model llama",
        formatter_class=Formatter,
    )
    es = eps.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = leaves.add(
        es,
        "list",
        "every endpoint with its state, weight and load",
        "Every endpoint of the fleet with its state (SERVING, HELD_OUT, DRAINING, DRAINED, RETIRED), "
        "EDS weight, load and latency.",
        "cpctl endpoints list --model llama -o json",
    )
    s.add_argument(
        "--model", default="", metavar="MODEL", type=argtypes.name_or_all, help="only this model's endpoints"
    )
    add_output_flag(s)
    s.set_defaults(func=cmd_endpoints)
    s = leaves.add(
        es,
        "drain",
        "stop sending ADDRESS new requests",
        "Mark the endpoint DRAINING (no new requests); once idle, or after --drain-timeout, it is "
        "removed from EDS (DRAINED). With -o json or yaml and --wait, the endpoint is printed "
        "once, DRAINED.",
        "cpctl endpoints drain 10.0.0.7:8000 --reason 'driver update' --wait",
        drain=True,
    )
    s.add_argument("address", metavar="ADDRESS", type=argtypes.name, help="HOST:PORT as in the fleet file")
    s.add_argument(
        "--drain-timeout",
        dest="drain_timeout",
        type=argtypes.parse_duration,
        metavar="DURATION",
        help="remove it after this even with requests in flight (default: 120s); here --timeout, "
        "its old name, still works but is deprecated",
    )
    s.add_argument(
        "--timeout",
        dest="drain_timeout",
        type=argtypes.parse_duration,
        metavar="DURATION",
        help=argparse.SUPPRESS,  # deprecated: the old name of --drain-timeout
    )
    s.add_argument(
        "--reason", default="", metavar="TEXT", type=argtypes.reason, help="why, for the audit trail"
    )
    s.add_argument("--wait", action="store_true", help="wait until it is DRAINED, printing progress")
    add_output_flag(s)
    s.set_defaults(func=cmd_drain)
    s = leaves.add(
        es,
        "undrain",
        "bring a draining or drained endpoint back",
        "Bring a draining or drained endpoint back into service.",
        "cpctl endpoints undrain 10.0.0.7:8000",
    )
    s.add_argument("address", metavar="ADDRESS", type=argtypes.name)
    add_output_flag(s)
    s.set_defaults(func=cmd_undrain)


def _emit_endpoint(e: Any, fmt: str) -> None:
    if fmt == "table":
        emit(f"{e.address} ({e.model} {e.version}): {e.state}")
    else:
        emit(out.dump(out.endpoint_to_dict(e), fmt))


def cmd_endpoints(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import endpoint_pb2

    eps = list(c.call(c.endpoints.List, endpoint_pb2.ListEndpointsRequest(model=args.model)).endpoints)
    if args.output == "table":
        emit(out.endpoints_table(eps))
    else:
        emit(out.dump({"endpoints": [out.endpoint_to_dict(e) for e in eps]}, args.output))
    return EXIT_OK


def cmd_drain(c: Client, args: argparse.Namespace) -> int:
    """Drain; with --wait, poll until DRAINED. A table shows the progress; -o json or yaml
    prints the endpoint once: as drained, or as DRAINING without --wait."""
    from controlplane.v1 import endpoint_pb2

    req = endpoint_pb2.DrainRequest(
        address=args.address, timeout_seconds=args.drain_timeout or 0, reason=args.reason
    )
    table = args.output == "table"
    e = c.call(c.endpoints.Drain, req)
    if table or not args.wait:
        _emit_endpoint(e, args.output)
    if not args.wait:
        return EXIT_OK
    give_up = (args.drain_timeout or DEFAULT_DRAIN_TIMEOUT_S) + DRAIN_GRACE_S
    start = time.monotonic()
    shown = (e.state, e.in_flight)
    while e.state != "DRAINED":
        if time.monotonic() - start > give_up:
            raise CliError(f"{args.address} is still {e.state} after {give_up:g}s; stopped waiting")
        time.sleep(DRAIN_POLL_S)
        found = [
            x
            for x in c.call(c.endpoints.List, endpoint_pb2.ListEndpointsRequest()).endpoints
            if x.address == args.address
        ]
        if not found:
            raise CliError(f"{args.address} is no longer in the fleet")
        e = found[0]
        if table and (e.state, e.in_flight) != shown and e.state != "DRAINED":
            shown = (e.state, e.in_flight)
            elapsed = time.monotonic() - start
            emit(f"  {out.seconds_text(elapsed):>6}  {e.state}, {out.number_text(e.in_flight)} in flight")
    if table:
        emit(f"{args.address}: DRAINED after {out.seconds_text(time.monotonic() - start)}")
    else:
        _emit_endpoint(e, args.output)
    return EXIT_OK


def cmd_undrain(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import endpoint_pb2

    _emit_endpoint(c.call(c.endpoints.Undrain, endpoint_pb2.DrainRequest(address=args.address)), args.output)
    return EXIT_OK
