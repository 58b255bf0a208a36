from __future__ import annotations

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.service.discovery.v3 import discovery_pb2

from controlplane.fleet import parse_fleet
from controlplane.routing.translate import CLUSTER, LISTENER, translate
from controlplane.xds import capabilities
from controlplane.xds.events import Send
from controlplane.xds.protocol import XdsStream
from controlplane.xds.snapshot import build_snapshot
from tests.fleets import BASIC

AFFINITY = BASIC.replace(
    "    stable: v1\n", "    stable: v1\n    affinity: {body: prompt_cache_key, algorithm: ring_hash}\n", 1
)
PLAIN = BASIC


def envoy(version: tuple[int, int, int] | None, agent: str = "envoy") -> base_pb2.Node:
    node = base_pb2.Node(id="n", user_agent_name=agent)
    if version is not None:
        v = node.user_agent_build_version.version
        v.major_number, v.minor_number, v.patch = version
    return node


@pytest.mark.parametrize(
    ("version", "missing"),
    [
        ((1, 40, 0), set()),
        ((1, 38, 0), set()),
        ((1, 37, 2), {"hashable_string"}),
        ((1, 30, 0), {"hashable_string"}),
        ((1, 29, 9), {"hashable_string", "full_scan"}),
        ((1, 28, 0), {"hashable_string", "full_scan"}),
        ((1, 27, 7), {"hashable_string", "full_scan", "json_to_metadata"}),
        ((1, 25, 0), {"hashable_string", "full_scan", "json_to_metadata", "typed_lb"}),
    ],
)
def test_what_an_envoy_lacks_follows_its_version(version: tuple[int, int, int], missing: set[str]) -> None:
    caps = capabilities.of_node(envoy(version))
    assert caps.missing == missing and caps.client == "envoy" and not caps.unsupported
    assert len(caps.notes()) == len(missing)
    assert all(".".join(map(str, version)) in n for n in caps.notes())


def test_an_envoy_too_old_to_configure_is_told_why() -> None:
    caps = capabilities.of_node(envoy((1, 19, 3)))
    assert "1.19.3 is older than 1.20.0" in caps.unsupported
    assert caps.notes() == [caps.unsupported]


@pytest.mark.parametrize(
    "node",
    [
        None,
        envoy(None),  # Envoy without a version: not second-guessed
        envoy((1, 9, 0), agent="gRPC C-core linux Python"),  # not an Envoy version at all
        envoy((1, 9, 0), agent="my-tool"),
    ],
)
def test_clients_that_do_not_say_they_are_envoy_get_everything(node: base_pb2.Node | None) -> None:
    caps = capabilities.of_node(node)
    assert not caps.missing and not caps.unsupported


def _resources(text: str) -> tuple[cluster_pb2.Cluster, listener_pb2.Listener]:
    d = translate(parse_fleet(text))
    c, lst = d.by_type[CLUSTER]["llama-3-8b@v1"], d.by_type[LISTENER]["inference"]
    assert isinstance(c, cluster_pb2.Cluster) and isinstance(lst, listener_pb2.Listener)
    return c, lst


def _filters(lst: listener_pb2.Listener) -> list[str]:
    hcm = hcm_pb2.HttpConnectionManager()
    lst.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return [f.name for f in hcm.http_filters]


def test_resources_say_what_they_need() -> None:
    c, lst = _resources(PLAIN)
    assert capabilities.needs(CLUSTER, c) == {"typed_lb", "full_scan"}
    assert capabilities.needs(LISTENER, lst) == {"json_to_metadata"}
    c, lst = _resources(AFFINITY)
    assert capabilities.needs(CLUSTER, c) == {"typed_lb"}  # ring hash: no least request
    assert capabilities.needs(LISTENER, lst) == {"json_to_metadata", "hashable_string"}


def test_least_request_uses_the_selection_method_envoy_reads() -> None:
    c, _ = _resources(PLAIN)
    lr = least_request_pb2.LeastRequest()
    c.load_balancing_policy.policies[0].typed_extension_config.typed_config.Unpack(lr)
    assert lr.selection_method == least_request_pb2.LeastRequest.FULL_SCAN
    assert not lr.HasField("enable_full_scan")  # deprecated and ignored by Envoy


