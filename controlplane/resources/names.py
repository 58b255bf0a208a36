"""Stable, readable names for generated resources."""

from __future__ import annotations

import re

GATEWAY_LISTENER = "inference"
GATEWAY_ROUTES = "inference"
# The control plane's holding service (hold/): a model with no ready server routes there.
HOLD_CLUSTER = "controlplane-hold"
HOLD_MODEL_HEADER = "x-controlplane-hold-model"  # which model a held request is for
MODEL_HEADER = "x-model"  # the model (or adapter) a request names, read before its body's
METADATA_NS = "controlplane"  # the dynamic-metadata namespace of what the gateway reads from requests
PICKER_CLUSTER = "controlplane-picker"  # the per-request endpoint pickers (picker/)
RATELIMIT_CLUSTER = "controlplane-ratelimit"  # the rate-limit services counting quotas (quota/)
# The Endpoint Picker Protocol's names (Gateway API Inference Extension, proposal 004): the
# picked endpoint (IP:PORT, or several comma-separated to walk on retries), as a request
# header and under the envoy.lb dynamic metadata namespace.
PICKED_HEADER = "x-gateway-destination-endpoint"
PICKED_METADATA_NS = "envoy.lb"
KV_METADATA_NS = "controlplane.kv"  # an EDS endpoint's KV-event publisher, for the picker
ADAPTERS_METADATA_NS = "controlplane.adapters"  # a model's LoRA adapters (its `config`), for the picker
# Envoy's subset key (under envoy.lb) for adapters that only some servers may serve: on an
# endpoint, the list of such adapters it may; on a request, the model it names.
ADAPTER_LB_KEY = "controlplane.adapter"
FLOW_METADATA_NS = "controlplane.flow"  # a cluster's flow control (its `config`), for the picker
SUBSET_METADATA_NS = "envoy.lb.subset_hint"  # the Endpoint Picker Protocol's subset hint, to the picker
_STAT_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def cluster_name(model: str, version: str) -> str:
    """One cluster per model version, e.g. `llama-3-8b@v1`."""
    return f"{model}@{version}"


def api_listener_name(model: str) -> str:
    """The API listener a proxyless gRPC client dialing xds:///<model> asks for."""
    return model


def api_route_name(model: str) -> str:
    """The route configuration behind a model's API listener."""
    return f"grpc/{model}"


def stat_name(name: str) -> str:
    """A name safe for Envoy stats (dots would split Envoy's tag extraction)."""
    return _STAT_UNSAFE.sub("_", name)


def model_of_cluster(cluster: str) -> str | None:
    """The model a generated cluster name belongs to (`llama-3-8b@v1` -> `llama-3-8b`)."""
    model, sep, version = cluster.rpartition("@")
    return model if sep and model and version else None
