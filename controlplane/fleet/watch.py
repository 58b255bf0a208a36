"""Watch the fleet file and hand every valid edit on; refuse invalid ones loudly."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path

import structlog

from controlplane.fleet.loader import FleetConfigInvalid, load_fleet
from controlplane.fleet.model import Fleet

log = structlog.get_logger("controlplane.fleet")


class FleetFileWatcher:
    """Polls a YAML file (content hash) and calls `on_fleet` with each new valid fleet.

    Polling works the same on every filesystem, including a Kubernetes ConfigMap volume,
    whose atomic symlink swaps inotify-based watchers often miss.
    """

    def __init__(
        self,
        path: Path,
        on_fleet: Callable[[Fleet], None],
        on_invalid: Callable[[FleetConfigInvalid], None],
        interval_s: float = 0.25,
    ) -> None:
        self.path = path
        self.on_fleet = on_fleet
        self.on_invalid = on_invalid
        self.interval_s = interval_s
        self._digest: bytes | None = None

    def check(self) -> bool:
        """Load the file if its content changed. Returns True if it changed."""
        try:
            data = self.path.read_bytes()
        except OSError as e:
            digest = f"unreadable:{e}".encode()
        else:
            digest = hashlib.blake2b(data).digest()
        if digest == self._digest:
            return False
        self._digest = digest
        try:
            fleet = load_fleet(self.path)
        except FleetConfigInvalid as e:
            self.on_invalid(e)
        else:
            self.on_fleet(fleet)
        return True

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            try:
                self.check()
            except Exception:  # a bug here must not stop serving the last good config
                log.exception("fleet watcher failed; will retry")
            await asyncio.sleep(self.interval_s)
