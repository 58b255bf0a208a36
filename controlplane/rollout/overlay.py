"""How API-made state combines with the operator's fleet file (pure).

The file stays the operator's own; the API adds, per model, a layer on top of it:

- A rollout in progress splits the model's traffic between stable and canary.
- A rollout at 100% makes the old stable leave (no route names it, not even the
  x-model-version one); once it completes, the canary is the model's stable version and
  the old stable drains (once no proxy's routes name it), then is retired (its cluster
  removed), even though the file still says otherwise.
- An aborted rollout's canary drains and is retired the same way.
- A drained endpoint (`cpctl endpoints drain`) is sent as DRAINING, then removed.

Each model's layer is recorded with the file's `stable` at the time (`file_stable`). It holds
while the file's `stable` for that model is unchanged, so a file reload never silently
undoes an API action; once the operator edits the file's `stable`, the file wins and the
layer is dropped (the caller does that, and audits it). Endpoint drains hold until undrained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from controlplane.fleet.model import Fleet, Model, Version
from controlplane.resources.names import cluster_name
from controlplane.rollout.machine import Rollout
from controlplane.routing.translate import RoutingOverlay

# A version traffic left: leaving (routes moved off it, endpoints untouched until every proxy
# has the new routes), then draining (endpoints DRAINING), then retired (cluster removed).
VersionState = Literal["leaving", "draining", "retired"]
DrainState = Literal["draining", "drained"]


@dataclass(frozen=True)
class ModelLayer:
    """API-made changes to one model, valid while the file's stable is `file_stable`."""

    model: str
    file_stable: str
    stable: str | None = None  # the promoted version, when a rollout completed
    versions: Mapping[str, tuple[VersionState, float]] = field(default_factory=dict)  # -> (state, since)

    def with_version(self, version: str, state: VersionState | None, since: float) -> ModelLayer:
        """The layer with one version draining, retired, or (None) back in service."""
        versions = {v: s for v, s in self.versions.items() if v != version}
        if state is not None:
            versions[version] = (state, since)
        return replace(self, versions=versions)


@dataclass(frozen=True)
class EndpointDrain:
    address: str
    state: DrainState
    started_at: float  # Unix time
    timeout_s: float
    who: str
    reason: str


def active(r: Rollout | None) -> bool:
    return r is not None and r.phase in ("Progressing", "Paused")


def stale_layers(fleet: Fleet, layers: Iterable[ModelLayer]) -> list[ModelLayer]:
    """Layers the file has moved past: the model is gone or its file `stable` changed."""
    by_name = {m.name: m for m in fleet.models}
    return [
        layer
        for layer in layers
        if layer.model not in by_name or by_name[layer.model].stable != layer.file_stable
    ]


def effective(
    fleet: Fleet,
    layers: Mapping[str, ModelLayer],
    rollouts: Mapping[str, Rollout],
    drains: Mapping[str, EndpointDrain],
) -> tuple[Fleet, RoutingOverlay]:
    """The fleet as served (stable overridden, retired versions and drained endpoints left
    out) and the routing overlay (splits of running rollouts, DRAINING endpoints).

    Layers whose `file_stable` no longer matches the file are ignored here."""
    models: list[Model] = []
    splits: dict[str, tuple[tuple[str, int], ...]] = {}
    shadow: dict[str, tuple[str, int]] = {}
    draining: set[str] = {a for a, d in drains.items() if d.state == "draining"}
    removed = {a for a, d in drains.items() if d.state == "drained"}
    unrouted: set[str] = set()
    for m in fleet.models:
        layer = layers.get(m.name)
        if layer is not None and layer.file_stable != m.stable:
            layer = None
        names = {v.name for v in m.versions}
        stable = layer.stable if layer is not None and layer.stable in names else m.stable
        r = rollouts.get(m.name)
        running = active(r) and r is not None and {r.spec.stable, r.spec.canary} <= names
        keep = {stable} | ({r.spec.stable, r.spec.canary} if running and r is not None else set())
        versions: list[Version] = []
        for v in m.versions:
            state = layer.versions.get(v.name, (None, 0.0))[0] if layer is not None else None
            if state == "retired" and v.name not in keep:
                continue
            if state in ("leaving", "draining"):
                unrouted.add(cluster_name(m.name, v.name))  # not even by x-model-version
            if state == "draining" and v.name not in keep:
                draining.update(ep.address for ep in v.endpoints)
            eps = tuple(ep for ep in v.endpoints if ep.address not in removed)
            versions.append(v if len(eps) == len(v.endpoints) else replace(v, endpoints=eps))
        models.append(replace(m, stable=stable, versions=tuple(versions)))
        if running and r is not None:
            splits[m.name] = tuple((v, w) for v, w in r.weights.items() if w > 0)
            if r.spec.shadow_percent > 0:
                shadow[m.name] = (r.spec.canary, r.spec.shadow_percent)
    return replace(fleet, models=tuple(models)), RoutingOverlay(
        splits=splits, draining=frozenset(draining), shadow=shadow, unrouted=frozenset(unrouted)
    )
