"""The queue in front of a model whose every server is full (pure): who goes next, who is
shed when it is full, who has waited too long.

**The order** in which waiting requests leave for a free slot:

1. **Priority class**: rank 0 (the first of `priority_classes`, premium) before rank 1
   before rank 2; a lower class never leaves while a higher one waits.
2. **Fair share between tenants** within a class, by virtual token counters (VTC: Sheng et
   al., "Fairness in Serving Large Language Models", OSDI 2024; AIBrix's VTC router): each
   tenant's counter grows by the tokens it is served (`charge`: its prompt when it leaves the
   queue, its output as the caller learns it), and the waiting tenant with the lowest counter
   goes next. A tenant that starts waiting again has its counter lifted to the lowest among
   the tenants then waiting in its class (nobody waiting: to the counter of the tenant last
   served), so time spent idle banks no credit to spend on a burst later.
3. **Arrival**, within a tenant.

**The bounds**: at most `max_requests` requests and `max_bytes` bytes wait. A newcomer that
does not fit sheds the newest requests of the lowest class waiting, one at a time, while
that class is lower than its own; if that cannot make room (every request waiting is of its
class or higher), the newcomer is the one shed, and nothing else is. A request larger than
`max_bytes` alone is shed at once.

**Deadlines**: each request waits at most until its `deadline` (its class's maximum wait
after it arrived); `expired` takes out those past it, earliest first.

Every request pushed comes out exactly once: by `pop`, shed by a `push`, by `expired`, or by
`remove` (a client that went away). Tenants' counters are kept for at most `max_tenants`
tenants, the least recently seen forgotten first (a forgotten tenant comes back at the
lowest counter, as if it had been idle). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_REQUESTS = 10_000
MAX_BYTES = 256 << 20
MAX_TENANTS = 100_000


@dataclass(frozen=True, slots=True)
class Waiting:
    """A request waiting for a slot."""

    id: int  # unique while it waits
    rank: int  # its priority class: 0 is the highest
    tenant: str
    arrival: float
    deadline: float
    size: int = 0  # bytes, for the byte bound
    tokens: int = 0  # its prompt's tokens: charged to its tenant when it leaves the queue


@dataclass
class FlowQueue:
    max_requests: int = MAX_REQUESTS
    max_bytes: int = MAX_BYTES
    max_tenants: int = MAX_TENANTS
    bytes: int = 0
    # rank -> id -> the request, in arrival order
    _classes: dict[int, OrderedDict[int, Waiting]] = field(default_factory=dict)
    _tenants: dict[tuple[int, str], deque[int]] = field(default_factory=dict)  # (rank, tenant) -> ids
    _counters: OrderedDict[str, float] = field(default_factory=OrderedDict)  # VTC, least recently seen first
    _floor: float = 0.0  # the counter of the tenant served last
    _deadlines: list[tuple[float, int]] = field(default_factory=list)  # a heap; ids gone are skipped
    _where: dict[int, int] = field(default_factory=dict)  # id -> rank

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, id: object) -> bool:
        return id in self._where

    def counter(self, tenant: str) -> float:
        """`tenant`'s virtual token counter (0: never served, or forgotten)."""
        return self._counters.get(tenant, 0.0)

    def waiting(self) -> dict[tuple[int, str], int]:
        """How many requests wait, by (class rank, tenant)."""
        return {k: sum(1 for i in ids if i in self._where) for k, ids in self._tenants.items()}

    def push(self, w: Waiting) -> list[Waiting]:
        """Queue `w`; the requests shed to make room (`w` itself if it does not fit, then
        alone), oldest first. An id already waiting is refused (ValueError)."""
        if w.id in self._where:
            raise ValueError(f"request {w.id} is already waiting")
        if w.size > self.max_bytes or self.max_requests < 1:
            return [w]
        lower = [e for rank, c in self._classes.items() if rank > w.rank for e in c.values()]
        if len(self) - len(lower) + 1 > self.max_requests or (
            self.bytes - sum(e.size for e in lower) + w.size > self.max_bytes
        ):
            return [w]  # shedding every lower request would not make room: nothing is shed
        shed: list[Waiting] = []
        while len(self) + 1 > self.max_requests or self.bytes + w.size > self.max_bytes:
            rank = max(r for r, c in self._classes.items() if c)
            victim = next(reversed(self._classes[rank].values()))  # the newest of the lowest class
            self._take(victim)
            shed.append(victim)
        key = (w.rank, w.tenant)
        ids = self._tenants.get(key)
        if not ids:  # it starts waiting in this class again: idleness banks no credit
            others = [self.counter(t) for (r, t) in self._tenants if r == w.rank and t != w.tenant]
            lift = min(others) if others else self._floor
            self._set_counter(w.tenant, max(self.counter(w.tenant), lift))
            ids = self._tenants[key] = deque()
        ids.append(w.id)
        self._classes.setdefault(w.rank, OrderedDict())[w.id] = w
        self._where[w.id] = w.rank
        self.bytes += w.size
        heapq.heappush(self._deadlines, (w.deadline, w.id))
        shed.reverse()
        return shed

    def pop(self, accept: Callable[[Waiting], bool] | None = None) -> Waiting | None:
        """The next request to leave for a free slot (None: none waits); its prompt's tokens
        are charged to its tenant. `accept`: only a request it accepts may leave (one that may
        go only to some servers, when only others have a slot free); the order among those is
        the same: class, then tenant's counter, then arrival within a tenant."""
        for rank in sorted(r for r, c in self._classes.items() if c):
            best: tuple[float, int, str] | None = None
            for (r, tenant), ids in self._tenants.items():
                if r != rank:
                    continue
                while ids and ids[0] not in self._where:
                    ids.popleft()
                first = next(
                    (
                        i
                        for i in ids
                        if i in self._where and (accept is None or accept(self._classes[rank][i]))
                    ),
                    None,
                )
                if first is not None:
                    score = (self.counter(tenant), self._classes[rank][first].arrival, tenant)
                    if best is None or score < (best[0], self._classes[rank][best[1]].arrival, best[2]):
                        best = (score[0], first, tenant)
            if best is not None:
                w = self._classes[rank][best[1]]
                self._take(w)
                self.charge(w.tenant, w.tokens)
                self._floor = self.counter(w.tenant)
                return w
        return None

    def charge(self, tenant: str, tokens: float) -> None:
        """`tenant` was served `tokens` more (its output, as it streams; negative or not
        finite: nothing)."""
        if tokens > 0 and tokens != float("inf"):
            self._set_counter(tenant, self.counter(tenant) + tokens)

    def remove(self, id: int) -> Waiting | None:
        """Take request `id` out (its client went away); None if it no longer waits."""
        rank = self._where.get(id)
        if rank is None:
            return None
        w = self._classes[rank][id]
        self._take(w)
        return w

    def expired(self, now: float) -> list[Waiting]:
        """Take out every request whose deadline is at or before `now`, earliest first."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, id = heapq.heappop(self._deadlines)
            w = self.remove(id)
            if w is not None:
                out.append(w)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline of a request still waiting (None: none waits)."""
        while self._deadlines and self._deadlines[0][1] not in self._where:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _take(self, w: Waiting) -> None:
        del self._where[w.id]
        del self._classes[w.rank][w.id]
        self.bytes -= w.size
        ids = self._tenants.get((w.rank, w.tenant))
        if ids is not None:
            while ids and ids[0] not in self._where:
                ids.popleft()
            if not ids:
                del self._tenants[(w.rank, w.tenant)]
        if len(self._deadlines) > 2 * len(self._where) + 64:  # mostly gone: rebuild
            self._deadlines = [(d, i) for d, i in self._deadlines if i in self._where]
            heapq.heapify(self._deadlines)

    def _set_counter(self, tenant: str, value: float) -> None:
        self._counters[tenant] = value
        self._counters.move_to_end(tenant)
        while len(self._counters) > self.max_tenants:
            self._counters.popitem(last=False)
