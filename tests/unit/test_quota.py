"""Per-tenant quotas: the fleet's `quotas:` (fleet/schema_quotas.py), the limiter
(quota/limiter.py, pure), the rate-limit service's answers (quota/service.py) and what Envoy
gets (routing/quotas.py)."""

from __future__ import annotations

import json

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.service.ratelimit.v3 import rls_pb2
from hypothesis import given
from hypothesis import strategies as st

from controlplane.fleet import FleetConfigInvalid, parse_fleet
from controlplane.fleet.model import QuotaLimit, QuotaSpec
from controlplane.quota.limiter import WINDOW_S, Limiter, duration
from controlplane.quota.service import RateLimitService
from controlplane.resources import names
from controlplane.routing.incremental import IncrementalTranslator
from controlplane.routing.quotas import COPIES_FIELDS, DOMAIN, OUTPUT_LIMIT_FIELDS, RATELIMIT_FILTER
from controlplane.routing.translate import CLUSTER, LISTENER, ROUTE, translate

BASE = """\
listener: {port: 10000}
tiers: {small: {max_params_b: 20}}
models:
  chat: {params_b: 8, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9001']}}}
  big: {params_b: 8, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9002']}}}
"""
QUOTAS = """\
quotas:
  key: {header: x-api-key}
  service: {endpoints: ['127.0.0.1:18081'], timeout: 20ms}
  default: {requests_per_minute: 600}
  tenants:
    acme: {requests_per_minute: 60}
    free: {}
  models:
    big: {default: {requests_per_minute: 30}, tenants: {acme: {requests_per_minute: 3}}}
"""


def spec() -> QuotaSpec:
    q = parse_fleet(BASE + QUOTAS).quotas
    assert q is not None
    return q


def test_the_most_specific_level_that_sets_a_limit_wins() -> None:
    q = spec()
    rpm = "requests_per_minute"
    assert q.limit("acme", "big", rpm) == 3  # the model's tenant
    assert q.limit("globex", "big", rpm) == 30  # the model's default
    assert q.limit("acme", "chat", rpm) == 60  # the tenant
    assert q.limit("free", "chat", rpm) == 600  # a tenant that sets nothing: the default
    assert q.limit("", "chat", rpm) == 600  # no key at all: the default
    assert QuotaSpec(endpoints=(("127.0.0.1", 1),)).limit("x", "chat", rpm) is None  # none set: unlimited


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("quotas: {default: {requests_per_minute: -1}, %(svc)s}",
         "quotas.default.requests_per_minute", "whole number"),
        ("quotas: {default: {requests_per_minute: 1.5}, %(svc)s}",
         "quotas.default.requests_per_minute", "whole number"),
        ("quotas: {models: {nope: {}}, %(svc)s}", "quotas.models.nope", "unknown model"),
        ("quotas: {default: {requests_per_minute: 5}}", "quotas.service.endpoints", "controlplane ratelimit"),
        ("quotas: {service: {endpoints: ['127.0.0.300:1']}}", "quotas.service.endpoints[0]", "not an IP"),
        ("quotas: {service: {endpoints: ['127.0.0.1:1', '127.0.0.1:1']}}",
         "quotas.service.endpoints", "twice"),
        ("quotas: {key: {header: authorization}, %(svc)s}",
         "quotas.key.header", "credentials"),
        ("quotas: {key: {header: X-Key}, %(svc)s}", "quotas.key.header", "lower-case"),
        ("quotas: {service: {endpoints: ['127.0.0.1:1'], timeout: 5s}}", "quotas.service.timeout", "between"),
        ("quotas: {service: {endpoints: ['127.0.0.1:1'], on_error: maybe}}",
         "quotas.service.on_error", "allow"),
        ("quotas: {tenants: {'bad tenant': {}}, %(svc)s}",
         "quotas.tenants.bad tenant", "letters"),
        ("quotas: {default: {tokens_per_minute: many}, %(svc)s}",
         "quotas.default.tokens_per_minute", "whole number"),
        ("quotas: {default: {rpm: 2000}, %(svc)s}", "quotas.default.rpm", "unknown key"),
    ],
)  # fmt: skip
def test_bad_quotas_name_the_field_and_the_reason(text: str, field: str, words: str) -> None:
    with pytest.raises(FleetConfigInvalid) as got:
        parse_fleet(BASE + text.replace("%(svc)s", "service: {endpoints: ['127.0.0.1:1']}") + "\n")
    errors = [e for e in got.value.errors if e.path == field]
    assert errors, [str(e) for e in got.value.errors]
    assert words in errors[0].reason, errors[0].reason


