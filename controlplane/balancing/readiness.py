"""Servers no probe has seen ready yet: which of them are held out of traffic (pure).

No request is sent to a server no one has seen ready, as far as the data plane can do
without us: a server the probes have not seen ready (it may be loading) is held out while
its cluster has another server seen ready and ready now. Heard is not enough: its /metrics
may answer while its health probe times out (a CI run sent 30 requests to a loading server
that way). A cluster with no server seen ready keeps the benefit of the doubt (a version
replaced in one edit; a control plane that cannot see): holding its requests on an unknown
would tie the data plane to us being there. Servers there from the first round (the first
snapshot waits only one scrape timeout for them) are held so only while they are at most
half of their cluster, as for servers out of sight (balancing/sight.py): a control plane
restarted into a fleet it half sees must not pile the traffic onto the half it does.

| the server                               | its version (cluster)                 | decision          |
|------------------------------------------|---------------------------------------|-------------------|
| seen ready once                          | any                                   | not held here     |
| not seen ready                           | none both seen ready and ready now    | benefit of doubt  |
| not seen ready, not ready now            | one seen ready and ready now          | held: not_ready   |
| not seen ready, ready now, joined later  | one seen ready and ready now          | held: unproven    |
| not seen ready, ready now, first round   | same, and such servers <= half of it  | held: first_round |
| not seen ready, ready now, first round   | same, and such servers > half of it   | benefit of doubt  |

"Ready now" is the store's word (`EndpointLoad.ready`): a server never heard is ready by it,
so "not seen ready, ready now" is one not heard yet, or heard without a ready health answer.
One not ready now is held by its own word anyway; `not_ready` only says so.

A server is one key (model, address) in every version that lists it. The fleet lists an
address once across a model's versions; should a key be in several, the clusters are taken
in order, and a server given the benefit of the doubt by one counts, if ready now, as a
proven one in those after it (as the weight loop always did).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Literal

from controlplane.signals.store import EndpointKey

HoldReason = Literal["not_ready", "unproven", "first_round"]


def held_out(
    clusters: Sequence[Sequence[EndpointKey]],
    *,
    seen_ready: Set[EndpointKey],
    ready: Set[EndpointKey],
    first_round: Set[EndpointKey],
) -> dict[EndpointKey, HoldReason]:
    """The servers held out, each with why, given each cluster's (version's) endpoint keys in
    fleet order, the keys ever seen ready, the keys ready now, and the keys there since the
    first round. Only the `ready` of keys in a cluster with a key not seen ready is read."""
    unproven = {k for keys in clusters for k in keys if k not in seen_ready}
    if not unproven:
        return {}
    for keys in clusters:
        if not any(k in unproven for k in keys):
            continue
        if not any(k in ready and k not in unproven for k in keys):
            unproven.difference_update(keys)  # no server here proven ready: benefit of the doubt
            continue
        # First-round servers that only the benefit of the doubt would serve.
        doubted = [k for k in keys if k in unproven and k in ready and k in first_round]
        if 2 * len(doubted) > len(keys):
            unproven.difference_update(doubted)
    return {
        k: "not_ready" if k not in ready else "first_round" if k in first_round else "unproven"
        for k in unproven
    }
