"""`cpctl rollout ...`: start, status (-w), pause, resume, promote, abort, undo, list and
history of a model's canary rollouts."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any

from controlplane.cli import argtypes
from controlplane.cli import cpctl_output as out
from controlplane.cli.cpctl_commands.client import Client
from controlplane.cli.cpctl_commands.command import (
    EXIT_ABORTED,
    EXIT_OK,
    Formatter,
    Leaves,
    add_output_flag,
    emit,
)

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def add_parser(groups: argparse._SubParsersAction[argparse.ArgumentParser], leaves: Leaves) -> None:
    """Add the `rollout` group and its commands to `groups`."""
    rollout = groups.add_parser(
        "rollout",
        help="move a model's traffic to a new version in steps",
        description="Canary rollouts: start, watch, pause, resume, promote, abort, undo, history.",
        epilog="example:\n  cpctl rollout start llama --to v2 --manual",
        formatter_class=Formatter,
    )
    rs = rollout.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = leaves.add(
        rs,
        "start",
        "start moving MODEL's traffic to --to VERSION",
        "Start a rollout: the canary VERSION gets each --steps percent in turn, holding each step "
        "for --interval (or until `cpctl rollout promote` with --manual) while its error rate and "
        "p99 latency are compared with the stable version's; a failed analysis aborts at once. "
        "Unset options take the server's defaults. The settings are checked here with the "
        "server's own rules (steps increase and end at 100, ...): a bad one exits 2.",
        "cpctl rollout start llama --to v2 --steps 5,25,50,100 --interval 30s",
    )
    s.add_argument("model", metavar="MODEL", type=argtypes.name, help="the model, as clients name it")
    s.add_argument(
        "--to",
        dest="to_version",
        required=True,
        metavar="VERSION",
        type=argtypes.name,
        help="the version to roll to",
    )
    s.add_argument(
        "--steps",
        type=argtypes.parse_steps,
        metavar="P,P,...",
        help="canary percents, increasing, ending at 100 (default: 5,25,50,100)",
    )
    gate = s.add_mutually_exclusive_group()
    gate.add_argument(
        "--interval",
        type=argtypes.parse_duration,
        metavar="DURATION",
        help="hold each step this long (default: 30s)",
    )
    gate.add_argument("--manual", action="store_true", help="advance only on `cpctl rollout promote`")
    s.add_argument(
        "--max-error-rate",
        type=argtypes.non_negative_number,
        metavar="RATE",
        help="abort above this canary error rate, 0-1 (0.01)",
    )
    s.add_argument(
        "--max-latency-ratio",
        type=argtypes.non_negative_number,
        metavar="X",
        help="abort above canary p99 / stable p99, at least 1 (1.5)",
    )
    s.add_argument(
        "--min-requests",
        type=argtypes.count,
        metavar="N",
        help="canary requests before a step is judged (50)",
    )
    s.add_argument(
        "--ack-deadline",
        type=argtypes.parse_duration,
        metavar="DURATION",
        help="pause if a proxy lacks the canary's cluster after this long (30s)",
    )
    s.add_argument(
        "--shadow",
        type=argtypes.percent,
        metavar="PERCENT",
        help="also mirror this percent of requests to the canary while the rollout runs; the "
        "mirrored responses are discarded but count in the analysis (default: 0)",
    )
    add_output_flag(s)
    s.set_defaults(func=cmd_start, check=start_problem)

    s = leaves.add(
        rs,
        "status",
        "show MODEL's latest rollout",
        "Show the model's latest rollout: phase, step, weights per version and the canary's "
        "analysis against stable. With -w, follow it until it ends (exit 3 if it is aborted): "
        "on a terminal the view is redrawn; otherwise one line is printed per change (with -o "
        "json or yaml, one document per change).",
        "cpctl rollout status llama -w -o json",
    )
    s.add_argument("model", metavar="MODEL", type=argtypes.name)
    s.add_argument("-w", "--watch", action="store_true", help="follow every change until the rollout ends")
    add_output_flag(s)
    s.set_defaults(func=cmd_status)

    for name, summary, description in (
        ("pause", "hold MODEL's rollout at its step", "Hold the rollout at its current weights."),
        ("resume", "carry on a paused rollout", "Carry on a paused rollout from its step."),
        (
            "abort",
            "send all of MODEL's traffic back to stable",
            "All traffic back to the stable version at once; the canary's endpoints drain.",
        ),
        (
            "undo",
            "roll a completed rollout back",
            "Start a new rollout, with the same settings, back to the version a completed rollout replaced.",
        ),
    ):
        s = leaves.add(rs, name, summary, description, f"cpctl rollout {name} llama")
        s.add_argument("model", metavar="MODEL", type=argtypes.name)
        if name in ("pause", "abort"):
            s.add_argument(
                "--reason", default="", metavar="TEXT", type=argtypes.reason, help="why, for the audit trail"
            )
        add_output_flag(s)
        s.set_defaults(func=cmd_command, method=name.capitalize())

    s = leaves.add(
        rs,
        "promote",
        "move MODEL's rollout one step on",
        "Move the rollout to its next step now, or with --full straight to 100% and completion.",
        "cpctl rollout promote llama --full",
    )
    s.add_argument("model", metavar="MODEL", type=argtypes.name)
    s.add_argument("--full", action="store_true", help="to 100%% at once: the canary becomes stable")
    add_output_flag(s)
    s.set_defaults(func=cmd_command, method="Promote")

    s = leaves.add(
        rs,
        "list",
        "the latest rollout of every model",
        "The latest rollout of every model.",
        "cpctl rollout list",
    )
    add_output_flag(s)
    s.set_defaults(func=cmd_list)

    s = leaves.add(
        rs,
        "history",
        "MODEL's audit trail",
        "Who did what to the model's rollouts and drains, when and why (the table's times are "
        "local; -o json and yaml give them in RFC 3339, UTC).",
        "cpctl rollout history llama",
    )
    s.add_argument("model", metavar="MODEL", type=argtypes.name)
    add_output_flag(s)
    s.set_defaults(func=cmd_history)


def start_problem(args: argparse.Namespace) -> str | None:
    """What the server would refuse as INVALID_ARGUMENT in `rollout start`'s settings, found
    with its own rule (RolloutSpec.check, over the same defaults); None if nothing."""
    from controlplane.rollout.machine import RolloutRejected, RolloutSpec

    d = RolloutSpec(args.model, "", args.to_version)  # the stable version is the server's to know
    spec = replace(
        d,
        steps=tuple(args.steps) if args.steps else d.steps,
        interval_s=None if args.manual else (args.interval or d.interval_s),
        max_error_rate=d.max_error_rate if args.max_error_rate is None else args.max_error_rate,
        max_latency_ratio=d.max_latency_ratio if args.max_latency_ratio is None else args.max_latency_ratio,
        min_requests=d.min_requests if args.min_requests is None else args.min_requests,
        ack_deadline_s=d.ack_deadline_s if args.ack_deadline is None else args.ack_deadline,
        shadow_percent=args.shadow or 0,
    )
    try:
        spec.check()
    except RolloutRejected as e:
        return str(e)
    return None


def _emit_rollout(r: Any, fmt: str) -> None:
    """A command's resulting rollout: its summary line, or the whole rollout as a document."""
    emit(out.summary_line(r) if fmt == "table" else out.dump(out.rollout_to_dict(r), fmt))


