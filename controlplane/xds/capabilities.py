"""What each proxy can apply, from the version it reports, and resources adapted to it (pure).

An Envoy older than a feature we use rejects the whole resource (an unknown filter, an
unknown field in a typed config), and a rejected listener or cluster next to a fleet
change is how traffic goes dark. So each resource records the features it needs, each
stream learns its proxy's version from its node (`user_agent_build_version`), and a
proxy that lacks a feature gets the resource without it (a documented fallback), or, below
the oldest version we can configure at all, nothing and a precise status.

Versions are those of the Envoy release that first applied the feature (its changelogs).
Clients that do not say they are Envoy (proxyless gRPC, tools) are not second-guessed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.http.set_filter_state.v3 import set_filter_state_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.maglev.v3 import maglev_pb2
from envoy.extensions.load_balancing_policies.ring_hash.v3 import ring_hash_pb2
from google.protobuf.message import Message

Version = tuple[int, int, int]

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
HCM = "envoy.filters.network.http_connection_manager"
JSON_TO_METADATA_FILTER = "envoy.filters.http.json_to_metadata"
SET_FILTER_STATE_FILTER = "envoy.filters.http.set_filter_state"


@dataclass(frozen=True)
class Feature:
    key: str
    since: Version  # the first Envoy release that applies it
    name: str
    instead: str  # what a proxy without it gets


TYPED_LB = Feature(
    "typed_lb",
    (1, 26, 0),
    "typed load_balancing_policy extensions",
    "the same policy through the legacy lb_policy field",
)
FULL_SCAN = Feature(
    "full_scan",
    (1, 30, 0),
    "least request FULL_SCAN selection",
    "least request over two random choices (Envoy's default)",
)
JSON_TO_METADATA = Feature(
    "json_to_metadata",
    (1, 28, 0),
    "the json_to_metadata filter",
    "no routing by the JSON body's model field: requests must name their model in x-model",
)
HASHABLE_STRING = Feature(
    "hashable_string",
    (1, 38, 0),
    "hashable filter state (envoy.hashable_string)",
    "no affinity by a JSON body field: those requests are balanced by least request",
)
FEATURES = (TYPED_LB, FULL_SCAN, JSON_TO_METADATA, HASHABLE_STRING)
# Below this, an Envoy cannot take our routes at all (routing on dynamic metadata: 1.20).
OLDEST_ENVOY: Version = (1, 20, 0)


@dataclass(frozen=True)
class Capabilities:
    """What one proxy can apply."""

    client: str = ""  # "envoy", "grpc", or the user agent as sent
    version: str = ""  # as the proxy reports it, e.g. "1.40.0"
    missing: frozenset[str] = frozenset()  # Feature.key of what it lacks
    unsupported: str = ""  # set when it is too old to configure at all: why

    def notes(self) -> list[str]:
        """One line per feature it lacks: what it gets instead."""
        out = [self.unsupported] if self.unsupported else []
        for f in FEATURES:
            if f.key in self.missing:
                since = ".".join(map(str, f.since))
                out.append(f"Envoy {self.version} lacks {f.name} (Envoy {since}+): it gets {f.instead}")
        return out


EVERYTHING = Capabilities()


def of_node(node: base_pb2.Node | None) -> Capabilities:
    """A proxy's capabilities from the node it sends (Envoy fills user_agent_build_version)."""
    if node is None:
        return EVERYTHING
    agent = node.user_agent_name
    if agent.startswith("gRPC"):
        return Capabilities(client="grpc", version=node.user_agent_version)
    if agent != "envoy" or not node.HasField("user_agent_build_version"):
        return Capabilities(client=agent, version=node.user_agent_version)
    v = node.user_agent_build_version.version
    version: Version = (v.major_number, v.minor_number, v.patch)
    text = ".".join(map(str, version))
    if version < OLDEST_ENVOY:
        oldest = ".".join(map(str, OLDEST_ENVOY))
        return Capabilities(
            client="envoy",
            version=text,
            unsupported=(
                f"Envoy {text} is older than {oldest}, the oldest this control plane can configure "
                "(routes on dynamic metadata); it is sent nothing and keeps what it has"
            ),
        )
    missing = frozenset(f.key for f in FEATURES if version < f.since)
    return Capabilities(client="envoy", version=text, missing=missing)