def test_a_burst_takes_the_minute_then_the_refill_rate() -> None:
    limiter = Limiter(spec())
    got = [limiter.check("acme", "big", now=100.0) for _ in range(5)]
    assert [d.allowed for d in got] == [True, True, True, False, False]
    assert [d.remaining for d in got] == [2, 1, 0, 0, 0]
    assert got[3].headers()["retry-after"] == "20"  # one of 3 a minute: back in 20 s
    assert got[0].headers()["x-ratelimit-limit-requests"] == "3"
    assert "retry-after" not in got[0].headers()
    assert limiter.check("acme", "big", now=100.0 + 19.0).allowed is False
    assert limiter.check("acme", "big", now=100.0 + 20.5).allowed is True
    assert limiter.check("acme", "chat", now=100.0).allowed is True  # another model, another bucket
    assert limiter.check("globex", "big", now=100.0).remaining == 29  # another tenant


@given(st.integers(1, 600), st.lists(st.floats(0, 5), min_size=1, max_size=200))
def test_no_more_than_the_limit_plus_the_refill_is_ever_allowed(limit: int, gaps: list[float]) -> None:
    q = QuotaSpec(default=QuotaLimit(requests_per_minute=limit), endpoints=(("127.0.0.1", 1),))
    limiter = Limiter(q)
    now, allowed = 0.0, 0
    for gap in gaps:
        now += gap
        allowed += limiter.check("t", "m", now).allowed
    assert allowed <= limit + now * limit / WINDOW_S + 1e-9


def test_openais_duration_format() -> None:
    assert duration(0.02) == "20ms"
    assert duration(1.0) == "1s"
    assert duration(59.2) == "1m0s"
    assert duration(360.0) == "6m0s"


def _request(model: str | None, tenant: str | None, domain: str = DOMAIN) -> rls_pb2.RateLimitRequest:
    d = ratelimit_pb2.RateLimitDescriptor()
    if model is not None:
        d.entries.add(key="model", value=model)
    if tenant is not None:
        d.entries.add(key="tenant", value=tenant)
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=[d])


def test_the_service_answers_openai_headers_and_body() -> None:
    svc = RateLimitService(spec())
    answers = [svc.decide(_request("big", "acme"), now=5.0) for _ in range(4)]
    assert [a.overall_code for a in answers] == [rls_pb2.RateLimitResponse.OK] * 3 + [
        rls_pb2.RateLimitResponse.OVER_LIMIT
    ]
    ok = {h.key: h.value for h in answers[0].response_headers_to_add}
    assert ok["x-ratelimit-remaining-requests"] == "2" and not answers[0].raw_body
    over = answers[3]
    headers = {h.key: h.value for h in over.response_headers_to_add}
    assert headers["retry-after"] == "20" and headers["content-type"] == "application/json"
    error = json.loads(over.raw_body)["error"]
    assert error["code"] == "rate_limit_exceeded" and "big" in error["message"]


def test_what_the_service_cannot_read_is_never_refused() -> None:
    svc = RateLimitService(spec())
    for req in (_request(None, "acme"), _request("big", "acme", domain="other")):
        for _ in range(10):
            assert svc.decide(req, now=1.0).overall_code == rls_pb2.RateLimitResponse.OK
    huge = "k" * 10_000_000  # a 10 MB key: one tenant, "invalid", with the default limits
    answers = [svc.decide(_request("chat", huge), now=1.0) for _ in range(3)]
    assert all(a.overall_code == rls_pb2.RateLimitResponse.OK for a in answers)
    assert ("invalid", "chat", "requests") in svc.limiter.buckets


