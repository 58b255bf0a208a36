"""LoRA adapters in the fleet file (fleet/schema_adapters.py) and what Envoy and the pickers get
for them (routing/): routes that take an adapter's name for its base model, /v1/models, the
picked clusters' metadata and the wait a dynamic load may take."""

from __future__ import annotations

import json
import re

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.load_balancing_policies.subset.v3 import subset_pb2
from google.protobuf import json_format

from controlplane.fleet import FleetConfigInvalid, parse_fleet
from controlplane.resources import names
from controlplane.routing.incremental import IncrementalTranslator
from controlplane.routing.translate import CLUSTER, ENDPOINT, ROUTE, model_names, translate
from tests.unit.test_flow_config import _ext_proc

FLEET = """
listener: {port: 10000}
picker: {endpoints: ['127.0.0.1:18090']}
tiers:
  small: {max_params_b: 20, balancing: picker}
  large: {}
models:
  base.1:
    params_b: 1
    stable: v1
    %s
    versions:
      v1: {endpoints: ['127.0.0.1:9001', '127.0.0.1:9003']}
      v2: {endpoints: ['127.0.0.1:9004']}
  other: {params_b: 70, tier: large, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9002']}}}
"""

ADAPTERS = """adapters:
      sql-lora: {source: /models/sql, versions: [v1], endpoints: ['127.0.0.1:9001']}
      chat.lora: {source: /models/chat}
      bare:"""


def _errors(extra: str) -> list[str]:
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(FLEET % extra, "fleet.yaml")
    return [str(x) for x in e.value.errors]


def test_adapters_load_with_their_sources_versions_and_endpoints() -> None:
    fleet = parse_fleet(FLEET % ADAPTERS)
    m = fleet.model("base.1")
    assert [a.name for a in m.adapters] == ["sql-lora", "chat.lora", "bare"]
    sql = m.adapter("sql-lora")
    assert sql is not None and sql.source == "/models/sql" and sql.versions == ("v1",)
    assert sql.may_serve("v1", "127.0.0.1:9001") and not sql.may_serve("v1", "127.0.0.1:9003")
    assert not sql.may_serve("v2", "127.0.0.1:9001")
    bare = m.adapter("bare")
    assert bare is not None and bare.source is None and bare.may_serve("v2", "127.0.0.1:9004")
    assert m.placement == "static"
    found = fleet.adapter_of("chat.lora")
    assert found is not None and found[0].name == "base.1"
    assert fleet.adapter_of("base.1") is None and fleet.model("other").adapters == ()


@pytest.mark.parametrize(
    ("extra", "wanted"),
    [
        (
            "adapters: {other: {}}",
            "models.base.1.adapters.other: its name is also model 'other''s: a request's model must name "
            "one thing; rename one",
        ),
        (
            "adapters: {base.1: {}}",
            "models.base.1.adapters.base.1: its name is also model 'base.1''s",
        ),
        ("adapters: [a, b]", "models.base.1.adapters: expected a mapping of adapter name to adapter"),
        ("adapters: {a: {sorce: x}}", "adapters.a.sorce: unknown key (allowed: endpoints, source"),
        ("adapters: {a: {source: 3}}", "models.base.1.adapters.a.source: expected the adapter's path or URI"),
        ("adapters: {a: {versions: [v9]}}", "adapters.a.versions: names version 'v9', which is not"),
        ("adapters: {a: {endpoints: x}}", "models.base.1.adapters.a.endpoints: expected a list of distinct"),
        ("adapters: {'a b': {}}", "models.base.1.adapters.a b: adapter names use letters, digits"),
        ("adapters: {1: {}}", "models.base.1.adapters.1: adapter names use letters, digits"),
        ("affinity: {adapter: true}", "models.base.1.affinity.adapter: the model has no adapters"),
        (
            "affinity: {adapter: 1}\n    " + ADAPTERS,
            "base.1.affinity.adapter: expected true (the key is the adapter",
        ),
        (
            "affinity: {adapter: true, header: x-s}\n    " + ADAPTERS,
            "models.base.1.affinity: give exactly one of header",
        ),
        ("placement: everywhere", "base.1.placement: expected one of static, dynamic, got 'everywhere'"),
        (
            "placement: dynamic\n    adapters: {a: {source: /x}, b: {}}",
            "base.1.placement: dynamic placement loads adapters from their source: adapter 'b' has none",
        ),
    ],
)
def test_bad_adapters_are_refused_naming_the_field(extra: str, wanted: str) -> None:
    errs = _errors(extra)
    assert any(wanted in e for e in errs), errs


def test_an_adapter_named_twice_across_models_names_both() -> None:
    text = (FLEET % "adapters: {shared: {}}").replace(
        "other: {params_b: 70,", "other: {adapters: {shared: {}}, params_b: 70,"
    )
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(text, "fleet.yaml")
    assert any(
        "models.other.adapters.shared: its name is also model 'base.1''s adapter 'shared'" in str(x)
        for x in e.value.errors
    ), e.value.errors