def start_request(args: argparse.Namespace) -> Any:
    """`rollout start`'s arguments as a StartRolloutRequest: only the fields given are set,
    so the server's defaults apply to the rest."""
    from controlplane.v1 import rollout_pb2

    req = rollout_pb2.StartRolloutRequest(model=args.model, to_version=args.to_version, manual=args.manual)
    if args.steps:
        req.steps.extend(args.steps)
    if args.interval is not None:
        req.interval_seconds = args.interval
    if args.shadow is not None:
        req.shadow_percent = args.shadow
    for field, value in (
        ("max_error_rate", args.max_error_rate),
        ("max_latency_ratio", args.max_latency_ratio),
        ("min_requests", args.min_requests),
        ("ack_deadline_seconds", args.ack_deadline),
    ):
        if value is not None:
            setattr(req, field, value)
    return req


def cmd_start(c: Client, args: argparse.Namespace) -> int:
    _emit_rollout(c.call(c.rollouts.Start, start_request(args)), args.output)
    return EXIT_OK


def cmd_command(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import rollout_pb2

    req = rollout_pb2.RolloutCommand(
        model=args.model, full=getattr(args, "full", False), reason=getattr(args, "reason", "")
    )
    _emit_rollout(c.call(getattr(c.rollouts, args.method), req), args.output)
    return EXIT_OK


class RolloutWatch:
    """What `rollout status -w` prints for each rollout the stream brings: on a terminal, the
    table redrawn; otherwise one line per change of state (`out.watch_state`); with -o json
    or yaml, one document per change (a document equal to the last one is not repeated)."""

    def __init__(self, fmt: str, tty: bool) -> None:
        self.fmt = fmt
        self.tty = tty
        self.last: Any = None  # what was last printed: a state or a document

    def text(self, r: Any, now: float) -> str | None:
        """The text to print for `r` (None: nothing changed), without its final newline."""
        if self.fmt != "table":
            doc = out.rollout_to_dict(r)
            if doc == self.last:
                return None
            self.last = doc
            text = out.dump(doc, self.fmt, one_line=True)
            return "---\n" + text if self.fmt == "yaml" else text
        clock = time.strftime("%H:%M:%S", time.localtime(now))
        if self.tty:
            return (
                CLEAR_SCREEN
                + out.rollout_table(r, now=now)
                + f"\n\n(watching; updated {clock}; Ctrl-C stops)"
            )
        state = out.watch_state(r)
        if state == self.last:
            return None
        self.last = state
        return out.watch_line(r, clock)


def cmd_status(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import rollout_pb2

    req = rollout_pb2.GetRolloutRequest(model=args.model)
    if not args.watch:
        r = c.call(c.rollouts.Get, req)
        fmt = args.output
        emit(
            out.rollout_table(r, now=time.time()) if fmt == "table" else out.dump(out.rollout_to_dict(r), fmt)
        )
        return EXIT_OK
    watch = RolloutWatch(args.output, sys.stdout.isatty())
    last = None
    stream = c.stream(c.rollouts.Watch, req)
    try:
        for r in stream:
            text = watch.text(r, time.time())
            if text is not None:
                emit(text)
            last = r
    finally:
        stream.cancel()
    return EXIT_ABORTED if last is not None and last.phase == "Aborted" else EXIT_OK


def cmd_list(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import rollout_pb2

    rs = list(c.call(c.rollouts.List, rollout_pb2.ListRolloutsRequest()).rollouts)
    if args.output == "table":
        emit(out.rollouts_table(rs))
    else:
        emit(out.dump({"rollouts": [out.rollout_to_dict(r) for r in rs]}, args.output))
    return EXIT_OK


def cmd_history(c: Client, args: argparse.Namespace) -> int:
    from controlplane.v1 import rollout_pb2

    records = list(c.call(c.rollouts.History, rollout_pb2.GetRolloutRequest(model=args.model)).records)
    if args.output == "table":
        emit(out.history_table(records))
    else:
        doc = {"model": args.model, "records": [out.record_to_dict(a) for a in records]}
        emit(out.dump(doc, args.output))
    return EXIT_OK
