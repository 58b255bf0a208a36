"""From loads to the weights each cluster gets, one update at a time (pure).

`Weigher.update` runs every model's policy (its own or its tier's) over the loads of each
of its versions' endpoints, smooths the result against the weights in force, and returns
only the clusters whose weights changed, so the reconciler publishes nothing when nothing
moved. Held-out endpoints (weight 0) come back at their target at once; the smoothing
and slow start live in `policies`. Endpoints the control plane cannot see are held out or
kept per cluster (`sight`), before the policy runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from controlplane.balancing.policies import (
    POLICIES,
    PolicyConfig,
    SmoothingConfig,
    smooth,
)
from controlplane.balancing.sight import judge_sight
from controlplane.fleet.model import Endpoint, Fleet, Model
from controlplane.resources.names import cluster_name
from controlplane.signals.load import EndpointLoad, counted

LoadOf = Callable[[Model, Endpoint], EndpointLoad]


def policy_config(fleet: Fleet) -> PolicyConfig:
    """The policy knobs the fleet file sets (signals section); the rest keep defaults."""
    s = fleet.signals
    return dataclasses.replace(
        PolicyConfig(),
        stale_after_s=s.stale_after_s,
        stale_full_s=s.stale_full_s,
        slow_start_s=s.slow_start_s,
    )


def utilisation(load: EndpointLoad) -> float:
    """Requests in flight (running + waiting) per unit of capacity."""
    return (counted(load.running) + counted(load.waiting)) / load.capacity if load.capacity > 0 else 0.0


def load_balance_degree(loads: Sequence[EndpointLoad]) -> float:
    """The seed's L: the standard deviation of ready endpoints' utilisation (0 = even)."""
    u = [utilisation(e) for e in loads if e.ready]
    if len(u) < 2:
        return 0.0
    mean = sum(u) / len(u)
    return math.sqrt(sum((x - mean) ** 2 for x in u) / len(u))


LEARNT_CAPACITY_FLOOR = 0.1


def relative_capacity(
    declared: Mapping[str, float | None], learnt: Mapping[str, float | None]
) -> dict[str, float]:
    """Each endpoint's capacity: the declared one (GPU class or endpoint), else its learnt
    throughput relative to the best learnt throughput among its peers (so the fastest is 1.0,
    and no server drops below 0.1), else 1.0. Learning needs at least two endpoints with a
    learnt throughput to compare."""
    known = [v for v in learnt.values() if v is not None and v > 0]
    best = max(known) if len(known) >= 2 else None
    out: dict[str, float] = {}
    for addr, cap in declared.items():
        if cap is not None:
            out[addr] = cap
        elif best is not None and (mine := learnt.get(addr)) is not None and mine > 0:
            out[addr] = max(LEARNT_CAPACITY_FLOOR, mine / best)
        else:
            out[addr] = 1.0
    return out


@dataclasses.dataclass(frozen=True)
class ClusterView:
    """One cluster after an update: its model, policy, the loads seen and the weights in force."""

    model: str
    version: str
    policy: str
    loads: tuple[EndpointLoad, ...]
    weights: Mapping[str, int]
    out_of_sight: int = 0  # endpoints whose probes go unanswered
    kept_out_of_sight: int = 0  # ...kept serving, as the rest of the cluster cannot vouch (fail static)


class Weigher:
    """Holds the weights in force per cluster and moves them towards each policy's target."""

    def __init__(self, smoothing: SmoothingConfig | None = None) -> None:
        self.smoothing = smoothing or SmoothingConfig()
        self.current: dict[str, dict[str, int]] = {}
        self.views: dict[str, ClusterView] = {}
        # Clusters whose weights could not be computed in the latest update, and why (their
        # weights in force stay; the weight loop logs and counts them).
        self.errors: dict[str, str] = {}

    @staticmethod
    def _load(fleet: Fleet, model: Model, ep: Endpoint, load_of: LoadOf) -> EndpointLoad:
        load = load_of(model, ep)
        fits = fleet.fits(model, ep)
        preferred = ep.gpu is not None and ep.gpu in model.preferred_gpus
        if fits != load.fits or preferred != load.preferred:  # copied only when they differ
            load = dataclasses.replace(load, fits=fits, preferred=preferred)
        if model.affinity is not None:
            # Hashed: only the declared capacity (or 1.0), which changes with the fleet file
            # alone; a learnt one drifts with the load, and every drift would move keys.
            declared = fleet.capacity_of(ep)
            if declared != load.capacity:
                load = dataclasses.replace(load, capacity=declared)
        return load

    def update(self, fleet: Fleet, load_of: LoadOf) -> dict[str, dict[str, int]]:
        """Recompute every cluster; return {cluster: weights} for those that changed."""
        cfg = policy_config(fleet)
        changed: dict[str, dict[str, int]] = {}
        views: dict[str, ClusterView] = {}
        errors: dict[str, str] = {}
        for model in fleet.models:
            # Consistent hashing maps keys by weight: moving weights would move sessions. A
            # hashed model's weights are its servers' declared capacities, which change only
            # with the fleet file (0 still holds out); Envoy's bounded load, judged against
            # those weights, does the balancing by load.
            policy_name = "capacity" if model.affinity is not None else fleet.policy_of(model)
            policy = POLICIES[policy_name]
            for version in model.versions:
                cname = cluster_name(model.name, version.name)
                try:
                    sight = judge_sight([self._load(fleet, model, ep, load_of) for ep in version.endpoints])
                    loads = sight.loads
                    target = policy(loads, cfg)
                except Exception as e:  # one cluster's bad data never stops the others' updates
                    errors[cname] = f"{type(e).__name__}: {e}"
                    if cname in self.views:
                        views[cname] = self.views[cname]  # its weights in force stay
                    continue
                previous = self.current.get(cname, {})
                weights = smooth(previous, target, self.smoothing)
                if weights != previous:
                    changed[cname] = weights
                    self.current[cname] = weights
                views[cname] = ClusterView(
                    model.name, version.name, policy_name, loads, weights, sight.out_of_sight, sight.kept
                )
        for gone in [c for c in self.current if c not in views]:
            del self.current[gone]
        self.views = views
        self.errors = errors
        return changed
