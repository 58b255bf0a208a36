"""Where the operator API listens and keeps its token by default (shared by serve and cpctl)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_ADMIN_LISTEN = "127.0.0.1:18001"
DEFAULT_STATE_DIR = Path.home() / ".local" / "state" / "controlplane"
TOKEN_FILE_NAME = "admin-token"
