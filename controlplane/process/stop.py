"""The one place a process turns SIGINT and SIGTERM into a clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event that SIGINT or SIGTERM sets while the block runs, on the running loop; the
    handlers are removed when the block ends, so a second Ctrl-C after it is the default."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def until_stop_signal() -> None:
    """Wait for SIGINT or SIGTERM."""
    with stop_on_signals() as stop:
        await stop.wait()
