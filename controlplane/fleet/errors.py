"""How the fleet loader reports what is wrong: one ConfigError per problem (file, line, key path,
reason), all of them raised together as FleetConfigInvalid. `_Errors` is the collector every
schema parser adds to; it looks up the line of each key path."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigError:
    """One problem in a config file: where it is and why it is wrong."""

    file: str
    path: str
    reason: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        # Control characters from the file (a NUL, a newline in a key) are shown escaped:
        # one error is one line, in a terminal and in a log.
        return _printable(f"{where}: {self.path or '<top>'}: {self.reason}")


def _printable(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class FleetConfigInvalid(Exception):
    """The fleet config has one or more errors; `errors` lists them all."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


class _Errors:
    def __init__(self, file: str, lines: Mapping[str, int]) -> None:
        self.file = file
        self.lines = lines
        self.items: list[ConfigError] = []

    def add(self, path: str, reason: str) -> None:
        self.items.append(ConfigError(self.file, path, reason, self.lines.get(path)))