def needs(type_url: str, msg: Message) -> frozenset[str]:
    """The features (Feature.key) a resource uses that some Envoy versions lack."""
    out: set[str] = set()
    if type_url == CLUSTER and isinstance(msg, cluster_pb2.Cluster):
        policies = msg.load_balancing_policy.policies
        if policies:
            out.add(TYPED_LB.key)
            first = policies[0].typed_extension_config.typed_config
            if first.Is(least_request_pb2.LeastRequest.DESCRIPTOR):
                lr = least_request_pb2.LeastRequest()
                first.Unpack(lr)
                if lr.selection_method == least_request_pb2.LeastRequest.FULL_SCAN:
                    out.add(FULL_SCAN.key)
    elif type_url == LISTENER and isinstance(msg, listener_pb2.Listener):
        for hcm in _hcms(msg):
            for f in hcm.http_filters:
                if f.name == JSON_TO_METADATA_FILTER:
                    out.add(JSON_TO_METADATA.key)
                elif f.name == SET_FILTER_STATE_FILTER and _hashable(f):
                    out.add(HASHABLE_STRING.key)
    return frozenset(out)


def adapt(type_url: str, msg: Message, missing: Iterable[str]) -> Message:
    """A copy of `msg` without the features in `missing`, each replaced by its fallback."""
    lacking = frozenset(missing)
    out = type(msg)()
    out.CopyFrom(msg)
    if isinstance(out, cluster_pb2.Cluster):
        if FULL_SCAN.key in lacking:
            _without_full_scan(out)
        if TYPED_LB.key in lacking:
            _legacy_lb(out)
    elif isinstance(out, listener_pb2.Listener):
        drop = set()
        if JSON_TO_METADATA.key in lacking:
            drop |= {JSON_TO_METADATA_FILTER, SET_FILTER_STATE_FILTER}  # the state comes from it
        if HASHABLE_STRING.key in lacking:
            drop.add(SET_FILTER_STATE_FILTER)
        if drop:
            _without_filters(out, drop)
    return out


def _hcms(listener: listener_pb2.Listener) -> list[hcm_pb2.HttpConnectionManager]:
    out = []
    for chain in listener.filter_chains:
        for f in chain.filters:
            if f.name == HCM:
                hcm = hcm_pb2.HttpConnectionManager()
                f.typed_config.Unpack(hcm)
                out.append(hcm)
    return out


def _hashable(f: hcm_pb2.HttpFilter) -> bool:
    cfg = set_filter_state_pb2.Config()
    f.typed_config.Unpack(cfg)
    return any(v.factory_key == "envoy.hashable_string" for v in cfg.on_request_headers)


def _without_filters(listener: listener_pb2.Listener, names: set[str]) -> None:
    for chain in listener.filter_chains:
        for f in chain.filters:
            if f.name != HCM:
                continue
            hcm = hcm_pb2.HttpConnectionManager()
            f.typed_config.Unpack(hcm)
            kept = [h for h in hcm.http_filters if h.name not in names]
            del hcm.http_filters[:]
            hcm.http_filters.extend(kept)
            f.typed_config.Pack(hcm)


def _without_full_scan(c: cluster_pb2.Cluster) -> None:
    for p in c.load_balancing_policy.policies:
        cfg = p.typed_extension_config.typed_config
        if cfg.Is(least_request_pb2.LeastRequest.DESCRIPTOR):
            lr = least_request_pb2.LeastRequest()
            cfg.Unpack(lr)
            lr.ClearField("selection_method")
            cfg.Pack(lr)


def _legacy_lb(c: cluster_pb2.Cluster) -> None:
    """The first typed policy, through the fields Envoy had before typed policies."""
    policies = c.load_balancing_policy.policies
    first = policies[0].typed_extension_config.typed_config if policies else None
    c.ClearField("load_balancing_policy")
    if first is None:
        return
    if first.Is(least_request_pb2.LeastRequest.DESCRIPTOR):
        c.lb_policy = cluster_pb2.Cluster.LEAST_REQUEST
    elif first.Is(ring_hash_pb2.RingHash.DESCRIPTOR):
        rh = ring_hash_pb2.RingHash()
        first.Unpack(rh)
        c.lb_policy = cluster_pb2.Cluster.RING_HASH
        _bounded_load(c, rh.consistent_hashing_lb_config.hash_balance_factor.value)
    elif first.Is(maglev_pb2.Maglev.DESCRIPTOR):
        mg = maglev_pb2.Maglev()
        first.Unpack(mg)
        c.lb_policy = cluster_pb2.Cluster.MAGLEV
        _bounded_load(c, mg.consistent_hashing_lb_config.hash_balance_factor.value)
    else:
        c.lb_policy = cluster_pb2.Cluster.ROUND_ROBIN


def _bounded_load(c: cluster_pb2.Cluster, factor: int) -> None:
    if factor:
        c.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value = factor
