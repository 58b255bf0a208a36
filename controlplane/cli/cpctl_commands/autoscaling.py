"""`cpctl autoscaling list`: what the autoscaler wants for each model, and why."""

from __future__ import annotations

import argparse

from controlplane.cli import argtypes
from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands.client import Client
from controlplane.cli.cpctl_commands.command import EXIT_OK, Formatter, Leaves, add_output_flag, emit


def add_parser(groups: argparse._SubParsersAction[argparse.ArgumentParser], leaves: Leaves) -> None:
    """Add the `autoscaling` group and its commands to `groups`."""
    scaling = groups.add_parser(
        "autoscaling",
        help="what the autoscaler wants for each model, and why",
        description="Autoscaling: desired replicas per model and version, and what a scale-down drains.",
        epilog="example:\n  cpctl autoscaling list llama",
        formatter_class=Formatter,
    )
    ss = scaling.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = leaves.add(
        ss,
        "list",
        "desired replicas of every model (or MODEL), and why",
        "The autoscaler's latest decision for every model (version (all)) and each of its versions: "
        "desired and ready replicas, demand, target per replica, forecast and reason; then the "
        "endpoints a scale-down would drain next, and those draining now.",
        "cpctl autoscaling list llama -o json",
    )
    s.add_argument(
        "model", nargs="?", default="", metavar="MODEL", type=argtypes.name_or_all, help="only this model"
    )
    add_output_flag(s)
    s.set_defaults(func=cmd_autoscaling)


def cmd_autoscaling(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import autoscaling_pb2

    rows = list(c.call(c.autoscaling.List, autoscaling_pb2.ListAutoscalingRequest(model=args.model)).scaling)
    if args.output == "table":
        emit(out.scaling_table(rows))
    else:
        emit(out.dump({"scaling": [out.scaling_to_dict(s) for s in rows]}, args.output))
    return EXIT_OK