def test_fallbacks_drop_only_what_is_missing() -> None:
    c, lst = _resources(PLAIN)
    lr = least_request_pb2.LeastRequest()
    no_scan = capabilities.adapt(CLUSTER, c, {"full_scan"})
    assert isinstance(no_scan, cluster_pb2.Cluster)
    no_scan.load_balancing_policy.policies[0].typed_extension_config.typed_config.Unpack(lr)
    assert lr.selection_method == least_request_pb2.LeastRequest.N_CHOICES
    assert capabilities.needs(CLUSTER, no_scan) == {"typed_lb"}
    legacy = capabilities.adapt(CLUSTER, c, {"full_scan", "typed_lb"})
    assert isinstance(legacy, cluster_pb2.Cluster)
    assert legacy.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST and not legacy.HasField(
        "load_balancing_policy"
    )
    assert capabilities.needs(CLUSTER, legacy) == frozenset()
    assert c.HasField("load_balancing_policy")  # the original is untouched
    body = capabilities.adapt(LISTENER, lst, {"json_to_metadata"})
    assert isinstance(body, listener_pb2.Listener)
    assert "envoy.filters.http.json_to_metadata" not in _filters(body)
    assert _filters(body)[-1] == "envoy.filters.http.router"


def test_affinity_fallbacks() -> None:
    c, lst = _resources(AFFINITY)
    legacy = capabilities.adapt(CLUSTER, c, {"typed_lb"})
    assert isinstance(legacy, cluster_pb2.Cluster)
    assert legacy.lb_policy == cluster_pb2.Cluster.RING_HASH
    assert legacy.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value > 100
    no_hash = capabilities.adapt(LISTENER, lst, {"hashable_string"})
    assert isinstance(no_hash, listener_pb2.Listener)
    assert "envoy.filters.http.set_filter_state" not in _filters(no_hash)
    assert "envoy.filters.http.json_to_metadata" in _filters(no_hash)  # body routing stays
    no_body = capabilities.adapt(LISTENER, lst, {"json_to_metadata"})
    assert isinstance(no_body, listener_pb2.Listener)
    # The filter state is made from what json_to_metadata reads: both go.
    assert not {"envoy.filters.http.set_filter_state", "envoy.filters.http.json_to_metadata"} & set(
        _filters(no_body)
    )


def _first_responses(node: base_pb2.Node) -> dict[str, discovery_pb2.DiscoveryResponse]:
    s = XdsStream(build_snapshot(translate(parse_fleet(PLAIN)), 1, 1.0), delta=False)
    out = {}
    for t in (CLUSTER, LISTENER):
        r = discovery_pb2.DiscoveryRequest(type_url=t)
        r.node.CopyFrom(node)
        [send] = [e for e in s.receive(r, 0) if isinstance(e, Send)]
        out[t] = discovery_pb2.DiscoveryResponse.FromString(send.payload)
    return out


def test_a_stream_sends_each_proxy_what_its_version_applies() -> None:
    new = _first_responses(envoy((1, 40, 0)))
    old = _first_responses(envoy((1, 27, 0)))
    c_new = cluster_pb2.Cluster.FromString(new[CLUSTER].resources[0].value)
    c_old = cluster_pb2.Cluster.FromString(old[CLUSTER].resources[0].value)
    assert capabilities.needs(CLUSTER, c_new) == {"typed_lb", "full_scan"}
    assert capabilities.needs(CLUSTER, c_old) == {"typed_lb"}
    l_old = listener_pb2.Listener.FromString(old[LISTENER].resources[0].value)
    assert "envoy.filters.http.json_to_metadata" not in _filters(l_old)
    assert new[CLUSTER].version_info != old[CLUSTER].version_info


def test_a_too_old_envoy_is_sent_nothing_and_its_status_says_why() -> None:
    s = XdsStream(build_snapshot(translate(parse_fleet(PLAIN)), 1, 1.0), delta=False)
    r = discovery_pb2.DiscoveryRequest(type_url=CLUSTER)
    r.node.CopyFrom(envoy((1, 18, 0)))
    assert [e for e in s.receive(r, 0) if isinstance(e, Send)] == []
    assert s.status(CLUSTER) == "NOT_SENT"
    assert "older than 1.20.0" in s.reason(CLUSTER)
