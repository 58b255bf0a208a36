"""Quotas on LoRA adapters (issue 45): `quotas.models.<adapter>` (fleet/schema_quotas.py), the
adapter's descriptors on the routes that take adapters' names (routing/quotas.py, the route
split in routing/translate.py), and the rate-limit service's decisions on them
(quota/service.py, quota/limiter.py): a request naming an adapter with limits of its own must
fit its base model's and the adapter's, and is charged to both; any other adapter counts as its
base model only, as before."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.fleet import FleetConfigInvalid, parse_fleet
from controlplane.fleet.model import Fleet
from controlplane.quota.redis_store import RedisStore, bucket_key
from controlplane.quota.service import RateLimitService
from controlplane.quota.status import QuotaStatus
from controlplane.resources import names
from controlplane.resources.names import METADATA_NS
from controlplane.routing.quotas import RATELIMIT_FILTER, limited_adapters
from controlplane.routing.translate import ROUTE, translate
from tests.integration.test_quotas import RedisServer
from tests.unit.test_quota_redis_store import on_redis

OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT

FLEET = """\
listener: {port: 10000}
tiers: {small: {max_params_b: 20}}
models:
  base:
    params_b: 8
    stable: v1
    %(affinity)s
    adapters: {sql: {}, chat: {}, free: {}}
    versions: {v1: {endpoints: ['127.0.0.1:9001']}}
  solo:
    params_b: 8
    stable: v1
    adapters: {solo-a: {}}
    versions: {v1: {endpoints: ['127.0.0.1:9002']}}
quotas:
  service: {endpoints: ['127.0.0.1:18081'], timeout: 20ms}
  default: {requests_per_minute: 600}
  models:
    base: {tenants: {acme: {requests_per_minute: 10%(base_tokens)s}}}
%(adapters)s"""
ADAPTER_LIMITS = """\
    sql: {default: {requests_per_minute: 3}}
    chat: {tenants: {acme: {requests_per_minute: 5%(chat_tokens)s}}}
