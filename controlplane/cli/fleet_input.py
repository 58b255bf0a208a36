"""Reading a fleet file named on the command line, `-` for standard input: shared by
`controlplane check-config` (main.py) and `controlplane explain` (explain.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from controlplane import limits

STDIN = "-"  # a fleet file argument that reads standard input


def read_fleet_input(path: Path) -> tuple[str, bytes]:
    """(the name errors give it, its bytes): the file, or standard input for `-`, read no
    further than one byte past the size limit; raise FleetConfigInvalid if it cannot be read."""
    # The loader is imported here, not at the top: `controlplane --help` stays quick.
    from controlplane.fleet.loader import read_fleet_bytes

    if str(path) == STDIN:
        return "<stdin>", sys.stdin.buffer.read(limits.FLEET_FILE_MAX_BYTES + 1)
    return str(path), read_fleet_bytes(path)