def test_too_many_adapters_are_refused() -> None:
    many = "adapters: {" + ", ".join(f"a{i}: {{}}" for i in range(1001)) + "}"
    assert any("1001 adapters, more than 1000 per model" in e for e in _errors(many))


def test_routes_take_an_adapters_name_as_its_base_models() -> None:
    fleet = parse_fleet(FLEET % ADAPTERS)
    regex = model_names(fleet.model("base.1")).safe_regex.regex
    # Envoy's RE2 matches the whole value: the names, dots literal, nothing else.
    for name in ("base.1", "sql-lora", "chat.lora", "bare"):
        assert re.fullmatch(regex, name)
    for name in ("basex1", "chatxlora", "bare2", "sql-lora,bare", ""):
        assert not re.fullmatch(regex, name)
    assert model_names(fleet.model("other")).exact == "other"
    # Without adapter hashing (`affinity: false`), one route per naming takes every name.
    d = translate(parse_fleet(FLEET % ("affinity: false\n    " + ADAPTERS)))
    routes = d.by_type[ROUTE][names.GATEWAY_ROUTES]
    assert isinstance(routes, route_pb2.RouteConfiguration)
    header = [r for r in routes.virtual_hosts[0].routes if r.name == "header/base.1"]
    assert header and header[0].match.headers[0].string_match.safe_regex.regex == regex
    assert not header[0].route.hash_policy
    body = [r for r in routes.virtual_hosts[0].routes if r.name == "body/base.1"]
    assert body and body[0].match.dynamic_metadata[0].value.string_match.safe_regex.regex == regex
    assert not [r for r in routes.virtual_hosts[0].routes if r.name.endswith("/adapters")]


def _route(routes: route_pb2.RouteConfiguration, name: str) -> route_pb2.Route:
    found = [r for r in routes.virtual_hosts[0].routes if r.name == name]
    assert len(found) == 1, [r.name for r in routes.virtual_hosts[0].routes]
    return found[0]


@pytest.mark.parametrize("tier", ["small", "large"])  # picked, and Envoy's alone
def test_a_model_with_adapters_hashes_each_adapters_requests_on_its_name(tier: str) -> None:
    fleet = parse_fleet(FLEET % (f"tier: {tier}\n    " + ADAPTERS))
    m = fleet.model("base.1")
    assert m.affinity is not None and m.affinity.adapter and m.affinity.balance_factor == 150
    d = translate(fleet)
    routes = d.by_type[ROUTE][names.GATEWAY_ROUTES]
    assert isinstance(routes, route_pb2.RouteConfiguration)
    # The base model's own name: no key, so its requests spread (Maglev at random, bounded).
    for naming in ("header/base.1", "body/base.1"):
        base = _route(routes, naming)
        matcher = (
            base.match.headers[0] if naming.startswith("header") else base.match.dynamic_metadata[0].value
        )
        assert matcher.string_match.exact == "base.1"
        assert not base.route.hash_policy
    # An adapter's name: hashed on it, then on the request id (never all on one server).
    header = _route(routes, "header/base.1/adapters")
    regex = header.match.headers[0].string_match.safe_regex.regex
    assert re.fullmatch(regex, "chat.lora") and not re.fullmatch(regex, "base.1")
    keys = header.route.hash_policy
    assert keys[0].header.header_name == "x-model" and keys[0].terminal
    assert keys[1].header.header_name == "x-request-id"
    body = _route(routes, "body/base.1/adapters").route.hash_policy
    assert body[0].filter_state.key == "controlplane.affinity.model" and body[0].terminal
    assert _route(routes, "header/other").match.headers[0].string_match.exact == "other"
    # The body's model becomes hashable filter state; the clusters hash with bounded load.
    listener = d.by_type["type.googleapis.com/envoy.config.listener.v3.Listener"][names.GATEWAY_LISTENER]
    assert "%DYNAMIC_METADATA(controlplane:affinity_model)%" in str(listener)
    for cname in ("base.1@v1", "base.1@v2"):
        c = d.by_type[CLUSTER][cname]
        assert isinstance(c, cluster_pb2.Cluster)
        policies = [p.typed_extension_config.name for p in c.load_balancing_policy.policies]
        assert "envoy.load_balancing_policies.maglev" in str(c.load_balancing_policy)
        assert policies[0] == (
            "envoy.load_balancing_policies.override_host"
            if tier == "small"
            else "envoy.load_balancing_policies.subset"  # sql-lora is on some servers only
        )


