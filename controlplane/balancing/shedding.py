"""When to shed priority classes, from the signals (pure).

A model's saturation is the queue its ready servers report against what they run:
sum(waiting) / max(sum(running), 1) over the endpoints of its stable version. 0 means no
request waits anywhere, whatever the load; 1 means as many wait as run. A class with
`shed_at` is shed (429 at the proxies) once saturation reaches it, and admitted again
only when saturation falls below half of it, so the decision does not flap with each
scrape. Classes are listed highest first with `shed_at` never growing down the list (the
loader checks), so a lower class is always shed before, and admitted after, a higher one.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.fleet.model import PriorityClass
from controlplane.signals.load import EndpointLoad, counted

READMIT_BELOW = 0.5  # a shed class is admitted again below this share of its shed_at


def saturation(loads: Sequence[EndpointLoad]) -> float:
    """Requests waiting per request running, over the ready endpoints."""
    ready = [e for e in loads if e.ready]
    return sum(counted(e.waiting) for e in ready) / max(sum(counted(e.running) for e in ready), 1.0)


def shed_classes(classes: Sequence[PriorityClass], level: float, shed_now: frozenset[str]) -> frozenset[str]:
    """The classes to shed at this saturation, given those shed now (hysteresis)."""
    out: set[str] = set()
    for c in classes:
        if c.shed_at is None:
            continue
        if level >= c.shed_at or (c.name in shed_now and level >= c.shed_at * READMIT_BELOW):
            out.add(c.name)
    return frozenset(out)
