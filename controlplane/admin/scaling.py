"""What the operator API shows of autoscaling (pure: decisions and views in, messages out).

The autoscaler decides per model and per version every signals round; the weigher's views
hold the loads it decided on. From those this module says, per decision, which endpoints a
scale-down would drain next (in `autoscaling/scale_down.py`'s order) and which are draining
now, so `cpctl autoscaling list` explains a count without anyone reading the logs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

from controlplane.autoscaling.autoscaler import MODEL, ClusterLoads
from controlplane.autoscaling.kpa import Decision
from controlplane.autoscaling.scale_down import READY, Replica, removal_order
from controlplane.fleet.model import Fleet, Model
from controlplane.resources.names import cluster_name
from controlplane.signals.load import EndpointLoad
from controlplane.signals.load import counted as figure_or_zero
from controlplane.v1 import autoscaling_pb2


def _serving(cluster: ClusterLoads, draining: Set[str]) -> list[EndpointLoad]:
    """Replicas ready as the autoscaler counts them (ready, with weight) and not leaving."""
    return [
        ld
        for ld in cluster.loads
        if ld.ready and cluster.weights.get(ld.address, 0) > 0 and ld.address not in draining
    ]


def next_to_remove(
    desired: int,
    counted: Iterable[ClusterLoads],
    drains_from: ClusterLoads | None,
    draining: Set[str],
    prefers_gpus: bool,
) -> tuple[str, ...]:
    """The addresses a scale-down to `desired` would drain next, first to go first.

    `counted` are the clusters whose replicas the decision counted (a version's own, or
    every version of the model); `drains_from` is the one replicas are taken from (the
    version, or the model's stable version). Endpoints already draining are on their way
    out: they neither count as ready nor get named again, so the answer is what is left to
    drain. `prefers_gpus`: the model names preferred GPU classes (without, every endpoint is
    as preferred as another)."""
    excess = sum(len(_serving(c, draining)) for c in counted) - desired
    if excess <= 0 or drains_from is None:
        return ()
    replicas = [
        # Only the order of start times matters: the one ready for the shortest time is newest.
        Replica(
            ld.address,
            READY,
            figure_or_zero(ld.running) + figure_or_zero(ld.waiting),
            ld.preferred or not prefers_gpus,
            -ld.ready_for_s,
        )
        for ld in _serving(drains_from, draining)
    ]
    return tuple(r.address for r in removal_order(replicas)[:excess])


def scaling_messages(
    fleet: Fleet,
    decisions: Mapping[tuple[str, str], Decision],
    views: Mapping[str, ClusterLoads],
    draining: Set[str],
    model: str = "",
) -> list[autoscaling_pb2.ModelScaling]:
    """One message per decision of the served fleet (of `model` only, if given): each model's
    whole-model row, then its versions' rows, in the fleet's order. A model or version the
    autoscaler has not decided on yet (its first round is to come) has no row."""
    out: list[autoscaling_pb2.ModelScaling] = []
    for m in fleet.models:
        if model and m.name != model:
            continue
        mine = {v.name: views.get(cluster_name(m.name, v.name)) for v in m.versions}
        for version in (MODEL, *(v.name for v in m.versions)):
            d = decisions.get((m.name, version))
            if d is None:
                continue
            if version == MODEL:
                counted = [c for c in mine.values() if c is not None]
                drains_from = mine.get(m.stable)
            else:
                drains_from = mine.get(version)
                counted = [drains_from] if drains_from is not None else []
            out.append(
                _message(
                    fleet,
                    m,
                    version,
                    d,
                    next_to_remove(d.desired, counted, drains_from, draining, bool(m.preferred_gpus)),
                    _draining(m, version, draining),
                )
            )
    return out


def _draining(m: Model, version: str, draining: Set[str]) -> list[str]:
    """The model's (or one version's) endpoints draining now, in the fleet's order."""
    addresses = (ep.address for v in m.versions if version in (MODEL, v.name) for ep in v.endpoints)
    return [a for a in dict.fromkeys(addresses) if a in draining]


def _message(
    fleet: Fleet, m: Model, version: str, d: Decision, remove: tuple[str, ...], draining: list[str]
) -> autoscaling_pb2.ModelScaling:
    policy = fleet.scaling_of(m)
    msg = autoscaling_pb2.ModelScaling(
        model=m.name,
        version=version,
        desired=d.desired,
        ready=d.ready,
        demand=d.demand,
        stable_demand=d.stable_demand,
        panic_demand=d.panic_demand,
        target_per_replica=d.target,
        panicking=d.panicking,
        active=d.active(policy),
        reason=d.reason,
        idle_seconds=d.idle_s,
        forecast_method=d.forecast_method,
        lead_seconds=d.lead_s,
        min=policy.min_replicas,
        max=policy.max_replicas,
        remove=remove,
        draining=draining,
    )
    if d.predicted_demand is not None:
        msg.predicted_demand = d.predicted_demand
    return msg
