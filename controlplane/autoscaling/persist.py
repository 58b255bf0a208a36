"""The forecasts' history on disk (the I/O shell of forecast.py): `<state dir>/autoscaling-history.json`.

Written whole to a temporary file and renamed over the old one, so a crash leaves the old
history or the new, never half of one. A file that cannot be read or parsed is logged and
set aside (renamed `.bad`): predictive pre-warm learns again rather than stop the control
plane from starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import structlog

from controlplane.autoscaling.forecast import Forecaster

log = structlog.get_logger("controlplane.autoscaling")

HISTORY_FILE = "autoscaling-history.json"
HISTORY_SAVE_S = 30.0  # how often the forecasts' history is saved (and at stop)


class HistoryFile:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / HISTORY_FILE

    def read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            bad = self.path.with_suffix(".json.bad")
            log.warning("autoscaling history unreadable; set aside, learning afresh", path=str(self.path),
                        error=str(e), moved_to=str(bad))  # fmt: skip
            with contextlib.suppress(OSError):
                self.path.replace(bad)
            return {}
        return data

    def write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)

    def save(self, data: dict[str, Any]) -> None:
        """write(), logging a failure instead of raising (the next save tries again)."""
        try:
            self.write(data)
        except OSError as e:
            log.warning("autoscaling history not saved; will retry", path=str(self.path), error=str(e))

    async def keep(self, history: Forecaster, every_s: float = HISTORY_SAVE_S) -> None:
        """Save `history` every `every_s`, and when cancelled (at stop), in a worker thread: a
        restart loses at most that much of what was learnt."""
        try:
            while True:
                await asyncio.sleep(every_s)
                if history.histories:
                    # Copied on the loop (the loop mutates it), written in a thread.
                    await asyncio.to_thread(self.save, history.dump())
        finally:
            if history.histories:
                self.save(history.dump())
