"""What Envoy gets for models with `balancing: picker` (routing/translate.py, clusters.py), and
the fleet file's `picker:` checks (fleet/schema.py)."""

from __future__ import annotations

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from google.protobuf.message import Message

from controlplane.fleet import FleetConfigInvalid, parse_fleet
from controlplane.resources import names
from controlplane.routing.incremental import IncrementalTranslator
from controlplane.routing.translate import CLUSTER, EXT_PROC_FILTER, LISTENER, PICKED_MODE, ROUTE, translate

FLEET = """
listener: {port: 10000}
picker: {endpoints: ['127.0.0.1:18090', '127.0.0.1:18091']%s}
tiers:
  small: {max_params_b: 20, balancing: picker}
  large: {}
models:
  picked: {params_b: 1, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9001']}}}
  weighed: {params_b: 70, tier: large, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9002']}}}
"""


def _hcm(listener: Message) -> hcm_pb2.HttpConnectionManager:
    assert isinstance(listener, listener_pb2.Listener)
    hcm = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def _routes(rc: Message) -> dict[str, route_components_pb2.Route]:
    assert isinstance(rc, route_pb2.RouteConfiguration)
    return {r.name: r for vh in rc.virtual_hosts for r in vh.routes}


def test_a_picked_model_asks_the_picker_and_falls_back_to_the_weights() -> None:
    d = translate(parse_fleet(FLEET % ""))
    hcm = _hcm(d.by_type[LISTENER][names.GATEWAY_LISTENER])
    filters = [f.name for f in hcm.http_filters]
    assert filters.index(EXT_PROC_FILTER) == len(filters) - 2  # just before the router
    ext = next(f for f in hcm.http_filters if f.name == EXT_PROC_FILTER)
    assert not ext.disabled  # Envoy would decide that before the body names the route
    cfg = ext_proc_pb2.ExternalProcessor()
    ext.typed_config.Unpack(cfg)
    assert cfg.failure_mode_allow
    assert cfg.grpc_service.envoy_grpc.cluster_name == names.PICKER_CLUSTER
    assert cfg.message_timeout.ToNanoseconds() == 5_000_000  # the default budget, 5 ms
    mode = cfg.processing_mode
    # Headers only: with no body sent, fail-open holds at every moment (Envoy PR #41276). The
    # response's headers tell the picker the request ended, and where it went: asked for by a
    # pick (the one override allowed), never by default, so a local reply the picker was not
    # asked about (a quota's 429) opens no stream to it.
    assert mode.request_header_mode == processing_mode_pb2.ProcessingMode.SEND
    assert mode.request_body_mode == processing_mode_pb2.ProcessingMode.NONE
    assert mode.response_header_mode == processing_mode_pb2.ProcessingMode.SKIP
    assert mode.response_body_mode == processing_mode_pb2.ProcessingMode.NONE
    assert mode.response_trailer_mode == processing_mode_pb2.ProcessingMode.SKIP
    assert cfg.allow_mode_override
    (picked,) = cfg.allowed_override_modes
    assert picked == PICKED_MODE
    assert picked.response_header_mode == processing_mode_pb2.ProcessingMode.SEND
    assert picked.request_body_mode == picked.response_body_mode == processing_mode_pb2.ProcessingMode.NONE
    assert cfg.disable_immediate_response  # a picker names a server; it never answers for one
    assert list(cfg.request_attributes) == ["xds.cluster_name"]
    assert list(cfg.response_attributes) == ["upstream.address"]
    assert list(cfg.metadata_options.receiving_namespaces.untyped) == [names.PICKED_METADATA_NS]
    assert list(cfg.metadata_options.forwarding_namespaces.untyped) == [
        "controlplane",  # the model, and a prefix key where the model has prefix affinity
        names.SUBSET_METADATA_NS,
    ]

    routes = _routes(d.by_type[ROUTE][names.GATEWAY_ROUTES])
    on = {n for n, r in routes.items() if EXT_PROC_FILTER in r.typed_per_filter_config}
    assert on and all("picked" in n for n in on), sorted(on)
    assert any("weighed" in n for n in routes) and not any("weighed" in n for n in on)
    per_route = ext_proc_pb2.ExtProcPerRoute()
    routes[sorted(on)[0]].typed_per_filter_config[EXT_PROC_FILTER].Unpack(per_route)
    assert per_route.HasField("overrides") and not per_route.disabled
    rc = d.by_type[ROUTE][names.GATEWAY_ROUTES]
    assert isinstance(rc, route_pb2.RouteConfiguration)
    rc.virtual_hosts[0].typed_per_filter_config[EXT_PROC_FILTER].Unpack(per_route)
    assert per_route.disabled  # off for every other route

    picked = d.by_type[CLUSTER]["picked@v1"]
    assert isinstance(picked, cluster_pb2.Cluster)
    first = picked.load_balancing_policy.policies[0].typed_extension_config
    assert first.name == "envoy.load_balancing_policies.override_host"
    override = override_host_pb2.OverrideHost()
    first.typed_config.Unpack(override)
    assert override.override_host_sources[0].header == names.PICKED_HEADER
    assert override.override_host_sources[1].metadata.key == names.PICKED_METADATA_NS
    fallback = [p.typed_extension_config.name for p in override.fallback_policy.policies]
    assert fallback[0] == "envoy.load_balancing_policies.least_request"
    # Proxyless gRPC skips what it lacks and takes the round robin behind.
    rest = [p.typed_extension_config.name for p in picked.load_balancing_policy.policies[1:]]
    assert rest[-1] == "envoy.load_balancing_policies.wrr_locality"
    weighed = d.by_type[CLUSTER]["weighed@v1"]
    assert isinstance(weighed, cluster_pb2.Cluster)
    assert weighed.load_balancing_policy.policies[0].typed_extension_config.name.endswith("least_request")

    pc = d.by_type[CLUSTER][names.PICKER_CLUSTER]
    assert isinstance(pc, cluster_pb2.Cluster)
    got = [
        (e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value)
        for loc in pc.load_assignment.endpoints
        for e in loc.lb_endpoints
    ]
    assert got == [("127.0.0.1", 18090), ("127.0.0.1", 18091)]


