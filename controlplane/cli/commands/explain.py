"""`controlplane explain MODEL`: its flags and the reconciling of -o with the older --format;
the explaining itself is controlplane/cli/explain.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from controlplane.admin.defaults import DEFAULT_ADMIN_LISTEN, DEFAULT_STATE_DIR
from controlplane.cli.commands.output_flag import OUTPUT_FORMATS, add_output_flag


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `explain` and its flags to `sub`."""
    x = sub.add_parser(
        "explain",
        help="show every effective setting of one model and where it comes from",
        description="Show how one model is served: each traffic-policy setting with its source "
        "(model override, tier or built-in default), what it becomes in Envoy, the model's memory "
        "need, and each endpoint's GPU class, memory, capacity and EDS priority (or why it is left "
        "out). Exits 1 if the config is invalid, 2 if the model is unknown.",
    )
    x.add_argument("model", metavar="MODEL", help="the model name, as clients send it")
    x.add_argument(
        "--config", required=True, type=Path, metavar="FILE", help="fleet YAML file, or - for standard input"
    )
    add_output_flag(x)
    x.add_argument(
        "--format",
        choices=["text", *OUTPUT_FORMATS],
        default=None,
        help="the same as -o (text is table), kept for existing scripts",
    )
    live = x.add_argument_group(
        "live state",
        "A model with several versions may be mid-rollout, and its servers' loads are known only at "
        "run time, which the file cannot show: explain asks the control plane's operator API, found "
        "as cpctl finds it, and says so in one line when it cannot.",
    )
    live.add_argument(
        "--server",
        metavar="HOST:PORT",
        help=f"the operator API (--admin-listen); default: $CPCTL_SERVER or {DEFAULT_ADMIN_LISTEN}",
    )
    live.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="file holding the bearer token; default: as cpctl ($CPCTL_TOKEN, $CPCTL_TOKEN_FILE, "
        f"{DEFAULT_STATE_DIR}/admin-token)",
    )
    live.add_argument(
        "--offline", action="store_true", help="read only the file; do not ask the control plane"
    )


def run(args: argparse.Namespace) -> int:
    """`controlplane explain`: -o and --format must not disagree; then explain.run."""
    from controlplane.cli.explain import run as run_explain

    fmt = args.output
    legacy = {"text": "table"}.get(args.format, args.format)
    if fmt is not None and legacy is not None and fmt != legacy:
        print(f"controlplane explain: -o {fmt} and --format {args.format} disagree", file=sys.stderr)
        return 2
    return run_explain(
        args.model,
        args.config,
        fmt or legacy or "table",
        live=not args.offline,
        server=args.server,
        token_file=args.token_file,
    )
