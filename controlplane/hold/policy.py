"""Which models hold their requests now, and where held requests may go (pure).

A model *holds* when none of the clusters its requests are routed to (the stable version, or
a rollout's split) has a server with weight: every server is loading, held out or gone, or
the model is scaled to zero. Its routes then go to the control plane's holding service
(routing/translate.py) instead of answering 503, and the service sends each request on to a
ready server as soon as there is one. Models served over HTTP/2 (gRPC) and models with
`autoscaling.hold_max: 0` never hold.
"""

from __future__ import annotations

from collections.abc import Mapping

from controlplane.fleet.model import Fleet, Model
from controlplane.routing.names import cluster_name
from controlplane.routing.translate import RoutingOverlay

Weights = Mapping[str, Mapping[str, int]]  # cluster -> address -> weight


def routed(model: Model, overlay: RoutingOverlay) -> list[tuple[str, int]]:
    """(cluster, percent) the model's plain requests go to."""
    split = overlay.splits.get(model.name, ())
    if split:
        return [(cluster_name(model.name, v), p) for v, p in split]
    return [(cluster_name(model.name, model.stable), 100)]


def ready_servers(
    fleet: Fleet, model: Model, overlay: RoutingOverlay, weights: Weights
) -> tuple[tuple[str, int], ...]:
    """(address, weight x percent) of the servers the model's requests may go to now: those
    the signals have weighed and given weight, as Envoy sees them. (A server that joined a
    running control plane has weight only once the probes heard it say it is ready.)"""
    out: list[tuple[str, int]] = []
    for cname, percent in routed(model, overlay):
        version = next((v for v in model.versions if cluster_name(model.name, v.name) == cname), None)
        if version is None or percent <= 0:
            continue
        known = weights.get(cname)
        for ep in version.endpoints:
            if ep.address in overlay.draining:
                continue  # takes no new requests
            w = known.get(ep.address, 0) if known is not None else 0
            if w > 0:
                out.append((ep.address, w * percent))
    return tuple(out)


def can_hold(fleet: Fleet, model: Model) -> bool:
    return model.protocol == "http1" and fleet.scaling_of(model).hold_max > 0


def candidate_servers(model: Model, overlay: RoutingOverlay) -> tuple[tuple[str, int], ...]:
    """(address, percent) of every server the model's requests may go to, ready or not (the
    holding service tries them when none is known ready)."""
    out: list[tuple[str, int]] = []
    for cname, percent in routed(model, overlay):
        for v in model.versions:
            if cluster_name(model.name, v.name) == cname and percent > 0:
                out += [(ep.address, percent) for ep in v.endpoints if ep.address not in overlay.draining]
    return tuple(out)
