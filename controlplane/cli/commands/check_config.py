"""`controlplane check-config`: validate a fleet file; every error with file, line, key path and
reason (-o json|yaml: one document)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from controlplane.cli.commands.output_flag import add_output_flag
from controlplane.cli.fleet_input import read_fleet_input


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `check-config` and its flags to `sub`."""
    c = sub.add_parser(
        "check-config",
        help="validate a fleet YAML file",
        description="Validate a fleet YAML file (- reads standard input). Prints every error with "
        "file, line, key path and reason, and exits 1 if there is any; prints a summary and exits 0 "
        "otherwise. With -o json or yaml, prints one document instead: {file, valid, errors: [{file, "
        "line, field, message}], summary}, with the same exit codes.",
    )
    c.add_argument(
        "file",
        nargs="?",
        type=Path,
        metavar="FILE",
        help="the fleet file, or - for standard input; the same as --config FILE",
    )
    c.add_argument("--config", type=Path, metavar="FILE", help="the fleet file, or - for standard input")
    add_output_flag(c)


def run(args: argparse.Namespace) -> int:
    """`controlplane check-config`: the file given once, as FILE or --config FILE."""
    if args.file is not None and args.config is not None and args.file != args.config:
        print("controlplane check-config: give the fleet file once: FILE or --config FILE", file=sys.stderr)
        return 2
    path = args.config if args.config is not None else args.file
    if path is None:
        print("controlplane check-config: give the fleet file: --config FILE (- for stdin)", file=sys.stderr)
        return 2
    return check_file(path, args.output or "table")


def check_config_doc(name: str, verdict: object) -> dict[str, object]:
    """check-config's verdict as a document for -o json|yaml: every error with its file, line,
    field (the key path; "" for the whole file) and message; a summary when valid."""
    from controlplane.fleet.errors import FleetConfigInvalid
    from controlplane.fleet.model import Fleet

    if isinstance(verdict, FleetConfigInvalid):
        errors = [
            {"file": e.file, "line": e.line, "field": e.path, "message": e.reason} for e in verdict.errors
        ]
        return {"file": name, "valid": False, "errors": errors, "summary": None}
    assert isinstance(verdict, Fleet)
    summary = {
        "tiers": len(verdict.tiers),
        "endpoints": sum(len(v.endpoints) for m in verdict.models for v in m.versions),
        "models": [
            {"name": m.name, "tier": m.tier, "stable": m.stable, "versions": [v.name for v in m.versions]}
            for m in verdict.models
        ],
    }
    return {"file": name, "valid": True, "errors": [], "summary": summary}


def check_file(path: Path, fmt: str = "table") -> int:
    """Validate `path` (- is stdin) and print the verdict as `fmt`: 0 valid, 1 not."""
    import json

    from controlplane.fleet.errors import FleetConfigInvalid
    from controlplane.fleet.watch import parse_file_bytes

    # The same reading and verdict as the server's watcher: a loader bug is an error line,
    # never a traceback.
    name = str(path)
    try:
        name, data = read_fleet_input(path)
        fleet = parse_file_bytes(data, name)
    except FleetConfigInvalid as e:
        fleet = e
    if fmt != "table":
        import yaml

        doc = check_config_doc(name, fleet)
        print(json.dumps(doc, indent=2) if fmt == "json" else yaml.safe_dump(doc, sort_keys=False), end="")
        if fmt == "json":
            print()
        return 1 if isinstance(fleet, FleetConfigInvalid) else 0
    if isinstance(fleet, FleetConfigInvalid):
        for err in fleet.errors:
            print(err, file=sys.stderr)
        print(f"{name}: {len(fleet.errors)} error(s)", file=sys.stderr)
        return 1
    endpoints = sum(len(v.endpoints) for m in fleet.models for v in m.versions)
    print(f"{name}: ok: {len(fleet.tiers)} tiers, {len(fleet.models)} models, {endpoints} endpoints")
    for m in fleet.models:
        print(
            f"  {m.name}: tier {m.tier}, stable {m.stable}, versions {', '.join(v.name for v in m.versions)}"
        )
    return 0