def test_envoy_gets_the_filter_the_cluster_and_each_routes_descriptor() -> None:
    fleet = parse_fleet(BASE + QUOTAS)
    d = translate(fleet)
    hcm = hcm_pb2.HttpConnectionManager()
    d.by_type[LISTENER][names.GATEWAY_LISTENER].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    filters = [f.name for f in hcm.http_filters]
    assert RATELIMIT_FILTER in filters and filters.index(RATELIMIT_FILTER) < filters.index(
        "envoy.filters.http.router"
    )
    cfg = rate_limit_pb2.RateLimit()
    hcm.http_filters[filters.index(RATELIMIT_FILTER)].typed_config.Unpack(cfg)
    assert cfg.domain == DOMAIN and not cfg.failure_mode_deny  # fail open by default
    assert cfg.timeout.ToMilliseconds() == 20
    assert cfg.rate_limit_service.grpc_service.envoy_grpc.cluster_name == names.RATELIMIT_CLUSTER
    rl = d.by_type[CLUSTER][names.RATELIMIT_CLUSTER]
    assert isinstance(rl, cluster_pb2.Cluster)
    assert rl.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value == 18081
    model_routes = [
        r
        for vh in d.by_type[ROUTE][names.GATEWAY_ROUTES].virtual_hosts
        for r in vh.routes
        if r.HasField("route")
    ]
    assert model_routes and all(len(r.route.rate_limits) == 1 for r in model_routes)
    actions = model_routes[0].route.rate_limits[0].actions
    assert actions[0].generic_key.descriptor_key == "model"
    assert actions[1].request_headers.header_name == "x-api-key" and actions[1].request_headers.skip_if_absent
    # The incremental translator gives the same.
    inc = IncrementalTranslator().translate(fleet)
    for t in (CLUSTER, LISTENER, ROUTE):
        assert inc.by_type[t] == d.by_type[t]
    # No quotas: none of it.
    plain = translate(parse_fleet(BASE))
    assert names.RATELIMIT_CLUSTER not in plain.by_type[CLUSTER]


TOKENS = QUOTAS.replace(
    "    acme: {requests_per_minute: 60}", "    acme: {requests_per_minute: 60, tokens_per_minute: 100}"
)


def _charge(model: str, tenant: str, **entries: str) -> rls_pb2.RateLimitRequest:
    req = _request(model, tenant)
    d = req.descriptors[0]
    d.entries.add(key="kind", value="charge")
    for key, value in entries.items():
        d.entries.add(key=key, value=value)
    return req


def _tokens(model: str, tenant: str) -> rls_pb2.RateLimitRequest:
    req = _request(model, tenant)
    req.descriptors.add().CopyFrom(req.descriptors[0])
    req.descriptors[1].entries.add(key="kind", value="tokens")
    return req


def test_tokens_are_charged_at_the_end_and_checked_before_the_next_request() -> None:
    q = parse_fleet(BASE + TOKENS).quotas
    assert q is not None
    svc = RateLimitService(q)
    first = svc.decide(_tokens("chat", "acme"), now=0.0)
    headers = {h.key: h.value for h in first.response_headers_to_add}
    assert first.overall_code == rls_pb2.RateLimitResponse.OK
    assert headers["x-ratelimit-limit-tokens"] == "100" and headers["x-ratelimit-remaining-tokens"] == "100"
    assert headers["x-ratelimit-limit-requests"] == "60"  # both kinds on every answer
    svc.decide(_charge("chat", "acme", usage="130"), now=0.1)  # one long answer: in debt
    over = svc.decide(_tokens("chat", "acme"), now=0.2)
    assert over.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT
    h = {x.key: x.value for x in over.response_headers_to_add}
    assert h["x-ratelimit-remaining-tokens"] == "0" and int(h["retry-after"]) >= 18  # 30 tokens of debt
    assert json.loads(over.raw_body)["error"]["type"] == "tokens"
    assert svc.decide(_tokens("chat", "globex"), now=0.2).overall_code == rls_pb2.RateLimitResponse.OK
    assert over.dynamic_metadata.fields["refused"].string_value == "yes"
    svc.decide(_charge("chat", "acme", refused="yes"), now=0.3)  # our own 429 costs nothing
    later = svc.decide(_tokens("chat", "acme"), now=0.2 + 19.0)  # 30 of debt repaid at 100/min
    assert later.overall_code == rls_pb2.RateLimitResponse.OK