def test_an_adapter_restricted_to_some_servers_is_a_subset_of_its_cluster() -> None:
    """Without the picker, Envoy's subset load balancer keeps sql-lora (only on 9001) there;
    every other request matches no subset and takes the whole cluster."""
    d = translate(parse_fleet(FLEET % ("tier: large\n    " + ADAPTERS)))
    c = d.by_type[CLUSTER]["base.1@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    first = c.load_balancing_policy.policies[0].typed_extension_config
    assert first.name == "envoy.load_balancing_policies.subset"
    subset = subset_pb2.Subset()
    first.typed_config.Unpack(subset)
    assert subset.fallback_policy == subset_pb2.Subset.ANY_ENDPOINT and subset.list_as_any
    assert list(subset.subset_selectors[0].keys) == [names.ADAPTER_LB_KEY]
    assert (
        subset.subset_lb_policy.policies[0].typed_extension_config.name
        == "envoy.load_balancing_policies.maglev"
    )
    cla = d.by_type[ENDPOINT]["base.1@v1"]
    lists = {
        e.lb_endpoints[0].endpoint.address.socket_address.port_value: json_format.MessageToDict(
            e.lb_endpoints[0].metadata
        )
        for e in cla.endpoints  # type: ignore[attr-defined]
    }
    assert lists[9001] == {"filterMetadata": {"envoy.lb": {names.ADAPTER_LB_KEY: ["sql-lora"]}}}
    assert lists[9003] == {}
    listener = str(d.by_type["type.googleapis.com/envoy.config.listener.v3.Listener"][names.GATEWAY_LISTENER])
    assert "envoy.filters.http.header_to_metadata" in listener and names.ADAPTER_LB_KEY in listener
    # No restricted adapter: no subsets, no copy of the model to envoy.lb.
    d = translate(parse_fleet(FLEET % ("tier: large\n    adapters: {chat.lora: {}}")))
    c = d.by_type[CLUSTER]["base.1@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    assert "subset" not in str(c.load_balancing_policy)
    assert names.ADAPTER_LB_KEY not in str(d.by_type["type.googleapis.com/envoy.config.listener.v3.Listener"])


def test_affinity_false_keeps_least_request_and_an_operators_own_affinity_wins() -> None:
    off = parse_fleet(FLEET % ("tier: large\n    affinity: false\n    " + ADAPTERS))
    assert off.model("base.1").affinity is None
    c = translate(off).by_type[CLUSTER]["base.1@v1"]
    assert isinstance(c, cluster_pb2.Cluster)
    assert [p.typed_extension_config.name for p in c.load_balancing_policy.policies][:2] == [
        "envoy.load_balancing_policies.subset",  # sql-lora is on some servers only
        "envoy.load_balancing_policies.least_request",
    ]
    own = parse_fleet(FLEET % ("affinity: {header: x-session-id}\n    " + ADAPTERS)).model("base.1")
    assert own.affinity is not None and own.affinity.header == "x-session-id" and not own.affinity.adapter


def test_v1_models_lists_the_adapters_with_their_base() -> None:
    d = translate(parse_fleet(FLEET % ADAPTERS))
    routes = d.by_type[ROUTE][names.GATEWAY_ROUTES]
    listing = next(r for r in routes.virtual_hosts[0].routes if r.name == "list-models")  # type: ignore[attr-defined]
    data = json.loads(listing.direct_response.body.inline_string)["data"]
    assert [d["id"] for d in data] == ["base.1", "sql-lora", "chat.lora", "bare", "other"]
    assert data[1]["parent"] == "base.1" and data[1]["root"] == "/models/sql"
    assert data[3]["root"] == "bare" and "parent" not in data[0]


def test_picked_clusters_tell_the_pickers_their_adapters() -> None:
    dynamic = "placement: dynamic\n    " + ADAPTERS.replace("bare:", "bare: {source: /b}")
    fleet = parse_fleet(FLEET % dynamic)
    d = translate(fleet)
    for cname in ("base.1@v1", "base.1@v2"):
        c = d.by_type[CLUSTER][cname]
        assert isinstance(c, cluster_pb2.Cluster)
        cfg = json.loads(c.metadata.filter_metadata[names.ADAPTERS_METADATA_NS].fields["config"].string_value)
        assert cfg["placement"] == "dynamic"
        assert cfg["adapters"]["sql-lora"] == {
            "source": "/models/sql",
            "versions": ["v1"],
            "endpoints": ["127.0.0.1:9001"],
        }
    other = d.by_type[CLUSTER]["other@v1"]
    assert names.ADAPTERS_METADATA_NS not in other.metadata.filter_metadata  # type: ignore[attr-defined]
    # The incremental translator builds the same clusters.
    inc = IncrementalTranslator().translate(fleet)
    assert inc.by_type[CLUSTER]["base.1@v1"] == d.by_type[CLUSTER]["base.1@v1"]
    # A dynamic load may hold a request: Envoy waits for the picker up to the load's bound.
    assert _ext_proc(d).max_message_timeout.ToNanoseconds() == 31_000_000_000
    static = translate(parse_fleet(FLEET % ADAPTERS))
    assert not _ext_proc(static).HasField("max_message_timeout")
