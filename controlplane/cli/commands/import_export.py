"""`controlplane import` and `controlplane export`: move the fleet file into etcd (checked first)
for replicas serving with --store, and back out."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `import` and `export` and their flags to `sub`."""
    i = sub.add_parser(
        "import",
        help="check a fleet file and store it in etcd, for replicas started with --store",
        description="Validate a fleet YAML file exactly as `check-config` does, then write it to "
        "etcd, where every replica serving with --store picks it up within a second. An invalid "
        "file is refused and nothing is written.",
    )
    i.add_argument(
        "--config",
        "--from",
        dest="source",
        required=True,
        type=Path,
        metavar="FILE",
        help="the fleet file (--from is the same)",
    )
    i.add_argument("--to", dest="target", required=True, metavar="etcd://HOST:PORT[,...][/PREFIX]")
    x2 = sub.add_parser(
        "export",
        help="write the fleet stored in etcd to a file",
        description="Read the fleet stored in etcd (by `controlplane import`) and write it to a "
        "file, or to standard output with --to -.",
    )
    x2.add_argument("--from", dest="source", required=True, metavar="etcd://HOST:PORT[,...][/PREFIX]")
    x2.add_argument("--to", dest="target", required=True, metavar="FILE", help="the file, or - for stdout")


def run_import(args: argparse.Namespace) -> int:
    """`controlplane import`: check the file as check-config does, then write it to etcd."""
    from controlplane.ha import transfer

    return transfer.run_import(args.source, args.target)


def run_export(args: argparse.Namespace) -> int:
    """`controlplane export`: write the fleet stored in etcd to a file or stdout."""
    from controlplane.ha import transfer

    return transfer.run_export(args.source, args.target)