@pytest.mark.parametrize(
    ("entries", "tokens", "how"),
    [
        ({"usage": "57"}, 57, "usage"),
        ({"usage": "57.0"}, 57, "usage"),
        ({"usage": "-5", "prompt_bytes": "400", "max_tokens": "10"}, 110, "estimate"),
        ({"usage": "1e12", "prompt_bytes": "400", "max_tokens": "10"}, 110, "estimate"),
        ({"usage": "lots", "prompt_bytes": "400"}, 356, "estimate"),
        ({"usage": "", "prompt_bytes": "x", "max_tokens": "y"}, 256, "estimate"),
        ({}, 256, "estimate"),
    ],
)
def test_a_response_is_never_free(entries: dict[str, str], tokens: int, how: str) -> None:
    from controlplane.quota.service import charged_tokens

    assert charged_tokens(entries) == (tokens, how)


def test_token_quotas_add_the_token_check_and_the_charge_at_stream_end() -> None:
    d = translate(parse_fleet(BASE + TOKENS))
    routes = [
        r
        for vh in d.by_type[ROUTE][names.GATEWAY_ROUTES].virtual_hosts
        for r in vh.routes
        if r.HasField("route")
    ]
    limits = routes[0].route.rate_limits
    assert [rl.apply_on_stream_done for rl in limits] == [False, False, True]
    keys = [a.WhichOneof("action_specifier") for a in limits[2].actions]
    outputs = len(OUTPUT_LIMIT_FIELDS) + len(COPIES_FIELDS)
    assert keys == [
        "generic_key", "request_headers", "generic_key", "metadata", "request_headers",
        *["metadata"] * outputs, "metadata",
    ]  # fmt: skip
    described = [a.metadata.descriptor_key for a in limits[2].actions[5:-1]]
    assert described == [*OUTPUT_LIMIT_FIELDS, *COPIES_FIELDS]
    assert all(a.metadata.default_value == "none" for a in limits[2].actions[5:])  # never dropped
    assert limits[2].actions[-1].metadata.metadata_key.key == RATELIMIT_FILTER  # the service's own mark
    hcm = hcm_pb2.HttpConnectionManager()
    d.by_type[LISTENER][names.GATEWAY_LISTENER].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2

    j = json_to_metadata_pb2.JsonToMetadata()
    next(f for f in hcm.http_filters if f.name.endswith("json_to_metadata")).typed_config.Unpack(j)
    assert [s.key for s in j.response_rules.rules[0].selectors] == ["usage", "total_tokens"]


def test_a_bearer_token_is_a_tenant_by_its_hash() -> None:
    import hashlib

    from controlplane.quota.service import bearer_tenant

    want = "key-" + hashlib.sha256(b"sk-123").hexdigest()[:16]
    assert bearer_tenant("Bearer sk-123") == want == bearer_tenant("bearer  sk-123 ")
    assert bearer_tenant("Basic dXNlcjpwdw==") == "" and bearer_tenant("Bearer ") == ""
    text = QUOTAS.replace("key: {header: x-api-key}", "key: {bearer: true}").replace("acme:", f"{want}:")
    fleet = parse_fleet(BASE + text)
    assert fleet.quotas is not None and fleet.quotas.key_bearer
    routes = [
        r for vh in translate(fleet).by_type[ROUTE][names.GATEWAY_ROUTES].virtual_hosts for r in vh.routes
        if r.HasField("route")
    ]  # fmt: skip
    header = routes[0].route.rate_limits[0].actions[1].request_headers
    assert (header.header_name, header.descriptor_key) == ("authorization", "bearer")
    svc = RateLimitService(fleet.quotas)
    req = _request("big", None)
    req.descriptors[0].entries.add(key="bearer", value="Bearer sk-123")
    assert [svc.decide(req, now=1.0).overall_code for _ in range(4)][
        -1
    ] == rls_pb2.RateLimitResponse.OVER_LIMIT
    for bad, words in (
        ("{header: x-api-key, bearer: true}", "not both"),
        ("{bearer: yes-please}", "true or false"),
    ):
        with pytest.raises(FleetConfigInvalid) as got:
            parse_fleet(BASE + QUOTAS.replace("{header: x-api-key}", bad))
        assert words in str(got.value)
