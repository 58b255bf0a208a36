"""Where the operator API listens and keeps its token by default (shared by serve and cpctl)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_ADMIN_LISTEN = "127.0.0.1:18001"


def _default_state_dir() -> Path:
    """$XDG_STATE_HOME/controlplane, else ~/.local/state/controlplane; a process with no home
    directory (a bare container user) gets /var/lib/controlplane."""
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg:
        return Path(xdg) / "controlplane"
    try:
        return Path.home() / ".local" / "state" / "controlplane"
    except RuntimeError:
        return Path("/var/lib/controlplane")


DEFAULT_STATE_DIR = _default_state_dir()
TOKEN_FILE_NAME = "admin-token"
