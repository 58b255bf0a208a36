"""Scrape timeouts that count the seconds a collector could run, not the seconds it stood still.

A collector runs niced (it yields the CPU to serving), so on a busy machine its event loop
can stand still for longer than a scrape timeout. When it runs again, the server's answer
and the timeout's timer are due together, and asyncio runs the timer's cancellation before
the task that would have read the answer: a server that answered in time is reported as
"timed out", and enough of those put it out of sight. `LoopStalls` notices the loop standing
still (a tick every 50 ms that comes late) and `within` gives an awaitable its timeout plus
the seconds lost meanwhile, up to a cap; a server that truly hangs still times out.

The bookkeeping (`tick`, `lost_between`) is pure and takes the clock's readings as
arguments; `run` and `within` are the thin asyncio shell.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

TICK_S = 0.05  # the loop is looked at this often
LATE_S = 0.05  # a tick later than this past its due time counts as a stall
KEEP_S = 120.0  # stalls are remembered this long (longer than any scrape runs)
MAX_EXTRA_S = 30.0  # a scrape gets at most this much time beyond its timeout


class ScrapeTimeout(TimeoutError):
    """Timed out after its timeout of running time; `extra_s`: the seconds it was given
    beyond it because the loop stood still."""

    def __init__(self, extra_s: float) -> None:
        super().__init__(extra_s)
        self.extra_s = extra_s


class LoopStalls:
    """The times one event loop stood still: (end, seconds lost) per late tick."""

    def __init__(self, now: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = now
        self._stalls: deque[tuple[float, float]] = deque()
        self.stalled_s = 0.0  # all seconds lost, for the collector's stats

    def tick(self, now: float) -> None:
        """The ticker ran at `now`; it was due TICK_S after the previous run."""
        lost = now - self._last - TICK_S
        if lost > LATE_S:
            self._stalls.append((now, lost))
            self.stalled_s += lost
        self._last = now
        while self._stalls and self._stalls[0][0] < now - KEEP_S:
            self._stalls.popleft()

    def lost_between(self, start: float, now: float) -> float:
        """Seconds the loop stood still between `start` and `now`, the stall under way (the
        ticker has not run since) included."""
        lost = 0.0
        for end, seconds in reversed(self._stalls):
            if end <= start:
                break
            lost += min(seconds, end - start)
        current = now - self._last - TICK_S
        if current > LATE_S:
            lost += min(current, now - max(start, self._last))
        return max(0.0, lost)

    async def run(self) -> None:
        """The ticker: runs until cancelled."""
        while True:
            await asyncio.sleep(TICK_S)
            self.tick(self._clock())

    async def within(self, aw: Awaitable[T], timeout_s: float) -> tuple[T, float]:
        """`aw`'s result and the seconds it was given beyond `timeout_s` because the loop
        stood still; ScrapeTimeout once it has had `timeout_s` of time the loop could run
        (or MAX_EXTRA_S more in all)."""
        task = asyncio.ensure_future(aw)
        start = self._clock()
        try:
            while True:
                now = self._clock()
                extra = min(self.lost_between(start, now), MAX_EXTRA_S)
                remaining = start + timeout_s + extra - now
                if remaining <= 0:
                    raise ScrapeTimeout(extra)
                done, _ = await asyncio.wait({task}, timeout=remaining)
                if done:
                    return task.result(), extra
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(_consume)


def _consume(task: asyncio.Future[Any]) -> None:
    # A cancelled scrape's outcome is not wanted; retrieving it keeps asyncio from logging it.
    if not task.cancelled():
        task.exception()
