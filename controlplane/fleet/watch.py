"""Watch the fleet file and hand every valid edit on; refuse invalid ones loudly."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path

import structlog

from controlplane.fleet.loader import (
    ConfigError,
    FleetConfigInvalid,
    decode_fleet,
    parse_fleet,
    read_fleet_bytes,
)
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
        """Load the file if its content changed (here, on the caller's thread). Returns True
        if it changed."""
        data = self._changed()
        if data is None:
            return False
        self._deliver(data if isinstance(data, FleetConfigInvalid) else self._parse(data))
        return True

    async def check_async(self) -> bool:
        """As `check`, with the parsing in a worker thread: a large or hostile file never
        blocks the event loop that serves xDS. The callbacks run on the loop."""
        data = self._changed()
        if data is None:
            return False
        if isinstance(data, FleetConfigInvalid):
            self._deliver(data)
        else:
            self._deliver(await asyncio.to_thread(self._parse, data))
        return True

    def _changed(self) -> bytes | FleetConfigInvalid | None:
        """The file's bytes (or why it cannot be read) if that changed since the last look."""
        data: bytes | FleetConfigInvalid
        try:
            data = read_fleet_bytes(self.path)
            digest = hashlib.blake2b(data).digest()
        except FleetConfigInvalid as e:
            data, digest = e, f"unreadable:{e}".encode()
        if digest == self._digest:
            return None
        self._digest = digest
        return data

    def _parse(self, data: bytes) -> Fleet | FleetConfigInvalid:
        return parse_file_bytes(data, str(self.path))

    def _deliver(self, result: Fleet | FleetConfigInvalid) -> None:
        if isinstance(result, FleetConfigInvalid):
            self.on_invalid(result)
        else:
            self.on_fleet(result)

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            try:
                await self.check_async()
            except Exception:  # a bug here must not stop serving the last good config
                log.exception("fleet watcher failed; will retry")
            await asyncio.sleep(self.interval_s)


def parse_file_bytes(data: bytes, file: str) -> Fleet | FleetConfigInvalid:
    """The fleet in a file's bytes, or why not. A loader bug on some input is reported as an
    invalid file (counted, alerted on), never as a crash that leaves the status saying valid."""
    try:
        return parse_fleet(decode_fleet(data, file), file)
    except FleetConfigInvalid as e:
        return e
    except Exception as e:  # any input must end in a verdict
        log.exception("fleet loader failed on this input; refusing it", file=file)
        return FleetConfigInvalid([ConfigError(file, "", f"could not be loaded: {type(e).__name__}: {e}")])
