"""Fail static: the control plane losing sight of servers never takes them away (pure).

An endpoint is *out of sight* when its probes have gone unanswered a few times in a row
(signals/store.py). That says something about the path from the control plane to the
server (a NetworkPolicy, a partition, a firewalled metrics port), not about the path from
the proxies. So an endpoint out of sight is held out only while the rest of its cluster
vouches for the fleet being visible: every other endpoint in sight and ready, and the ones
out of sight no more than half of the cluster. Otherwise they keep the server's last
verdict and their weights, which fade towards capacity as their signals age, and the data
plane judges (retries, outlier detection, its own health checks).

| its own state            | rest of the cluster                       | decision                   |
|--------------------------|-------------------------------------------|----------------------------|
| in sight, health 2xx     | any                                       | serves                     |
| in sight, health non-2xx | any                                       | held out (server said so)  |
| out of sight             | all in sight + ready, unseen <= half      | held out                   |
| out of sight             | anything else                             | its last verdict stands    |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.signals.load import EndpointLoad


@dataclass(frozen=True)
class SightVerdict:
    """One cluster's loads after the rule, and what the rule did."""

    loads: tuple[EndpointLoad, ...]
    out_of_sight: int  # endpoints out of sight
    held_out: int  # ...of which held out (the rest of the cluster vouches)
    kept: int  # ...of which kept serving on their last verdict (fail static)


def judge_sight(loads: Sequence[EndpointLoad]) -> SightVerdict:
    """Apply the rule to one cluster's loads: those held out get `ready=False`."""
    unseen = [e for e in loads if not e.in_sight]
    if not unseen:
        return SightVerdict(tuple(loads), 0, 0, 0)
    rest = [e for e in loads if e.in_sight]
    vouched = bool(rest) and all(e.ready for e in rest) and 2 * len(unseen) <= len(loads)
    if not vouched:
        return SightVerdict(tuple(loads), len(unseen), 0, len(unseen))
    out = tuple(e if e.in_sight else dataclasses.replace(e, ready=False) for e in loads)
    return SightVerdict(out, len(unseen), len(unseen), 0)
