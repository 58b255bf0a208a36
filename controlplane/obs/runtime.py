"""The event loop's own lag: how much later than asked it runs what is due.

Every xDS stream, round and operator call of the process shares one asyncio loop; a callback
that holds it (a slow parse, a long snapshot build, a blocking call) delays all of them.
A task sleeps `LAG_PROBE_S` again and again and measures how much later it woke; the gauge
shows the worst of the last `LAG_WINDOW_S`, so a scrape sees every stall since the one before
(at the usual 15 s scrape interval), not only the latest quarter second.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from prometheus_client import Gauge

LAG_PROBE_S = 0.25  # about 4 wake-ups a second: nothing next to the loop's real work
LAG_WINDOW_S = 15.0


class LagWindow:
    """The largest lag over the last `window_s` seconds of probes (pure)."""

    def __init__(self, window_s: float = LAG_WINDOW_S) -> None:
        self.window_s = window_s
        self._probes: collections.deque[tuple[float, float]] = collections.deque()

    def add(self, at: float, lag_s: float) -> float:
        """Record a probe's lag at monotonic time `at`; the largest lag within the window."""
        self._probes.append((at, lag_s))
        while self._probes[0][0] <= at - self.window_s:
            self._probes.popleft()
        return max(lag for _, lag in self._probes)


async def watch_event_loop(
    gauge: Gauge,
    probe_s: float = LAG_PROBE_S,
    window_s: float = LAG_WINDOW_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Probe the running loop's lag until cancelled, setting `gauge` after every probe."""
    window = LagWindow(window_s)
    while True:
        asked = clock()
        await asyncio.sleep(probe_s)
        woke = clock()
        gauge.set(window.add(woke, max(0.0, woke - asked - probe_s)))
