"""Argument types of both CLIs (`controlplane` and `cpctl`): each turns a flag's text into its
value or raises `argparse.ArgumentTypeError` with the one line argparse prints after the flag.

The wording differs a little between the two CLIs (`must be >= 0` here, `must be a number >= 0`
there); each flag keeps the message it has always given, since scripts may match on it.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from controlplane import limits

UINT32_END = 2**32  # cpctl's counts travel as protobuf uint32

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


# ---- numbers ------------------------------------------------------------------------------


def number(low: float, high: float | None = None, *, strict: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (or > low when strict)."""

    def parse(text: str) -> float:
        value = _float(text)
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text!r}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, got {text!r}")
        return value

    return parse


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    return parse


def non_negative_number(text: str) -> float:
    """A finite number >= 0: cpctl's rates and ratios (the server judges their range)."""
    value = _float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def count(text: str) -> int:
    """An integer >= 0 that fits the operator API's uint32 fields."""
    value = _int(text)
    if not 0 <= value < UINT32_END:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def percent(text: str) -> int:
    """A whole percent, 0-100."""
    value = count(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"must be a percent, 0-100, got {text!r}")
    return value


# ---- durations and steps ------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """`30s`, `2m`, `500ms`, `1h` or a bare number of seconds -> seconds (> 0)."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 30s, 2m, 500ms or seconds, got {text!r}")
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text!r}")
    return seconds


def parse_steps(text: str) -> list[int]:
    """`5,25,50,100` -> [5, 25, 50, 100]: integer percents 1-100 (their order is judged with
    the rest of the rollout, by the server's own rule: `start_problem`)."""
    steps = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated percents like 5,25,50,100, got {text!r}"
            ) from None
        if not 1 <= value <= 100:
            raise argparse.ArgumentTypeError(f"each step is a percent 1-100, got {value} in {text!r}")
        steps.append(value)
    return steps


# ---- names and reasons --------------------------------------------------------------------


def name(text: str) -> str:
    """A model, version or address: not empty, and within the operator API's bound."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return name_or_all(text)


def name_or_all(text: str) -> str:
    """A name as a filter, where empty means every one."""
    if len(text) > limits.API_NAME_MAX_CHARS:
        raise argparse.ArgumentTypeError(f"at most {limits.API_NAME_MAX_CHARS} characters, got {len(text)}")
    return text


def reason(text: str) -> str:
    """An operator's reason for the audit trail, within the operator API's bound."""
    if len(text) > limits.API_REASON_MAX_CHARS:
        raise argparse.ArgumentTypeError(f"at most {limits.API_REASON_MAX_CHARS} characters, got {len(text)}")
    return text