"""


def fleet(
    affinity: str = "affinity: false",
    adapters: bool = True,
    base_tokens: str = "",
    chat_tokens: str = "",
) -> Fleet:
    limits = ADAPTER_LIMITS % {"chat_tokens": chat_tokens} if adapters else ""
    return parse_fleet(
        FLEET % {"affinity": affinity, "adapters": limits, "base_tokens": base_tokens}, "fleet.yaml"
    )


def service(f: Fleet) -> RateLimitService:
    assert f.quotas is not None
    svc = RateLimitService(f.quotas)
    svc.set_fleet(f)
    return svc


# ---- the fleet file ---------------------------------------------------------------------------


def test_quotas_models_take_adapter_names_and_an_unknown_name_lists_both_kinds() -> None:
    f = fleet()
    assert f.quotas is not None and {"sql", "chat"} <= set(f.quotas.models)
    assert limited_adapters(f) == {"sql": "base", "chat": "base"}  # free and solo-a: none of their own
    with pytest.raises(FleetConfigInvalid) as got:
        parse_fleet(FLEET % {"affinity": "", "adapters": "    nope: {}\n", "base_tokens": ""}, "fleet.yaml")
    (error,) = [str(e) for e in got.value.errors]
    assert "quotas.models.nope" in error
    assert "unknown model or adapter 'nope' (models: base, solo; adapters: chat, free, solo-a, sql)" in error


# ---- what Envoy gets --------------------------------------------------------------------------


def _routes(f: Fleet) -> route_pb2.RouteConfiguration:
    routes = translate(f).by_type[ROUTE][names.GATEWAY_ROUTES]
    assert isinstance(routes, route_pb2.RouteConfiguration)
    return routes


def _route(routes: route_pb2.RouteConfiguration, name: str) -> route_components_pb2.Route:
    found = [r for r in routes.virtual_hosts[0].routes if r.name == name]
    assert len(found) == 1, [r.name for r in routes.virtual_hosts[0].routes]
    return found[0]


def descriptors(
    route: route_components_pb2.Route,
    headers: dict[str, str],
    metadata: dict[str, str],
    stream_done: bool = False,
) -> list[ratelimit_pb2.RateLimitDescriptor]:
    """What Envoy's rate-limit filter sends for `route`, as Envoy builds it: each rate limit's
    actions in order; a header or metadata that is absent drops the descriptor (unless
    skip_if_absent, or a metadata default)."""
    out = []
    for limit in route.route.rate_limits:
        if limit.apply_on_stream_done != stream_done:
            continue
        d = ratelimit_pb2.RateLimitDescriptor()
        for a in limit.actions:
            if a.HasField("generic_key"):
                d.entries.add(key=a.generic_key.descriptor_key, value=a.generic_key.descriptor_value)
            elif a.HasField("request_headers"):
                value = headers.get(a.request_headers.header_name)
                if value is not None:
                    d.entries.add(key=a.request_headers.descriptor_key, value=value)
                elif not a.request_headers.skip_if_absent:
                    break
            elif a.HasField("metadata"):
                key = a.metadata.metadata_key
                got = metadata.get(f"{key.key}:{key.path[0].key}") or a.metadata.default_value
                if got:
                    d.entries.add(key=a.metadata.descriptor_key, value=got)
                elif not a.metadata.skip_if_absent:
                    break
        else:
            out.append(d)
    return out


def _ask(
    route: route_components_pb2.Route, model: str, tenant: str | None, how: str
) -> rls_pb2.RateLimitRequest:
    """The check Envoy makes for a request naming `model` (by the x-model header or the body)."""
    headers = {"x-api-key": tenant} if tenant is not None else {}
    metadata = {f"{METADATA_NS}:model": model}
    if how == "header":
        headers["x-model"] = model
    return rls_pb2.RateLimitRequest(domain="inference", descriptors=descriptors(route, headers, metadata))


@pytest.mark.parametrize("how", ["header", "body"])
@pytest.mark.parametrize("affinity", ["affinity: false", "affinity: {header: x-session}", ""])
def test_a_model_whose_adapters_have_limits_gets_an_adapter_route_asking_for_them(
    how: str, affinity: str
) -> None:
    routes = _routes(fleet(affinity))
    base, adapters = _route(routes, f"{how}/base"), _route(routes, f"{how}/base/adapters")
    if how == "header":
        assert base.match.headers[0].string_match.exact == "base"
        regex = adapters.match.headers[0].string_match.safe_regex.regex
    else:
        assert base.match.dynamic_metadata[0].value.string_match.exact == "base"
        regex = adapters.match.dynamic_metadata[0].value.string_match.safe_regex.regex
    assert all(re.fullmatch(regex, n) for n in ("sql", "chat", "free")) and not re.fullmatch(regex, "base")
    # The hash policy only with the adapter hashing (the default affinity); an operator's own stays.
    keys = [p.header.header_name or p.filter_state.key for p in adapters.route.hash_policy]
    assert keys == (
        []
        if affinity == "affinity: false"
        else ["x-session", "x-request-id"]
        if affinity
        else ["x-model" if how == "header" else "controlplane.affinity.model", "x-request-id"]
    )
    assert [p.header.header_name for p in base.route.hash_policy] == (
        ["x-session", "x-request-id"] if "x-session" in affinity else []
    )
    # The adapter route: the adapter's descriptor first, the adapter's name taken from the
    # request, then the base model's; the base model's route: its own only.
    first, second = adapters.route.rate_limits
    entry = first.actions[1]
    if how == "header":
        assert (entry.request_headers.header_name, entry.request_headers.descriptor_key) == (
            "x-model",
            "adapter",
        )
        assert not entry.request_headers.skip_if_absent
    else:
        assert entry.metadata.descriptor_key == "adapter" and not entry.metadata.default_value
        assert (entry.metadata.metadata_key.key, entry.metadata.metadata_key.path[0].key) == (
            METADATA_NS,
            "model",
        )
    assert [a.WhichOneof("action_specifier") for a in second.actions] == ["generic_key", "request_headers"]
    assert len(base.route.rate_limits) == 1 and base.route.rate_limits[0] == second
    got = _ask(adapters, "sql", "acme", how).descriptors
    assert [[(e.key, e.value) for e in d.entries] for d in got] == [
        [("model", "base"), ("adapter", "sql"), ("tenant", "acme")],
        [("model", "base"), ("tenant", "acme")],
    ]


def test_adapters_without_limits_of_their_own_keep_their_routes_as_before() -> None:
    plain = _routes(fleet(adapters=False))
    # affinity: false and no adapter named: one route takes the base and adapter names alike.
    assert [r.name for r in plain.virtual_hosts[0].routes if r.name.startswith("header/base")] == [
        "header/base"
    ]
    assert len(_route(plain, "header/base").route.rate_limits) == 1
    # solo hashes by adapter (the default) but quotas name none of its adapters: no adapter descriptor.
    for routes in (plain, _routes(fleet())):
        solo = _route(routes, "header/solo/adapters")
        assert len(solo.route.rate_limits) == 1
        assert all(a.request_headers.descriptor_key != "adapter" for a in solo.route.rate_limits[0].actions)
    # The base model's own requests never carry the adapter's descriptor.
    base = _route(_routes(fleet()), "body/base")
    assert [len(d.entries) for d in descriptors(base, {"x-api-key": "acme"}, {})] == [2]


def test_token_checks_and_charges_come_twice_only_where_an_adapter_sets_tokens() -> None:
    requests_only = _route(_routes(fleet(base_tokens=", tokens_per_minute: 1000")), "header/base/adapters")
    kinds = [(len(r.actions), r.apply_on_stream_done) for r in requests_only.route.rate_limits]
    assert kinds[:3] == [(3, False), (2, False), (3, False)] and [k[1] for k in kinds].count(True) == 1
    both = _route(
        _routes(fleet(base_tokens=", tokens_per_minute: 1000", chat_tokens=", tokens_per_minute: 100")),
        "header/base/adapters",
    )
    done = descriptors(both, {"x-model": "chat", "x-api-key": "acme"}, {}, stream_done=True)
    assert [[e.value for e in d.entries[:4]] for d in done] == [
        ["base", "chat", "acme", "charge"],
        ["base", "acme", "charge", "none"],
    ]
    refused = both.route.rate_limits[-1].actions[-1].metadata.metadata_key.key
    assert refused == RATELIMIT_FILTER  # a 429 of ours costs neither bucket


# ---- the service ------------------------------------------------------------------------------


def _adapter_route(f: Fleet, how: str = "header") -> route_components_pb2.Route:
    return _route(_routes(f), f"{how}/base/adapters")


def _headers(answer: rls_pb2.RateLimitResponse) -> dict[str, str]:
    return {h.key: h.value for h in answer.response_headers_to_add}


def test_an_adapter_over_its_own_limit_is_refused_while_its_base_and_other_adapters_are_served() -> None:
    f = fleet()
    svc, route = service(f), _adapter_route(f)
    sql = [svc.decide(_ask(route, "sql", "acme", "header"), now=1.0) for _ in range(4)]
    assert [a.overall_code for a in sql] == [OK, OK, OK, OVER]
    assert _headers(sql[2])["x-ratelimit-limit-requests"] == "3"  # the tighter bucket's headers
    over = sql[3]
    assert _headers(over)["x-ratelimit-remaining-requests"] == "0" and int(_headers(over)["retry-after"]) >= 1
    assert [s.code for s in over.statuses] == [OVER, OK]
    error = json.loads(over.raw_body)["error"]
    assert "on sql" in error["message"] and error["type"] == "requests"
    # Each of the three counted on the base model too (acme: 10 there); the refused one on neither.
    assert svc.limiter.level("acme", "base", 1.0) == 7.0 and svc.limiter.level("acme", "sql", 1.0) == 0.0
    base_route = _route(_routes(f), "header/base")
    assert svc.decide(_ask(base_route, "base", "acme", "header"), now=1.0).overall_code == OK
    assert svc.decide(_ask(route, "chat", "acme", "header"), now=1.0).overall_code == OK
    assert svc.decide(_ask(route, "sql", "globex", "header"), now=1.0).overall_code == OK  # its own bucket
    assert svc.limiter.level("acme", "base", 1.0) == 5.0
    labels = svc.metrics.decisions.labels
    assert labels("sql", "acme", "over_limit")._value.get() == 1
    # Per descriptor: 3 sql, the refused sql's base check (room, nothing taken), 1 base, 1 chat.
    assert labels("base", "acme", "ok")._value.get() == 6
    assert labels("chat", "other", "unlimited")._value.get() == 0  # globex has no chat limit: not asked


def test_the_base_models_limit_covers_its_adapters_and_takes_nothing_from_an_adapter_it_refuses() -> None:
    f = fleet()
    svc, route = service(f), _adapter_route(f, "body")
    answers = [svc.decide(_ask(route, name, "acme", "body"), now=0.0) for name in ["free"] * 8 + ["chat"] * 3]
    assert [a.overall_code for a in answers] == [OK] * 10 + [OVER]
    assert svc.limiter.level("acme", "chat", 0.0) == 3.0  # chat's 5, two taken; the refused one not
    assert "on base" in json.loads(answers[-1].raw_body)["error"]["message"]


def test_an_adapter_without_limits_of_its_own_is_its_base_model_only() -> None:
    f = fleet()
    svc, route = service(f), _adapter_route(f)
    for model, tenant in (("free", "acme"), ("free", None), ("sql", "globex")):
        svc.decide(_ask(route, model, tenant, "header"), now=0.0)
    assert sorted({m for _, m, _ in svc.limiter.buckets}) == ["base", "sql"]  # no bucket for free
    assert svc.metrics.decisions.labels("other", "acme", "ok")._value.get() == 0  # free's not decided
    # Descriptors no route sends: an adapter of another model, a model's name, no adapter at all.
    for adapter in ("solo-a", "base", "nope", "x" * 1000):
        d = ratelimit_pb2.RateLimitDescriptor()
        d.entries.add(key="model", value="base")
        d.entries.add(key="adapter", value=adapter)
        d.entries.add(key="tenant", value="acme")
        got = svc.decide(rls_pb2.RateLimitRequest(domain="inference", descriptors=[d]), now=0.0)
        assert got.overall_code == OK and not got.response_headers_to_add
    assert sorted({m for _, m, _ in svc.limiter.buckets}) == ["base", "sql"]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["base", "free"]), st.sampled_from(["acme", "globex"]), st.floats(0, 3))
    )
)
def test_requests_of_unlimited_adapters_decide_exactly_as_without_adapter_quotas(
    requests: list[tuple[str, str, float]],
) -> None:
    with_limits, without = fleet(), fleet(adapters=False)
    a, b = service(with_limits), service(without)
    split = {
        naming: _route(_routes(with_limits), naming) for naming in ("header/base", "header/base/adapters")
    }
    one = _route(_routes(without), "header/base")  # takes the base and adapter names alike
    now = 0.0
    for model, tenant, dt in requests:
        now += dt
        got_a = a.decide(
            _ask(
                split["header/base" if model == "base" else "header/base/adapters"], model, tenant, "header"
            ),
            now,
        )
        got_b = b.decide(_ask(one, model, tenant, "header"), now)
        assert (got_a.overall_code, _headers(got_a)) == (got_b.overall_code, _headers(got_b))


def test_an_adapters_tokens_are_checked_and_charged_to_it_and_to_its_base_model() -> None:
    f = fleet(base_tokens=", tokens_per_minute: 1000", chat_tokens=", tokens_per_minute: 100")
    svc, route = service(f), _adapter_route(f)
    headers = {"x-model": "chat", "x-api-key": "acme"}
    check = rls_pb2.RateLimitRequest(domain="inference", descriptors=descriptors(route, headers, {}))
    assert svc.decide(check, now=0.0).overall_code == OK
    used = {f"{METADATA_NS}:usage_total_tokens": "150"}
    done = rls_pb2.RateLimitRequest(
        domain="inference", descriptors=descriptors(route, headers, used, stream_done=True)
    )
    svc.decide(done, now=0.0)
    assert svc.limiter.level("acme", "chat", 0.0, "tokens") == -50.0
    assert svc.limiter.level("acme", "base", 0.0, "tokens") == 850.0
    # The tokens metric counts the response once, under its base model.
    assert svc.metrics.tokens.labels("base", "acme", "usage")._value.get() == 150
    assert svc.metrics.tokens.labels("chat", "acme", "usage")._value.get() == 0
    refused = svc.decide(check, now=0.0)
    assert refused.overall_code == OVER and json.loads(refused.raw_body)["error"]["type"] == "tokens"
    assert _headers(refused)["x-ratelimit-limit-tokens"] == "100"
    # sql sets no tokens of its own: only the base model's apply.
    sql = {"x-model": "sql", "x-api-key": "acme"}
    answer = svc.decide(
        rls_pb2.RateLimitRequest(domain="inference", descriptors=descriptors(route, sql, {})), 0.0
    )
    assert answer.overall_code == OK and _headers(answer)["x-ratelimit-limit-tokens"] == "1000"


def test_the_status_lists_an_adapters_bucket_with_its_own_limit() -> None:
    f = fleet()
    svc, route = service(f), _adapter_route(f)
    svc.decide(_ask(route, "sql", "acme", "header"), now=0.0)
    rows, _ = asyncio.run(QuotaStatus(svc).page("acme", 100, {}))
    assert sorted((r.model, r.limit_per_minute) for r in rows) == [("base", 10), ("sql", 3)]


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    server = RedisServer(tmp_path).start()  # skips without redis-server (fails under CI's REQUIRE)
    try:
        yield server.url
    finally:
        server.stop()


def test_on_redis_a_request_an_adapter_refuses_takes_nothing_from_its_base_model(redis_url: str) -> None:
    f = fleet()
    route = _adapter_route(f)

    async def body(store: RedisStore) -> None:
        svc = service(f)
        svc.store = store
        answers = [await svc.decide_async(_ask(route, "sql", "acme", "header"), 0.0) for _ in range(5)]
        assert [a.overall_code for a in answers] == [OK] * 3 + [OVER] * 2
        assert "on sql" in json.loads(answers[-1].raw_body)["error"]["message"]
        _, base = await store.apply("requests", "base", "acme", 10, 0, "read")
        _, sql = await store.apply("requests", "sql", "acme", 3, 0, "read")
        assert 7.0 <= base < 7.5 and 0.0 <= sql < 0.5, (base, sql)  # 3 taken from each, then none
        assert await store.client.exists(bucket_key("requests", "free", "acme")) == 0

    on_redis(redis_url, body)
