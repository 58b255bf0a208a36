"""The -o flag of `check-config` and `explain`: table for people, json or yaml for scripts."""

from __future__ import annotations

import argparse

OUTPUT_FORMATS = ("table", "json", "yaml")  # -o, as cpctl's


def add_output_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default=None,
        help="table for people, json or yaml for scripts (default: table)",
    )
