"""What every `cpctl` command shares: how its parser is made (help layout, -o, the connection
flags as parents), how it prints (`emit`) and how it fails (`CliError`, the exit codes)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from controlplane.cli import cpctl_output as out

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_ABORTED, EXIT_AUTH = 0, 1, 2, 3, 4


class CliError(Exception):
    """An expected failure: printed as one line, exit with `code`."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


def emit(text: str) -> None:
    """One result on standard output, flushed: a watch's reader sees each change at once."""
    print(text, flush=True)


class Formatter(argparse.HelpFormatter):
    """Wraps one-paragraph descriptions; keeps text with line breaks (the examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def add_output_flag(p: argparse.ArgumentParser) -> None:
    """-o table|json|yaml, on every command that prints data."""
    p.add_argument(
        "-o", "--output", choices=out.FORMATS, default="table", help="output format (default: %(default)s)"
    )


@dataclass(frozen=True)
class Leaves:
    """Makes a command's parser as every cpctl command has it: its summary in the list, its
    description, one example, the help layout and the connection flags (`conn`; `conn_drain`
    for `endpoints drain`, whose --timeout is the drain's own)."""

    conn: argparse.ArgumentParser
    conn_drain: argparse.ArgumentParser

    def add(
        self, sub: Any, name: str, summary: str, description: str, example: str, *, drain: bool = False
    ) -> argparse.ArgumentParser:
        """Add command `name` to the subparsers `sub`; return its parser."""
        return sub.add_parser(  # type: ignore[no-any-return]
            name,
            help=summary,
            description=description,
            epilog=f"example:\n  {example}",
            formatter_class=Formatter,
            parents=[self.conn_drain if drain else self.conn],
        )
