"""Waiting in async tests: until a condition holds, with a deadline (never a bare sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(
    condition: Callable[[], object], what: str, timeout: float = 10.0, interval: float = 0.005
) -> None:
    """Return once `condition()` is true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting until {what}"
        await asyncio.sleep(interval)
