"""When each endpoint is scraped next (pure: time is an input).

- **Spread.** Each endpoint has a fixed phase in the interval, from a hash of its address,
  so a fleet's scrapes are spread evenly over every interval instead of bursting at its
  top; an endpoint keeps its phase from round to round.
- **Back-off.** An endpoint that cannot be reached (connection refused, timeout) is
  scraped at the normal interval for its first `UNREACHABLE_AFTER` failures in a row (the
  store holds it out after that many), then less and less often: the interval doubles per
  further failure up to `MAX_BACKOFF_S`, with +-20% jitter so a fleet that went down
  together does not come back in lockstep. The first answer ends the back-off.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from dataclasses import dataclass, field

from controlplane.signals.store import UNREACHABLE_AFTER, EndpointKey

MAX_BACKOFF_S = 30.0
JITTER = 0.2


def phase(address: str) -> float:
    """The endpoint's fixed offset in the interval, in [0, 1)."""
    digest = hashlib.blake2b(address.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") / 2**32


def backoff_s(interval_s: float, failures: int, rng: random.Random) -> float:
    """Seconds to the next attempt after `failures` failed attempts in a row."""
    if failures <= UNREACHABLE_AFTER:
        return interval_s
    delay = min(MAX_BACKOFF_S, interval_s * 2.0 ** (failures - UNREACHABLE_AFTER))
    delay = max(delay, interval_s)
    return delay * (1.0 + rng.uniform(-JITTER, JITTER))


@dataclass(order=True)
class _Entry:
    due: float
    key: EndpointKey = field(compare=False)
    generation: int = field(compare=False, default=0)


class Schedule:
    """Due times of a set of endpoints; `due(now)` pops those whose time has come."""

    def __init__(self, interval_s: float, seed: int = 0) -> None:
        self.interval_s = interval_s
        self.failures: dict[EndpointKey, int] = {}
        self._heap: list[_Entry] = []
        self._gen: dict[EndpointKey, int] = {}  # the live entry of each key (others are stale)
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._gen)

    def set_targets(self, keys: list[EndpointKey], now: float, *, first: bool = False) -> None:
        """Scrape exactly these from now on; new ones start at their phase in the interval
        (`first`: at once, for the control plane's first round)."""
        wanted = set(keys)
        for key in [k for k in self._gen if k not in wanted]:
            del self._gen[key]
            self.failures.pop(key, None)
        for key in keys:
            if key not in self._gen:
                start = now if first else now + phase(key[1]) * self.interval_s
                self._push(key, start)

    def set_interval(self, interval_s: float, now: float) -> None:
        """A new interval: every endpoint is rescheduled at its phase in the new one."""
        if interval_s == self.interval_s:
            return
        self.interval_s = interval_s
        for key in list(self._gen):
            self._push(key, now + phase(key[1]) * interval_s)

    def _push(self, key: EndpointKey, due: float) -> None:
        gen = self._gen.get(key, 0) + 1
        self._gen[key] = gen
        heapq.heappush(self._heap, _Entry(due, key, gen))
        if len(self._heap) > 4 * len(self._gen) + 64:
            self._heap = [e for e in self._heap if self._gen.get(e.key) == e.generation]
            heapq.heapify(self._heap)

    def next_due(self) -> float | None:
        while self._heap and self._gen.get(self._heap[0].key) != self._heap[0].generation:
            heapq.heappop(self._heap)
        return self._heap[0].due if self._heap else None

    def due(self, now: float) -> list[tuple[EndpointKey, float]]:
        """(endpoint, when it was due) for every endpoint due by `now`; each is taken off the
        schedule until `done` puts it back."""
        out: list[tuple[EndpointKey, float]] = []
        while self._heap and self._heap[0].due <= now:
            e = heapq.heappop(self._heap)
            if self._gen.get(e.key) == e.generation:
                self._gen[e.key] = e.generation  # in progress: no entry on the heap
                out.append((e.key, e.due))
        return out

    def done(self, key: EndpointKey, due: float, reached: bool, now: float) -> float | None:
        """The scrape of `key` (due at `due`) ended; schedule the next. None: no longer a target."""
        if key not in self._gen:
            return None
        if reached:
            self.failures.pop(key, None)
            nxt = due + self.interval_s
            if nxt <= now:  # late (a slow scrape, a busy process): skip, keep the phase
                nxt += self.interval_s * (int((now - nxt) / self.interval_s) + 1)
        else:
            failures = self.failures.get(key, 0) + 1
            self.failures[key] = failures
            nxt = (due if failures <= UNREACHABLE_AFTER else now) + backoff_s(
                self.interval_s, failures, self._rng
            )
            if nxt <= now:
                nxt = now + self.interval_s * (1.0 - JITTER * self._rng.random())
        self._push(key, nxt)
        return nxt

    def backing_off(self) -> int:
        """Endpoints past UNREACHABLE_AFTER failures: probed less often until they answer."""
        return sum(1 for f in self.failures.values() if f > UNREACHABLE_AFTER)
