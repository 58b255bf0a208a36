from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.set_filter_state.v3 import set_filter_state_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.load_balancing_policies.maglev.v3 import maglev_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

from controlplane.fleet import parse_fleet
from controlplane.routing.clusters import hashed_weights
from controlplane.routing.incremental import IncrementalTranslator
from controlplane.routing.translate import (
    CLUSTER,
    ENDPOINT,
    LISTENER,
    ROUTE,
    RoutingOverlay,
    cluster_refs,
    rds_names,
    translate,
)
from controlplane.xds.snapshot import build_snapshot
from tests.fleets import BASIC


def test_one_cluster_and_assignment_per_model_version() -> None:
    d = translate(parse_fleet(BASIC))
    assert set(d.by_type[CLUSTER]) == {"llama-3-8b@v1", "llama-3-8b@v2"}
    assert set(d.by_type[ENDPOINT]) == {"llama-3-8b@v1", "llama-3-8b@v2"}
    c = d.by_type[CLUSTER]["llama-3-8b@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    assert c.type == cluster_pb2.Cluster.EDS
    assert c.eds_cluster_config.service_name == "llama-3-8b@v1"
    assert c.eds_cluster_config.eds_config.HasField("ads")
    assert c.alt_stat_name == "llama-3-8b_v1"
    policies = [p.typed_extension_config.name for p in c.load_balancing_policy.policies]
    assert policies[0] == "envoy.load_balancing_policies.least_request"
    opts = http_protocol_options_pb2.HttpProtocolOptions()
    c.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].Unpack(opts)
    assert opts.explicit_http_config.HasField("http_protocol_options")  # HTTP/1.1 by default


def _lb(cla: object) -> list[tuple[str, int, int, int, int]]:
    """(address, port, locality weight, endpoint weight, health status) per endpoint."""
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    return [
        (
            e.endpoint.address.socket_address.address,
            e.endpoint.address.socket_address.port_value,
            loc.load_balancing_weight.value,
            e.load_balancing_weight.value,
            e.health_status,
        )
        for loc in cla.endpoints
        for e in loc.lb_endpoints
    ]


