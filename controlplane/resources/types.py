"""The xDS resource types the control plane serves, and their short labels in metrics."""

from __future__ import annotations

LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
TYPE_URLS = (CLUSTER, ENDPOINT, LISTENER, ROUTE)  # the ADS make-before-break order

TYPE_LABELS = {LISTENER: "listener", ROUTE: "route", CLUSTER: "cluster", ENDPOINT: "endpoint"}


def type_label(type_url: str) -> str:
    """A short label for an xDS type URL: listener, route, cluster, endpoint (else 'other')."""
    return TYPE_LABELS.get(type_url, "other")
