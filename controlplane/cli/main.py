"""`controlplane`: serve, check-config, explain, bootstrap, import, export, demo, emulate, picker,
ratelimit.

Each command is a module of commands/ (`controlplane serve` is commands/serve.py) with its own
flags (`add_parser`) and its run function; this module assembles the parser and runs the
command asked for, found by name in `COMMANDS`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from controlplane import __version__
from controlplane.cli.commands import (
    bootstrap,
    check_config,
    demo,
    emulate,
    explain,
    import_export,
    picker,
    ratelimit,
    serve,
)

# Each command's run function, by the command's name.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": serve.run,
    "check-config": check_config.run,
    "explain": explain.run,
    "bootstrap": bootstrap.run,
    "demo": demo.run,
    "import": import_export.run_import,
    "export": import_export.run_export,
    "emulate": emulate.run,
    "ratelimit": ratelimit.run,
    "picker": picker.run,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="controlplane",
        description="An xDS control plane for AI inference traffic: it drives Envoy proxies "
        "(and proxyless gRPC clients) in front of GPU model servers.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # In the order `controlplane --help` lists them.
    serve.add_parser(sub)
    check_config.add_parser(sub)
    explain.add_parser(sub)
    bootstrap.add_parser(sub)
    demo.add_parser(sub)
    import_export.add_parsers(sub)
    emulate.add_parser(sub)
    ratelimit.add_parser(sub)
    picker.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