def test_every_endpoint_is_a_locality_weighted_like_the_endpoint() -> None:
    # gRPC's xds_wrr_locality reads locality weights only; Envoy reads endpoint weights.
    d = translate(parse_fleet(BASIC), {"llama-3-8b@v1": {"127.0.0.1:8101": 3, "127.0.0.1:8102": 7}})
    cla = d.by_type[ENDPOINT]["llama-3-8b@v1"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    assert all(loc.HasField("locality") and len(loc.lb_endpoints) == 1 for loc in cla.endpoints)
    # Unique localities (gRPC refuses duplicates), naming the endpoint for gRPC's load reports.
    assert [loc.locality.sub_zone for loc in cla.endpoints] == ["127.0.0.1:8101", "127.0.0.1:8102"]
    assert _lb(cla) == [("127.0.0.1", 8101, 3, 3, 0), ("127.0.0.1", 8102, 7, 7, 0)]


def test_a_ring_hashed_models_localities_weigh_one() -> None:
    # gRPC's ring_hash weighs an endpoint by locality weight x endpoint weight.
    fleet = parse_fleet(
        BASIC.replace("stable: v1", "stable: v1\n    affinity: {header: x-session, algorithm: ring_hash}", 1)
    )
    d = translate(fleet, {"llama-3-8b@v1": {"127.0.0.1:8101": 70, "127.0.0.1:8102": 100}})
    # Hashed: the weights squared over the largest (hashed_weights), 70 -> 49.
    assert [(w_loc, w) for _, _, w_loc, w, _ in _lb(d.by_type[ENDPOINT]["llama-3-8b@v1"])] == [
        (1, 49),
        (1, 100),
    ]
    # gRPC has no maglev and falls back to xds_wrr_locality: the locality weight is the weight.
    maglev = parse_fleet(BASIC.replace("stable: v1", "stable: v1\n    affinity: {header: x-session}", 1))
    d = translate(maglev, {"llama-3-8b@v1": {"127.0.0.1:8101": 70, "127.0.0.1:8102": 100}})
    assert [(w_loc, w) for _, _, w_loc, w, _ in _lb(d.by_type[ENDPOINT]["llama-3-8b@v1"])] == [
        (49, 49),
        (100, 100),
    ]


def test_a_hashed_model_homes_keys_in_expected_time_not_in_requests() -> None:
    """Consistent hashing gives a server its weight's share of the keys and of the bound: a
    hashed model's weights are its capacities squared, so a GPU 0.35x as fast homes 0.12x the
    prefixes (and sessions) of a fast one, not 0.35x, and spills its keys sooner."""
    weights = {"127.0.0.1:8101": 35, "127.0.0.1:8102": 100}
    plain = translate(parse_fleet(BASIC), {"llama-3-8b@v1": weights})
    assert [w for *_, w, _ in _lb(plain.by_type[ENDPOINT]["llama-3-8b@v1"])] == [35, 100]
    for affinity in ("{prefix: {}}", "{header: x-session-id}", "{body: user, algorithm: ring_hash}"):
        fleet = parse_fleet(BASIC.replace("stable: v1", f"stable: v1\n    affinity: {affinity}", 1))
        d = translate(fleet, {"llama-3-8b@v1": weights})
        assert [w for *_, w, _ in _lb(d.by_type[ENDPOINT]["llama-3-8b@v1"])] == [12, 100], affinity
        # The incremental translator sends the same bytes, and re-weighs when affinity comes or goes.
        inc = IncrementalTranslator()
        assert (
            inc.translate(parse_fleet(BASIC), {"llama-3-8b@v1": weights}).by_type[ENDPOINT]
            == plain.by_type[ENDPOINT]
        )
        assert inc.translate(fleet, {"llama-3-8b@v1": weights}).by_type[ENDPOINT] == d.by_type[ENDPOINT]
    # Held out stays held out; the slowest ready one keeps weight 1; all held out: nothing to scale.
    assert hashed_weights({"a": 0, "b": 1, "c": 1000}) == {"a": 0, "b": 1, "c": 1000}
    assert hashed_weights({"a": 0, "b": 0}) == {"a": 0, "b": 0}
    assert hashed_weights({"a": 500, "b": 1000}) == {"a": 250, "b": 1000}


def test_an_address_new_to_a_weighed_cluster_is_held_out_until_weighed() -> None:
    """No client may pick a server no probe has seen ready: a fleet edit that adds one to a
    cluster with weighed servers sends it UNHEALTHY, not at the default weight."""
    fleet = parse_fleet(BASIC)
    d = translate(fleet, {"llama-3-8b@v1": {"127.0.0.1:8101": 50}})
    assert _lb(d.by_type[ENDPOINT]["llama-3-8b@v1"]) == [
        ("127.0.0.1", 8101, 50, 50, health_check_pb2.UNKNOWN),
        ("127.0.0.1", 8102, 1, 1, health_check_pb2.UNHEALTHY),
    ]
    # Nothing weighed yet (a control plane that just started, a new version): all are sent.
    assert [h for *_, h in _lb(translate(fleet).by_type[ENDPOINT]["llama-3-8b@v1"])] == [0, 0]
    # Weighed servers all held out or draining: the new one is all there could be.
    d = translate(fleet, {"llama-3-8b@v1": {"127.0.0.1:8101": 0}})
    assert [h for *_, h in _lb(d.by_type[ENDPOINT]["llama-3-8b@v1"])] == [health_check_pb2.UNHEALTHY, 0]
    overlay = RoutingOverlay(draining=frozenset({"127.0.0.1:8101"}))
    d = translate(fleet, {"llama-3-8b@v1": {"127.0.0.1:8101": 50}}, overlay=overlay)
    assert [h for *_, h in _lb(d.by_type[ENDPOINT]["llama-3-8b@v1"])] == [health_check_pb2.DRAINING, 0]


def test_routes_header_then_body_then_404_then_400() -> None:
    d = translate(parse_fleet(BASIC))
    rc = d.by_type[ROUTE]["inference"]
    assert isinstance(rc, route_pb2.RouteConfiguration)
    routes = rc.virtual_hosts[0].routes
    assert [r.name for r in routes] == [
        "health-get",
        "health-head",
        "list-models",
        "header/llama-3-8b@v1",  # x-model-version reaches each version (the model has two)
        "header/llama-3-8b@v2",
        "header/llama-3-8b",
        "body/llama-3-8b@v1",
        "body/llama-3-8b@v2",
        "body/llama-3-8b",
        "unknown-model-header",
        "unknown-model-body",
        "no-model",
    ]
    health = routes[0]
    assert health.match.path == "/health" and health.direct_response.status == 200
    assert [(h.name, h.string_match.exact, h.invert_match) for h in health.match.headers] == [
        (":method", "GET", False),
        ("x-model", "", True),  # with x-model, the model's servers answer
    ]
    routes = routes[2:]
    assert routes[2].match.headers[1].name == "x-model-version"
    assert routes[2].match.headers[1].string_match.exact == "v2"
    assert routes[2].route.cluster == "llama-3-8b@v2"
    routes = [r for r in routes if "@" not in r.name]
    header, body = routes[1], routes[2]
    assert header.match.headers[0].name == "x-model"
    assert header.match.headers[0].string_match.exact == "llama-3-8b"
    assert header.route.cluster == "llama-3-8b@v1"
    assert header.route.timeout.seconds == 60  # the small tier's timeout
    assert body.match.headers[0].invert_match  # only when no x-model header
    assert body.match.dynamic_metadata[0].value.string_match.exact == "llama-3-8b"
    assert routes[3].direct_response.status == 404
    assert routes[5].direct_response.status == 400
    assert b"model_required" in routes[5].direct_response.body.inline_string.encode()
    assert "content-type: application/json" in routes[5].direct_response.body.inline_string
    assert cluster_refs(rc) == {"llama-3-8b@v1", "llama-3-8b@v2"}


def test_stable_selects_the_routed_cluster_and_tier_timeout() -> None:
    text = BASIC.replace("stable: v1", "stable: v2").replace("    params_b: 8\n", "    params_b: 70\n")
    rc = translate(parse_fleet(text)).by_type[ROUTE]["inference"]
    default = next(r for r in rc.virtual_hosts[0].routes if r.name == "header/llama-3-8b")
    assert default.route.cluster == "llama-3-8b@v2"
    assert default.route.timeout.seconds == 180
    # Only the version header routes name the other version.
    assert cluster_refs(rc) == {"llama-3-8b@v1", "llama-3-8b@v2"}


def test_rds_names_are_what_each_listener_asks_for_over_rds() -> None:
    d = translate(parse_fleet(BASIC))
    by_name = {n: rds_names(m) for n, m in d.by_type[LISTENER].items()}
    assert by_name["inference"] == {"inference"}
    api = {n: v for n, v in by_name.items() if n != "inference"}
    assert api and all(len(v) == 1 for v in api.values())  # proxyless API listeners use RDS too
    inline = listener_pb2.Listener(name="tcp")  # no HTTP connection manager: nothing
    assert rds_names(inline) == frozenset()
    assert rds_names(d.by_type[ROUTE]["inference"]) == frozenset()  # not a listener


def test_gateway_listener_uses_rds_over_ads_and_body_routing_filter() -> None:
    d = translate(parse_fleet(BASIC))
    lst = d.by_type[LISTENER]["inference"]
    assert isinstance(lst, listener_pb2.Listener)
    assert lst.address.socket_address.port_value == 10000
    assert lst.address.socket_address.address == "127.0.0.1"
    hcm = hcm_pb2.HttpConnectionManager()
    lst.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    assert hcm.rds.route_config_name == "inference"
    assert [f.name for f in hcm.http_filters] == [
        "envoy.filters.http.buffer",
        "envoy.filters.http.json_to_metadata",
        "envoy.filters.http.router",
    ]
    assert d.wildcard[LISTENER] == {"inference"}


def test_proxyless_api_listener_per_model() -> None:
    d = translate(parse_fleet(BASIC))
    api = d.by_type[LISTENER]["llama-3-8b"]
    assert isinstance(api, listener_pb2.Listener)
    hcm = hcm_pb2.HttpConnectionManager()
    api.api_listener.api_listener.Unpack(hcm)
    assert hcm.rds.route_config_name == "grpc/llama-3-8b"
    assert cluster_refs(d.by_type[ROUTE]["grpc/llama-3-8b"]) == {"llama-3-8b@v1"}


def test_http2_protocol_and_cluster_overrides() -> None:
    text = BASIC.replace(
        "stable: v1", "stable: v1\n    protocol: http2\n    cluster_overrides: {connect_timeout: 5s}"
    )
    c = translate(parse_fleet(text)).by_type[CLUSTER]["llama-3-8b@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    opts = http_protocol_options_pb2.HttpProtocolOptions()
    c.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].Unpack(opts)
    assert opts.explicit_http_config.HasField("http2_protocol_options")
    assert c.connect_timeout.seconds == 5


def test_translation_is_deterministic_to_the_byte() -> None:
    a = build_snapshot(translate(parse_fleet(BASIC)), 1, 0.0)
    b = build_snapshot(translate(parse_fleet(BASIC)), 2, 0.0)
    for t in (CLUSTER, ENDPOINT, LISTENER, ROUTE):
        assert {n: r.version for n, r in a.resources[t].items()} == {
            n: r.version for n, r in b.resources[t].items()
        }


def test_unchanged_resources_are_reused_not_reserialised() -> None:
    a = build_snapshot(translate(parse_fleet(BASIC)), 1, 0.0)
    changed = BASIC.replace("127.0.0.1:8103", "127.0.0.1:8104")
    b = build_snapshot(translate(parse_fleet(changed)), 2, 0.0, previous=a)
    assert b.resources[ENDPOINT]["llama-3-8b@v1"] is a.resources[ENDPOINT]["llama-3-8b@v1"]
    assert b.resources[ENDPOINT]["llama-3-8b@v2"] is not a.resources[ENDPOINT]["llama-3-8b@v2"]


def test_weight_zero_holds_an_endpoint_out_and_panic_mode_is_off() -> None:
    d = translate(parse_fleet(BASIC), {"llama-3-8b@v1": {"127.0.0.1:8101": 0, "127.0.0.1:8102": 5}})
    cla = d.by_type[ENDPOINT]["llama-3-8b@v1"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    got = [(h, w) for _, _, _, w, h in _lb(cla)]
    assert got == [(health_check_pb2.UNHEALTHY, 1), (health_check_pb2.UNKNOWN, 5)]
    c = d.by_type[CLUSTER]["llama-3-8b@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    # Envoy's default panic threshold would route to held-out servers once half are out.
    assert c.common_lb_config.HasField("healthy_panic_threshold")
    assert c.common_lb_config.healthy_panic_threshold.value == 0.0


def test_round_robin_policy_gets_envoys_round_robin() -> None:
    fleet = parse_fleet(BASIC.replace("stable: v1", "stable: v1\n    balancing: round_robin", 1))
    c = translate(fleet).by_type[CLUSTER]["llama-3-8b@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    assert [p.typed_extension_config.name for p in c.load_balancing_policy.policies] == [
        "envoy.load_balancing_policies.round_robin",
        "envoy.load_balancing_policies.wrr_locality",
    ]


TIERED = BASIC.replace(
    "small:  {max_params_b: 15, timeout: 60s}",
    "small:  {max_params_b: 15, timeout: 60s, stream_idle_timeout: 10s, retries: 3, max_body_bytes: 1000,"
    " circuit_breakers: {default: {max_requests: 64, max_pending: 8}, high: {max_requests: 128}},"
    " outlier_detection: {consecutive_5xx: 2, base_ejection_time: 20s, max_ejection_percent: 40}}",
)


def test_tier_traffic_policy_reaches_routes_and_clusters() -> None:
    d = translate(parse_fleet(TIERED))
    rc = d.by_type[ROUTE]["inference"]
    assert isinstance(rc, route_pb2.RouteConfiguration)
    route = next(r for r in rc.virtual_hosts[0].routes if r.name == "header/llama-3-8b")
    a = route.route
    assert (a.timeout.seconds, a.idle_timeout.seconds) == (60, 10)
    rp = a.retry_policy
    assert rp.retry_on == "connect-failure,refused-stream,reset,retriable-status-codes"
    assert list(rp.retriable_status_codes) == [507] and rp.num_retries.value == 3
    assert [p.name for p in rp.retry_host_predicate] == ["envoy.retry_host_predicates.previous_hosts"]
    body = buffer_pb2.BufferPerRoute()
    route.typed_per_filter_config["envoy.filters.http.buffer"].Unpack(body)
    assert body.buffer.max_request_bytes.value == 1000
    c = d.by_type[CLUSTER]["llama-3-8b@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    got = [
        (t.priority, t.max_requests.value, t.max_pending_requests.value)
        for t in c.circuit_breakers.thresholds
    ]
    assert got == [(base_pb2.DEFAULT, 64, 8), (base_pb2.HIGH, 128, 1024)]
    od = c.outlier_detection
    assert (od.consecutive_5xx.value, od.base_ejection_time.seconds, od.max_ejection_percent.value) == (
        2,
        20,
        40,
    )
    assert od.enforcing_consecutive_5xx.value == 100


def test_a_model_overrides_single_keys_of_its_tier() -> None:
    fleet = parse_fleet(
        TIERED.replace("    stable: v1\n", "    stable: v1\n    timeout: 5s\n    retries: 0\n", 1)
    )
    rc = translate(fleet).by_type[ROUTE]["inference"]
    assert isinstance(rc, route_pb2.RouteConfiguration)
    a = next(r for r in rc.virtual_hosts[0].routes if r.name == "body/llama-3-8b").route
    assert a.timeout.seconds == 5 and a.idle_timeout.seconds == 10  # the rest is the tier's
    assert not a.HasField("retry_policy")


def test_proxyless_routes_say_the_timeout_and_retries_in_grpcs_terms() -> None:
    rc = translate(parse_fleet(TIERED)).by_type[ROUTE]["grpc/llama-3-8b"]
    assert isinstance(rc, route_pb2.RouteConfiguration)
    a = rc.virtual_hosts[0].routes[0].route
    # gRPC ignores `timeout` and takes max_stream_duration as the call's deadline (gRFC A31).
    assert a.timeout.seconds == 60 and a.max_stream_duration.max_stream_duration.seconds == 60
    # gRPC status codes only, no Envoy predicates (gRPC would ignore them, or refuse them).
    assert a.retry_policy.retry_on == "unavailable" and a.retry_policy.num_retries.value == 3
    assert not a.retry_policy.retry_host_predicate and not a.retry_policy.retriable_status_codes
    assert a.retry_policy.retry_back_off.base_interval.ToMilliseconds() == 25
    assert not a.HasField("idle_timeout")
    rc = translate(parse_fleet(BASIC.replace("timeout: 60s}", "timeout: 60s, retries: 0}"))).by_type[ROUTE]
    assert not rc["grpc/llama-3-8b"].virtual_hosts[0].routes[0].route.HasField("retry_policy")


def test_proxyless_routes_carry_a_rollouts_split() -> None:
    overlay = RoutingOverlay(splits={"llama-3-8b": (("v1", 80), ("v2", 20))})
    rc = translate(parse_fleet(BASIC), overlay=overlay).by_type[ROUTE]["grpc/llama-3-8b"]
    assert isinstance(rc, route_pb2.RouteConfiguration)
    a = rc.virtual_hosts[0].routes[0].route
    assert [(c.name, c.weight.value) for c in a.weighted_clusters.clusters] == [
        ("llama-3-8b@v1", 80),
        ("llama-3-8b@v2", 20),
    ]
    assert not a.cluster
    one = RoutingOverlay(splits={"llama-3-8b": (("v2", 100),)})
    rc = translate(parse_fleet(BASIC), overlay=one).by_type[ROUTE]["grpc/llama-3-8b"]
    assert rc.virtual_hosts[0].routes[0].route.cluster == "llama-3-8b@v2"


def test_clusters_send_load_reports_to_the_xds_server_and_eject_by_failure_share() -> None:
    c = translate(parse_fleet(BASIC)).by_type[CLUSTER]["llama-3-8b@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    assert c.lrs_server.HasField("self")  # the only LRS server proxyless gRPC accepts
    od = c.outlier_detection
    # gRPC implements only success-rate and failure-percentage ejection (gRFC A50).
    assert (od.failure_percentage_threshold.value, od.enforcing_failure_percentage.value) == (50, 100)
    assert od.failure_percentage_minimum_hosts.value == 2
    assert od.failure_percentage_request_volume.value == 10
    assert od.consecutive_5xx.value == 5  # Envoy's rule stays
    off = parse_fleet(
        BASIC.replace("timeout: 60s}", "timeout: 60s, outlier_detection: {failure_percentage: 0}}")
    )
    c = translate(off).by_type[CLUSTER]["llama-3-8b@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    assert c.outlier_detection.enforcing_failure_percentage.value == 0


def test_preferred_gpu_classes_get_priority_0_and_endpoints_too_small_are_left_out() -> None:
    fleet = parse_fleet(
        "listener: {port: 10000}\n"
        "tiers: {all: {}}\n"
        "gpu_classes: {H100: {memory_gb: 80}, A100: {memory_gb: 80}, L4: {memory_gb: 24}}\n"
        "models:\n"
        "  chat:\n"
        "    params_b: 30\n"
        "    preferred_gpus: [H100]\n"
        "    stable: v1\n"
        "    versions: {v1: {endpoints: [{address: '127.0.0.1:80', gpu: H100},"
        " {address: '127.0.0.2:80', gpu: L4}, {address: '127.0.0.3:80', gpu: A100},"
        " {address: '127.0.0.4:80'}]}}\n"
    )
    cla = translate(fleet).by_type[ENDPOINT]["chat@v1"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    got = [
        (loc.priority, [e.endpoint.address.socket_address.address for e in loc.lb_endpoints])
        for loc in cla.endpoints
    ]
    # The L4 cannot hold 72 GB; the endpoint of unknown class falls back with the A100.
    assert got == [(0, ["127.0.0.1"]), (1, ["127.0.0.3"]), (1, ["127.0.0.4"])]
    assert [loc.load_balancing_weight.value for loc in cla.endpoints] == [1, 1, 1]
    assert all(loc.HasField("locality") for loc in cla.endpoints)


def test_the_idle_timeout_defaults_to_the_route_timeout() -> None:
    # Envoy's own stream idle default (5 min) would cut a large model's long generation.
    rc = translate(parse_fleet(BASIC)).by_type[ROUTE]["inference"]
    assert isinstance(rc, route_pb2.RouteConfiguration)
    a = next(r for r in rc.virtual_hosts[0].routes if r.name == "header/llama-3-8b").route
    assert a.idle_timeout.seconds == a.timeout.seconds == 60


QOS = BASIC + (
    "priority_classes:\n  premium: {routing_priority: high}\n  standard: {shed_at: 1.0}\n"
    "  batch: {shed_at: 0.5}\ndefault_priority_class: standard\n"
)


def _routes(rc: object) -> dict[str, route_components_pb2.Route]:
    assert isinstance(rc, route_pb2.RouteConfiguration)
    return {r.name: r for r in rc.virtual_hosts[0].routes}


def test_priority_classes_route_high_and_shed_with_429() -> None:
    fleet = parse_fleet(QOS)
    calm = _routes(translate(fleet).by_type[ROUTE]["inference"])
    # Only premium differs from the default class while nothing is shed.
    assert calm["header/llama-3-8b/premium"].route.priority == base_pb2.HIGH
    assert calm["header/llama-3-8b"].route.priority == base_pb2.DEFAULT
    assert "header/llama-3-8b/batch" not in calm
    names = list(calm)
    assert names.index("header/llama-3-8b/premium") < names.index("header/llama-3-8b")
    hot = _routes(
        translate(fleet, shed={"llama-3-8b": frozenset({"batch", "standard"})}).by_type[ROUTE]["inference"]
    )
    for name in ("header/llama-3-8b", "body/llama-3-8b"):
        shed = hot[name]
        assert shed.direct_response.status == 429
        assert {h.header.key: h.header.value for h in shed.response_headers_to_add}["retry-after"] == "1"
    assert hot["header/llama-3-8b/premium"].route.priority == base_pb2.HIGH  # still admitted
    assert "header/llama-3-8b/batch" not in hot  # shed like the default class: no own route


def test_circuit_breaker_overflow_is_answered_429() -> None:
    lst = translate(parse_fleet(BASIC)).by_type[LISTENER]["inference"]
    assert isinstance(lst, listener_pb2.Listener)
    hcm = hcm_pb2.HttpConnectionManager()
    lst.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    [mapper] = hcm.local_reply_config.mappers
    assert list(mapper.filter.response_flag_filter.flags) == ["UO"]
    assert mapper.status_code.value == 429


def test_header_affinity_hashes_with_bounded_load() -> None:
    fleet = parse_fleet(
        BASIC.replace("    stable: v1\n", "    stable: v1\n    affinity: {header: x-session-id}\n", 1)
    )
    d = translate(fleet)
    c = d.by_type[CLUSTER]["llama-3-8b@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    first = c.load_balancing_policy.policies[0].typed_extension_config
    assert first.name == "envoy.load_balancing_policies.maglev"
    maglev = maglev_pb2.Maglev()
    first.typed_config.Unpack(maglev)
    assert maglev.consistent_hashing_lb_config.hash_balance_factor.value == 150
    routes = _routes(d.by_type[ROUTE]["inference"])
    assert [h.header.header_name for h in routes["header/llama-3-8b"].route.hash_policy] == [
        "x-session-id",
        "x-request-id",
    ]
    grpc = d.by_type[ROUTE]["grpc/llama-3-8b"]
    assert isinstance(grpc, route_pb2.RouteConfiguration)
    assert grpc.virtual_hosts[0].routes[0].route.hash_policy[0].header.header_name == "x-session-id"


def test_body_affinity_goes_through_hashable_filter_state() -> None:
    fleet = parse_fleet(
        BASIC.replace(
            "    stable: v1\n",
            "    stable: v1\n    affinity: {body: prompt_cache_key, algorithm: ring_hash}\n",
            1,
        )
    )
    d = translate(fleet)
    lst = d.by_type[LISTENER]["inference"]
    assert isinstance(lst, listener_pb2.Listener)
    hcm = hcm_pb2.HttpConnectionManager()
    lst.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    assert [f.name for f in hcm.http_filters] == [
        "envoy.filters.http.buffer",
        "envoy.filters.http.json_to_metadata",
        "envoy.filters.http.set_filter_state",
        "envoy.filters.http.router",
    ]
    fs = set_filter_state_pb2.Config()
    hcm.http_filters[2].typed_config.Unpack(fs)
    [value] = fs.on_request_headers
    assert value.factory_key == "envoy.hashable_string"  # envoy.string would not hash
    assert (
        value.format_string.text_format_source.inline_string
        == "%DYNAMIC_METADATA(controlplane:affinity_prompt_cache_key)%"
    )
    assert value.format_string.omit_empty_values  # a keyless request is skipped, not hashed as "-"
    routes = _routes(d.by_type[ROUTE]["inference"])
    keyed, fallback = routes["body/llama-3-8b"].route.hash_policy
    assert keyed.filter_state.key == "controlplane.affinity.prompt_cache_key" and keyed.terminal
    assert fallback.header.header_name == "x-request-id"
    c = d.by_type[CLUSTER]["llama-3-8b@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    assert (
        c.load_balancing_policy.policies[0].typed_extension_config.name
        == "envoy.load_balancing_policies.ring_hash"
    )


def test_zones_rank_before_gpu_classes_and_become_localities() -> None:
    fleet = parse_fleet(
        "listener: {port: 10000}\n"
        "tiers: {all: {}}\n"
        "models:\n"
        "  chat:\n"
        "    params_b: 8\n"
        "    preferred_gpus: [H100]\n"
        "    zones: [edge-1, core]\n"
        "    stable: v1\n"
        "    versions: {v1: {endpoints: [{address: '10.0.0.1:80', gpu: L4, zone: edge-1},"
        " {address: '10.0.0.2:80', gpu: H100, zone: core, region: eu},"
        " {address: '10.0.0.3:80', zone: other}]}}\n"
    )
    cla = translate(fleet).by_type[ENDPOINT]["chat@v1"]
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    got = [
        (
            loc.priority,
            loc.locality.region,
            loc.locality.zone,
            [e.endpoint.address.socket_address.address for e in loc.lb_endpoints],
        )
        for loc in cla.endpoints
    ]
    # The edge first even on a fallback GPU class; then core; unlisted zones last. No gaps.
    assert got == [
        (0, "", "edge-1", ["10.0.0.1"]),
        (1, "eu", "core", ["10.0.0.2"]),
        (2, "", "other", ["10.0.0.3"]),
    ]


# ---- holding: a model with no ready server waits in the control plane -------------------


def test_a_holding_model_routes_to_the_holding_service_with_its_name() -> None:
    from controlplane.resources import names
    from controlplane.routing.translate import RoutingOverlay

    fleet = parse_fleet(BASIC)
    overlay = RoutingOverlay(holding=frozenset({"llama-3-8b"}), hold_address="127.0.0.1:18002")
    d = translate(fleet, overlay=overlay)
    hold = d.by_type[CLUSTER][names.HOLD_CLUSTER]
    assert hold.type == cluster_pb2.Cluster.STATIC
    sa = hold.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (sa.address, sa.port_value) == ("127.0.0.1", 18002)
    routes = _routes(d.by_type[ROUTE]["inference"])
    held = routes["header/llama-3-8b"]
    assert held.route.cluster == names.HOLD_CLUSTER and not held.route.HasField("retry_policy")
    [header] = held.request_headers_to_add
    assert (header.header.key, header.header.value) == (names.HOLD_MODEL_HEADER, "llama-3-8b")
    assert held.route.timeout.seconds == 60  # the model's own timeout still bounds the wait
    # A request naming a version goes to that version's cluster, held or not.
    assert routes["header/llama-3-8b@v2"].route.cluster == "llama-3-8b@v2"
    # Without an address (holding off), nothing changes.
    off = translate(fleet, overlay=RoutingOverlay(holding=frozenset({"llama-3-8b"})))
    assert names.HOLD_CLUSTER not in off.by_type[CLUSTER]
    assert _routes(off.by_type[ROUTE]["inference"])["header/llama-3-8b"].route.cluster == "llama-3-8b@v1"


def test_the_holding_service_by_name_is_resolved_by_dns() -> None:
    from controlplane.routing.translate import build_hold_cluster

    assert (
        build_hold_cluster("controlplane.inference-system.svc:18002").type == cluster_pb2.Cluster.STRICT_DNS
    )
    assert build_hold_cluster("[::1]:18002").type == cluster_pb2.Cluster.STATIC


def test_prefix_affinity_takes_its_key_in_envoys_lua_filter() -> None:
    fleet = parse_fleet(
        BASIC.replace("    stable: v1\n", "    stable: v1\n    affinity: {prefix: {messages: 2}}\n", 1)
    )
    d = translate(fleet)
    lst = d.by_type[LISTENER]["inference"]
    assert isinstance(lst, listener_pb2.Listener)
    hcm = hcm_pb2.HttpConnectionManager()
    lst.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    assert [f.name for f in hcm.http_filters] == [
        "envoy.filters.http.buffer",
        "envoy.filters.http.json_to_metadata",
        "envoy.filters.http.lua",  # after the body is whole, before the key becomes filter state
        "envoy.filters.http.set_filter_state",
        "envoy.filters.http.router",
    ]
    lua = lua_pb2.Lua()
    hcm.http_filters[2].typed_config.Unpack(lua)
    assert "envoy_on_request" in lua.default_source_code.inline_string
    fs = set_filter_state_pb2.Config()
    hcm.http_filters[3].typed_config.Unpack(fs)
    assert [v.object_key for v in fs.on_request_headers] == ["controlplane.affinity.prefix"]
    routes = _routes(d.by_type[ROUTE]["inference"])
    for name in ("header/llama-3-8b", "body/llama-3-8b", "header/llama-3-8b@v1"):
        r = routes[name]
        settings = r.metadata.filter_metadata["envoy.filters.http.lua"]
        assert dict(settings) == {
            "prefix_messages": 2,
            "prefix_prompt_bytes": 1024,
            "prefix_max_bytes": 16384,
        }
        assert r.route.hash_policy[0].filter_state.key == "controlplane.affinity.prefix"
    # A fleet without prefix affinity has no Lua filter at all.
    plain = translate(parse_fleet(BASIC)).by_type[LISTENER]["inference"]
    assert isinstance(plain, listener_pb2.Listener)
    hcm = hcm_pb2.HttpConnectionManager()
    plain.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    assert "envoy.filters.http.lua" not in [f.name for f in hcm.http_filters]