def test_a_picked_model_with_prefix_affinity_falls_back_to_its_hash() -> None:
    """The picker gets the prefix key; without its answer the model keeps today's hash."""
    text = (FLEET % "").replace(
        "picked: {params_b: 1,", "picked: {params_b: 1, affinity: {prefix: {messages: 1}},"
    )
    d = translate(parse_fleet(text))
    picked = d.by_type[CLUSTER]["picked@v1"]
    assert isinstance(picked, cluster_pb2.Cluster)
    first = picked.load_balancing_policy.policies[0].typed_extension_config
    assert first.name == "envoy.load_balancing_policies.override_host"
    override = override_host_pb2.OverrideHost()
    first.typed_config.Unpack(override)
    fallback = [p.typed_extension_config.name for p in override.fallback_policy.policies]
    assert fallback[0] in ("envoy.load_balancing_policies.maglev", "envoy.load_balancing_policies.ring_hash")
    routes = _routes(d.by_type[ROUTE][names.GATEWAY_ROUTES])
    on = [r for n, r in routes.items() if EXT_PROC_FILTER in r.typed_per_filter_config]
    assert on and all(r.route.hash_policy for r in on)  # the fallback hash has its key


def test_no_picked_model_no_picker_filter_nor_cluster() -> None:
    d = translate(
        parse_fleet(
            (FLEET % "").replace("small: {max_params_b: 20, balancing: picker}", "small: {max_params_b: 20}")
        )
    )
    assert names.PICKER_CLUSTER not in d.by_type[CLUSTER]
    hcm = _hcm(d.by_type[LISTENER][names.GATEWAY_LISTENER])
    assert EXT_PROC_FILTER not in [f.name for f in hcm.http_filters]


def test_the_budget_and_the_incremental_translator_agree() -> None:
    fleet = parse_fleet(FLEET % ", timeout: 20ms")
    full, inc = translate(fleet), IncrementalTranslator().translate(fleet)
    for t in (CLUSTER, LISTENER, ROUTE):
        assert {n: m.SerializeToString(deterministic=True) for n, m in full.by_type[t].items()} == {
            n: m.SerializeToString(deterministic=True) for n, m in inc.by_type[t].items()
        }
    hcm = _hcm(full.by_type[LISTENER][names.GATEWAY_LISTENER])
    cfg = ext_proc_pb2.ExternalProcessor()
    next(f for f in hcm.http_filters if f.name == EXT_PROC_FILTER).typed_config.Unpack(cfg)
    assert cfg.message_timeout.ToNanoseconds() == 20_000_000


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        (FLEET.replace("endpoints: ['127.0.0.1:18090', '127.0.0.1:18091']%s", ""), "tiers.small.balancing",
         "needs the pickers' addresses"),
        (FLEET.replace("small: {max_params_b: 20, balancing: picker}", "small: {max_params_b: 20}").replace(
            "picked: {params_b: 1,", "picked: {params_b: 1, balancing: picker,").replace(
            "endpoints: ['127.0.0.1:18090', '127.0.0.1:18091']%s", ""), "models.picked.balancing",
         "needs the pickers' addresses"),
        (FLEET % ", timeout: 2s", "picker.timeout", "between 1ms and 1000ms"),
        (FLEET.replace("'127.0.0.1:18091']%s", "'picker.local:1']"), "picker.endpoints[1]", "not an IP"),
        (FLEET.replace("'127.0.0.1:18091']%s", "'127.0.0.1:18090']"), "picker.endpoints", "twice"),
        (FLEET.replace("%s", ", budget: 5ms"), "picker.budget", "unknown key"),
    ],
)  # fmt: skip
def test_bad_picker_settings_name_the_field(text: str, field: str, words: str) -> None:
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(text)
    errors = [(x.path, x.reason) for x in e.value.errors]
    assert any(f == field and words in m for f, m in errors), errors
