"""How a request finds a server, as the fleet simulation models it (pure, seeded).

Sidecar pickers see only their own sidecar's requests in flight per endpoint (`active`,
a list the simulation updates): `RoundRobin`, `RandomPick` and `LeastRequest`, which
follows Envoy's least-request load balancer:

- all weights equal: a full scan of the hosts for the fewest requests in flight, ties
  broken uniformly by reservoir sampling (`unweightedHostPickFullScan`, what the control
  plane configures: `selection_method: FULL_SCAN`); or, with `choice_count`, Envoy's default power
  of N choices, sampled with replacement, the first sample kept on ties
  (`unweightedHostPickNChoices`);
- weights differ: an earliest-deadline-first schedule over the effective weight
  `weight / (active + 1)`. A host's effective weight is computed only when it is
  (re)inserted after being picked, with its active count at that moment, and stays in
  the schedule until it is picked again however its load changes since. Every weight
  push rebuilds the schedule from the current counts, started at a per-balancer seeded
  number of emulated picks (`EdfScheduler::createWithPicks`, `EdfLoadBalancerBase::refresh`).

`full_scan_pick` is the per-request picker over the true global state (an endpoint
picker in the style of the Gateway API inference extension): the fastest server with a
free slot, else the smallest expected wait.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_MAX_PREPICKS = 429_496_729  # Envoy: picks % (UINT32_MAX / 10)


class EdfSchedule:
    """Envoy's `EdfScheduler`: entries (deadline, insertion order, host), earliest first."""

    def __init__(self) -> None:
        self.now = 0.0
        self._order = 0
        self._queue: list[tuple[float, int, int]] = []

    @classmethod
    def with_picks(cls, hosts: Sequence[int], weights: Sequence[float], picks: int) -> EdfSchedule:
        """The schedule after `picks` picks at fixed weights, computed in O(hosts)."""
        picks %= _MAX_PREPICKS
        s = cls()
        aug = [weights[h] + 1e-13 for h in hosts]  # as Envoy: keeps multiples of each other exact
        total = sum(aug)
        done = 0
        latest = 0.0
        for i, (h, w) in enumerate(zip(hosts, aug, strict=True)):
            floor = int(w * picks / total)
            if floor > 0 and floor / w >= picks / total:
                floor -= 1
            latest = max(latest, floor / w)
            s._queue.append(((floor + 1) / w, i, h))
            done += floor
        heapq.heapify(s._queue)
        s.now = latest
        s._order = len(hosts)
        while done < picks:
            s.pick_and_add(weights.__getitem__)
            done += 1
        return s

    def pick_and_add(self, weight_of: Callable[[int], float]) -> int:
        """Pop the earliest deadline, re-insert that host with its weight as of now."""
        deadline, _, host = heapq.heappop(self._queue)
        self.now = deadline
        heapq.heappush(self._queue, (deadline + 1.0 / weight_of(host), self._order, host))
        self._order += 1
        return host


class RoundRobin:
    """Per-sidecar round robin over the endpoints, from a random starting point."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self._n = n
        self._next = rng.randrange(n)

    def pick(self) -> int:
        h = self._next
        self._next = (h + 1) % self._n
        return h


class RandomPick:
    """Uniformly random endpoint."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self._n = n
        self._rng = rng

    def pick(self) -> int:
        return self._rng.randrange(self._n)


class LeastRequest:
    """Envoy's weighted least request for one sidecar (one worker), over its own `active`."""

    def __init__(self, active: list[int], rng: random.Random, choice_count: int | None = None) -> None:
        self.active = active
        self._rng = rng
        self._choices = choice_count
        self._seed = rng.getrandbits(32)  # Envoy: one seed per balancer, reused by every rebuild
        self.weights: list[int] = [1] * len(active)
        self._hosts = list(range(len(active)))
        self._edf: EdfSchedule | None = None
        self.rebuilds = 0

    @property
    def weighted(self) -> bool:
        """True while the EDF schedule is in use (the weights differ)."""
        return self._edf is not None

    def set_weights(self, weights: Sequence[int]) -> None:
        """An EDS update: weight 0 holds an endpoint out; the schedule is rebuilt."""
        if list(weights) == self.weights:
            return  # no change, no push
        self.weights = list(weights)
        self._hosts = [h for h, w in enumerate(weights) if w > 0]
        self.rebuilds += 1
        distinct = {self.weights[h] for h in self._hosts}
        if len(distinct) <= 1 or len(self._hosts) <= 1:
            self._edf = None
            return
        self._edf = EdfSchedule.with_picks(
            self._hosts, [self._effective(h) for h in range(len(weights))], self._seed
        )

    def _effective(self, host: int) -> float:
        return self.weights[host] / (self.active[host] + 1)

    def pick(self) -> int:
        if self._edf is not None:
            return self._edf.pick_and_add(self._effective)
        hosts = self._hosts
        rng = self._rng
        if self._choices is None:  # full scan; ties uniformly, by reservoir sampling
            best = hosts[0]
            tied = 1
            for h in hosts[1:]:
                if self.active[h] < self.active[best]:
                    best, tied = h, 1
                elif self.active[h] == self.active[best]:
                    tied += 1
                    if rng.random() * tied < 1.0:
                        best = h
            return best
        best = hosts[int(rng.random() * len(hosts))]
        for _ in range(self._choices - 1):
            h = hosts[int(rng.random() * len(hosts))]
            if self.active[h] < self.active[best]:
                best = h
        return best


@dataclass(frozen=True)
class ServerView:
    """What a global picker sees of one server."""

    running: int
    waiting: int
    slots: int
    service_s: float  # mean time a request holds one of its slots


def full_scan_pick(servers: Sequence[ServerView]) -> int:
    """The fastest server with a free slot (the least busy on ties); when every slot is
    taken, the smallest expected time to finish: its own service after the queue ahead
    of it drains through the server's slots."""
    best = -1
    best_key = (0.0, 0.0)
    for i, s in enumerate(servers):
        if s.waiting == 0 and s.running < s.slots:
            key = (-1.0 / s.service_s, s.running / s.slots)
        else:
            key = (1.0, (s.waiting + 1) / s.slots * s.service_s + s.service_s)
        if best < 0 or key < best_key:
            best, best_key = i, key
    return best
