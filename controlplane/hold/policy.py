"""Which models hold their requests now, and where held requests may go (pure).

A model *holds* when none of the clusters its requests are routed to (the stable version, or
a rollout's split) has a server with weight: every server is loading, held out or gone, or
the model is scaled to zero. Its routes then go to the control plane's holding service
(routing/translate.py) instead of answering 503, and the service sends each request on to a
ready server as soon as there is one. Models served over HTTP/2 (gRPC) and models with
`autoscaling.hold_max: 0` never hold.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from controlplane.fleet.model import Fleet, Model
from controlplane.resources.names import cluster_name
from controlplane.routing.translate import RoutingOverlay

Weights = Mapping[str, Mapping[str, int]]  # cluster -> address -> weight


def routed(model: Model, overlay: RoutingOverlay) -> list[tuple[str, int]]:
    """(cluster, percent) the model's plain requests go to."""
    split = overlay.splits.get(model.name, ())
    if split:
        return [(cluster_name(model.name, v), p) for v, p in split]
    return [(cluster_name(model.name, model.stable), 100)]


def _routed_endpoints(model: Model, overlay: RoutingOverlay) -> Iterator[tuple[str, str, int]]:
    """(cluster, address, percent) of every server the model's requests may go to, draining
    ones left out (they take no new requests)."""
    versions = {cluster_name(model.name, v.name): v for v in model.versions}
    for cname, percent in routed(model, overlay):
        version = versions.get(cname)
        if version is None or percent <= 0:
            continue
        for ep in version.endpoints:
            if ep.address not in overlay.draining:
                yield cname, ep.address, percent


def ready_servers(
    fleet: Fleet, model: Model, overlay: RoutingOverlay, weights: Weights
) -> tuple[tuple[str, int], ...]:
    """(address, weight x percent) of the servers the model's requests may go to now: those
    the signals have weighed and given weight, as Envoy sees them. (A server that joined a
    running control plane has weight only once the probes heard it say it is ready.)

    A server not weighed yet (a version that arrived with this edit, before the next signals
    round) does not count. (Counting it with the default weight, as build_assignment sends
    it, sent a restarted control plane's first routes straight to a cluster the proxy was
    still warming: 503s in the restart corner test. The holding cluster is always warm.)"""
    out = []
    for cname, address, percent in _routed_endpoints(model, overlay):
        w = weights.get(cname, {}).get(address, 0)
        if w > 0:
            out.append((address, w * percent))
    return tuple(out)


def can_hold(fleet: Fleet, model: Model) -> bool:
    return model.protocol == "http1" and fleet.scaling_of(model).hold_max > 0


def candidate_servers(model: Model, overlay: RoutingOverlay) -> tuple[tuple[str, int], ...]:
    """(address, percent) of every server the model's requests may go to, ready or not (the
    holding service tries them when none is known ready)."""
    return tuple((address, percent) for _, address, percent in _routed_endpoints(model, overlay))
