"""The `prometheus` signal source: queries, answers, conversion to samples (pure), and the
shell's behaviour against a loopback HTTP server that answers as Prometheus does."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from controlplane.fleet import parse_fleet
from controlplane.fleet.model import Fleet
from controlplane.obs.metrics import Metrics
from controlplane.signals.parse import ServerSample
from controlplane.signals.prometheus import (
    BUCKETS,
    FIELDS,
    SAMPLE_TIME,
    PrometheusQueryFailed,
    PrometheusSource,
    Vector,
    analysed_addresses,
    build_queries,
    convert,
    decode_answer,
    series_key,
)
from controlplane.signals.source import make_source
from controlplane.signals.store import ScrapeResult, SignalStore
from tests.fleets import fleet_yaml

A, B, C = "127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"
EVAL = 1_700_000_100.0  # Prometheus's evaluation time of the round
SCRAPED = EVAL - 1.5  # when Prometheus last scraped the servers


def item(
    addr: str | None, value: float | str, model: str | None = "chat", at: float = EVAL, **labels: str
) -> Any:
    """One element of an instant vector, as Prometheus encodes it."""
    metric = {**({"instance": addr} if addr is not None else {}), **labels}
    if model is not None:
        metric["model_name"] = model
    return {"metric": metric, "value": [at, str(value)]}


def page(
    addr: str, model: str | None = "chat", scraped: float = SCRAPED, **values: float
) -> dict[str, list[Any]]:
    """Every query's series for one server: the fields given, and its sample time."""
    out: dict[str, list[Any]] = {name: [] for name in (*FIELDS, SAMPLE_TIME)}
    for name, v in values.items():
        out[name].append(item(addr, v, model))
    out[SAMPLE_TIME].append(item(addr, scraped, model))
    return out


def merge(*pages: dict[str, list[Any]]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for p in pages:
        for name, series in p.items():
            out.setdefault(name, []).extend(series)
    return out


ASKED = [*(f for f in FIELDS if f != "successes"), SAMPLE_TIME]  # for a fleet without rollouts
FULL = {
    "running": 3,
    "waiting": 7,
    "kv_use": 0.42,
    "latency_sum_s": 120.0,
    "latency_count": 40,
    "successes": 40,
    "token_latency_sum_s": 8.0,
    "token_latency_count": 400,
}


# ---- queries -------------------------------------------------------------------------------


def test_one_query_per_field_summed_by_address_and_model() -> None:
    queries = {q.name: q.promql for q in build_queries("instance")}
    assert set(queries) == set(ASKED)
    assert queries["running"] == "sum by (instance, model_name) (vllm:num_requests_running)"
    assert (
        queries["latency_count"] == "sum by (instance, model_name) (vllm:e2e_request_latency_seconds_count)"
    )
    # The legacy KV gauge only where the first is absent; KV use is a mean over a
    # data-parallel server's engines (each a share of its own pool), never their sum.
    assert queries["kv_use"] == (
        "avg by (instance, model_name) (vllm:kv_cache_usage_perc) or "
        "avg by (instance, model_name) (vllm:gpu_cache_usage_perc)"
    )
    # The per-token histogram under its three names, in parse.py's order: the first wins.
    assert queries["token_latency_count"] == (
        "sum by (instance, model_name) (vllm:time_per_output_token_seconds_count) or "
        "sum by (instance, model_name) (vllm:inter_token_latency_seconds_count) or "
        "sum by (instance, model_name) (vllm:request_time_per_output_token_seconds_count)"
    )


def test_the_success_counter_and_histogram_are_asked_only_for_analysed_addresses_escaped() -> None:
    queries = {q.name: q.promql for q in build_queries("instance", [B, A, "[::1]:8000", A])}
    assert set(queries) == {*ASKED, "successes", BUCKETS}
    only = '{instance=~"127\\\\.0\\\\.0\\\\.1:8000|127\\\\.0\\\\.0\\\\.2:8000|\\\\[::1\\\\]:8000"}'
    assert (
        queries[BUCKETS]
        == f"sum by (instance, model_name, le) (vllm:e2e_request_latency_seconds_bucket{only})"
    )
    # Aborted and failed requests are not successes (vLLM's finished_reason).
    assert queries["successes"] == (
        "sum by (instance, model_name) "
        f'(vllm:request_success_total{{finished_reason!~"abort|error",{only[1:]})'
    )


def test_the_sample_time_is_the_newest_gauge_timestamp() -> None:
    q = {q.name: q.promql for q in build_queries("instance")}[SAMPLE_TIME]
    assert q == (
        "max by (instance, model_name) (timestamp(vllm:num_requests_running)) or "
        "max by (instance, model_name) (timestamp(vllm:num_requests_waiting)) or "
        "max by (instance, model_name) (timestamp(vllm:kv_cache_usage_perc))"
    )


def test_the_address_label_is_configurable() -> None:
    for q in build_queries("pod_address", [A]):
        assert "pod_address" in q.promql and "instance" not in q.promql


def test_histograms_are_asked_for_models_with_a_second_version_only() -> None:
    fleet = parse_fleet(fleet_yaml({"one": {"v1": [A]}, "two": {"v1": [B], "v2": [C]}}))
    assert analysed_addresses(fleet) == [B, C]


# ---- answers -------------------------------------------------------------------------------


def answer(result: list[Any], result_type: str = "vector") -> bytes:
    """An answer in Prometheus's own compact form."""
    doc = {"status": "success", "data": {"resultType": result_type, "result": result}}
    return json.dumps(doc, separators=(",", ":")).encode()


def conv(answers: dict[str, list[Any]], targets: list[tuple[str, str]], **kw: Any) -> Any:
    """convert() over the answers as Prometheus would send them, decoded."""
    return convert({name: decode_answer(200, answer(r)) for name, r in answers.items()}, targets, **kw)


def test_a_vector_answer_is_decoded_by_label_set() -> None:
    v = decode_answer(200, answer([item(A, 3), item(B, "1e+03", model=None)]))
    assert v == Vector(
        {'"instance":"127.0.0.1:8000","model_name":"chat"': "3", '"instance":"127.0.0.2:8000"': "1e+03"}, EVAL
    )
    assert (
        series_key({"model_name": "chat", "instance": A}) == '"instance":"127.0.0.1:8000","model_name":"chat"'
    )
    assert v.unlabelled  # B's series has no model_name
    assert not decode_answer(200, answer([item(A, 3), item(B, 4)])).unlabelled
    assert decode_answer(200, answer([])) == Vector({}, None, unlabelled=False)


def test_the_canonical_form_is_read_without_json(monkeypatch: pytest.MonkeyPatch) -> None:
    import controlplane.signals.prometheus as prom

    class NoJson:
        @staticmethod
        def loads(body: bytes) -> Any:
            raise AssertionError("json.loads was called")

        dumps = staticmethod(json.dumps)

    body = answer([item(A, 3), item(B, 4, model=None), item(C, 5, le="+Inf")])
    expected = decode_answer(200, body)
    monkeypatch.setattr(prom, "json", NoJson)
    assert decode_answer(200, body) == expected
    assert len(expected.values) == 3
    with pytest.raises(AssertionError, match=r"json\.loads"):  # anything else goes through json
        decode_answer(200, body.replace(b"},{", b"}, {"))


def test_an_answer_in_any_other_json_form_decodes_the_same() -> None:
    """The canonical compact form is read by regex; spaces, other key orders, escapes and
    warnings go through json and give the same Vector."""
    result = [item(A, 3), item(B, 4, le="0.5"), item(C, "NaN", model=None)]
    plain = decode_answer(200, answer(result))
    assert len(plain.values) == 3
    spaced = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}, indent=1)
    assert decode_answer(200, spaced.encode()) == plain
    reordered = {"data": {"result": result, "resultType": "vector"}, "status": "success"}
    assert decode_answer(200, json.dumps(reordered).encode()) == plain
    warned = {"status": "success", "data": {"resultType": "vector", "result": result}, "warnings": ["w"]}
    assert decode_answer(200, json.dumps(warned, separators=(",", ":")).encode()) == plain
    unsorted = answer([{"metric": {"model_name": "chat", "instance": A}, "value": [EVAL, "3"]}])
    assert decode_answer(200, unsorted) == decode_answer(200, answer([item(A, 3)]))
    escaped = [item(A, 3, model='say "hi"')]
    assert decode_answer(200, answer(escaped)).values == {
        '"instance":"127.0.0.1:8000","model_name":"say "hi""': "3"
    }


def test_a_label_set_twice_in_one_answer_is_summed() -> None:
    v = decode_answer(200, answer([item(A, 3), item(A, 4)]))
    assert [float(x) for x in v.values.values()] == [7.0]


@pytest.mark.parametrize(
    "bad",
    [
        [{"metric": {"instance": A}}],  # no value
        [{"value": [EVAL, "1"]}],  # no labels
        [{"metric": {"instance": A}, "value": [EVAL]}],
        [{"metric": {"instance": A}, "value": [EVAL, 1]}],  # a number, not a string
        [{"metric": {"instance": A}, "histogram": [EVAL, {}]}],  # a native histogram
        ["just a string"],
    ],
)
def test_a_malformed_series_makes_the_answer_invalid(bad: list[Any]) -> None:
    with pytest.raises(PrometheusQueryFailed) as e:
        decode_answer(200, answer(bad))
    assert e.value.outcome == "invalid"


def test_a_truncated_answer_is_not_taken_for_a_shorter_one() -> None:
    body = answer([item(A, 3), item(B, 4)])
    with pytest.raises(PrometheusQueryFailed) as e:
        decode_answer(200, body[:-10])
    assert e.value.outcome == "invalid"
    with pytest.raises(PrometheusQueryFailed):
        decode_answer(200, body[:-3] + b"]}x}")
    # Something between the series, with the envelope intact: not taken for a vector.
    with pytest.raises(PrometheusQueryFailed) as e:
        decode_answer(200, body.replace(b',{"metric"', b',"junk",{"metric"', 1))
    assert e.value.outcome == "invalid"


@pytest.mark.parametrize(
    ("status", "body", "outcome", "says"),
    [
        (
            400,
            b'{"status":"error","errorType":"bad_data","error":"parse error at char 5"}',
            "error",
            "bad_data",
        ),
        (422, b'{"status":"error","errorType":"execution","error":"too many samples"}', "error", "execution"),
        (
            503,
            b'{"status":"error","errorType":"unavailable","error":"shutting down"}',
            "http_error",
            "shutting",
        ),
        (502, b"<html>Bad Gateway</html>", "http_error", "HTTP 502"),
        (200, b'{"status":"success","data":{"resultType":"vec', "invalid", "not JSON"),
        (200, b"[1, 2]", "invalid", "JSON object"),
        (200, answer([], "matrix"), "invalid", "instant vector"),
        (200, b'{"status":"success"}', "invalid", "unexpected answer"),
    ],
)
def test_an_answer_without_a_vector_says_why(status: int, body: bytes, outcome: str, says: str) -> None:
    with pytest.raises(PrometheusQueryFailed) as e:
        decode_answer(status, body)
    assert e.value.outcome == outcome
    assert says in str(e.value)


# ---- conversion ----------------------------------------------------------------------------


def test_each_family_becomes_its_field_and_the_age_comes_from_the_sample_time() -> None:
    out = conv(page(A, **FULL), [("chat", A)])
    r = out.results[("chat", A)]
    assert r.health_status is None and r.health_error is None  # health is not observed
    assert r.metrics_error is None
    assert r.age_s == pytest.approx(1.5)
    s = r.sample
    assert s is not None and s.dialect == "vllm"
    assert (s.running, s.waiting, s.kv_use) == (3, 7, 0.42)
    assert (s.latency_sum_s, s.latency_count, s.successes) == (120.0, 40, 40)
    assert (s.token_latency_sum_s, s.token_latency_count) == (8.0, 400)
    assert s.failures is None and s.latency_buckets == ()
    assert out.sample_times == {("chat", A): SCRAPED}
    assert (out.series_matched, out.series_unmatched, out.without_series) == (9, 0, [])


def test_the_age_uses_prometheus_clock_not_ours() -> None:
    """A Prometheus whose clock is an hour off still gives fresh samples a small age."""
    skewed = page(A, scraped=SCRAPED - 3600, running=1)
    skewed[SAMPLE_TIME] = [item(A, SCRAPED - 3600, at=EVAL - 3600)]
    assert conv(skewed, [("chat", A)]).results[("chat", A)].age_s == pytest.approx(1.5)


def test_a_family_without_a_series_leaves_its_field_unknown() -> None:
    out = conv(page(A, running=2, waiting=0), [("chat", A)])
    s = out.results[("chat", A)].sample
    assert s is not None
    assert (s.running, s.waiting, s.kv_use, s.latency_count, s.token_latency_count) == (
        2,
        0,
        None,
        None,
        None,
    )


def test_an_endpoint_without_any_series_gets_an_error_and_no_sample() -> None:
    out = conv(page(A, running=1), [("chat", A), ("chat", B)])
    assert out.without_series == [("chat", B)]
    missing = out.results[("chat", B)]
    assert missing.sample is None and missing.health_error is None and missing.health_status is None
    assert missing.metrics_error is not None and "instance='127.0.0.2:8000'" in missing.metrics_error
    assert missing.error_reason == "no_series"


def test_series_of_addresses_outside_the_fleet_are_counted_and_ignored() -> None:
    out = conv(merge(page(A, running=1), page(C, running=9)), [("chat", A)])
    assert set(out.results) == {("chat", A)}
    assert (out.series_matched, out.series_unmatched) == (2, 2)
    nolabel = {"running": [item(None, 4)], SAMPLE_TIME: []}
    assert conv(nolabel, [("chat", A)]).series_unmatched == 1


def test_series_of_another_model_on_the_same_server_do_not_count() -> None:
    both = merge(page(A, running=2, waiting=1), page(A, model="other", running=5, waiting=9))
    s = conv(both, [("chat", A)]).results[("chat", A)].sample
    assert s is not None and (s.running, s.waiting) == (2, 1)
    # Two models sharing one server each get their own.
    out = conv(both, [("chat", A), ("other", A)])
    other = out.results[("other", A)].sample
    assert other is not None and (other.running, other.waiting) == (5, 9)


def test_unlabelled_series_count_for_the_model_and_several_series_are_summed() -> None:
    mixed = merge(page(A, running=2, successes=10), page(A, model=None, running=1, successes=5))
    s = conv(mixed, [("chat", A)]).results[("chat", A)].sample
    assert s is not None and (s.running, s.successes) == (3, 15)
    # A server may label its gauges and not its counters: those count too.
    partly = page(A, running=2)
    partly["successes"] = [item(A, 7, model=None)]
    s = conv(partly, [("chat", A)]).results[("chat", A)].sample
    assert s is not None and (s.running, s.successes) == (2, 7)
    # Only unlabelled series: they are the server's.
    s = conv(page(A, model=None, running=4), [("chat", A)]).results[("chat", A)].sample
    assert s is not None and s.running == 4


def test_a_server_labelling_one_other_model_serves_just_that_one() -> None:
    """vLLM's served model name is often the Hugging Face id, the fleet's a short name."""
    hf = page(A, model="meta-llama/Llama-3.1-8B-Instruct", running=4)
    s = conv(hf, [("chat", A)]).results[("chat", A)].sample
    assert s is not None and s.running == 4


def test_a_server_labelling_several_other_models_is_not_guessed() -> None:
    two = merge(page(A, model="x", running=4), page(A, model="y", running=1))
    r = conv(two, [("chat", A)]).results[("chat", A)]
    assert r.sample is None
    assert r.metrics_error is not None and "labels models x, y, none of them 'chat'" in r.metrics_error
    assert r.error_reason == "unreadable"


def test_a_sample_no_newer_than_the_one_delivered_is_not_delivered_again() -> None:
    answers = page(A, running=1)
    assert conv(answers, [("chat", A)], delivered={("chat", A): SCRAPED}).results == {}
    assert conv(answers, [("chat", A)], delivered={("chat", A): SCRAPED + 1}).results == {}
    newer = conv(answers, [("chat", A)], delivered={("chat", A): SCRAPED - 1})
    assert set(newer.results) == {("chat", A)}


def test_without_a_gauge_the_sample_time_is_unknown_and_nothing_is_delivered() -> None:
    answers = page(A, successes=10)
    answers[SAMPLE_TIME] = []
    r = conv(answers, [("chat", A)]).results[("chat", A)]
    assert r.sample is None and r.metrics_error is not None and "sample time unknown" in r.metrics_error
    assert r.error_reason == "no_series"


def test_a_value_that_is_not_finite_makes_the_endpoint_unreadable() -> None:
    answers = page(A, running=1)
    answers["waiting"] = [item(A, "NaN")]
    r = conv(answers, [("chat", A)]).results[("chat", A)]
    assert r.sample is None and r.metrics_error is not None and "not a finite number" in r.metrics_error
    assert r.error_reason == "unreadable"
    answers["waiting"] = [item(A, "+Inf")]
    assert conv(answers, [("chat", A)]).results[("chat", A)].sample is None


def test_kv_use_in_percent_is_scaled_to_a_fraction() -> None:
    s = conv(page(A, kv_use=85.0), [("chat", A)]).results[("chat", A)].sample
    assert s is not None and s.kv_use == pytest.approx(0.85)


def test_the_latency_histogram_is_summed_per_bucket_and_sorted() -> None:
    answers = page(A, running=1)
    answers[BUCKETS] = [
        item(A, 9, le="+Inf"),
        item(A, 2, le="0.5"),
        item(A, 7, le="1.0"),
        item(A, 1, model=None, le="0.5"),
        item(A, 4, model="other", le="0.5"),  # another model's
    ]
    out = conv(answers, [("chat", A)])
    s = out.results[("chat", A)].sample
    assert s is not None and s.latency_buckets == ((0.5, 3.0), (1.0, 7.0), (math.inf, 9.0))
    assert (out.series_matched, out.series_unmatched) == (2 + 4, 1)  # the other model's bucket


def test_histograms_under_another_address_label_and_with_other_labels_are_read() -> None:
    def series(value: float, **labels: str) -> Any:
        return {"metric": labels, "value": [EVAL, str(value)]}

    # pod_address sorts after model_name: Prometheus writes le, model_name, pod_address.
    answers = {
        "running": [series(1, pod_address=A, model_name="chat"), series(1, pod_address=B, model_name="chat")],
        SAMPLE_TIME: [series(SCRAPED, pod_address=A, model_name="chat"), series(SCRAPED, pod_address=B)],
        BUCKETS: [
            series(5, pod_address=A, model_name="chat", le="1.0"),
            series(2, pod_address=A, model_name="chat", le="0.5", zone="z1"),  # another label: still read
            series(6, pod_address=B, le="+Inf"),
        ],
    }
    out = conv(answers, [("chat", A), ("chat", B)], address_label="pod_address")
    a, b = out.results[("chat", A)].sample, out.results[("chat", B)].sample
    assert a is not None and a.latency_buckets == ((0.5, 2.0), (1.0, 5.0))
    assert b is not None and b.latency_buckets == ((math.inf, 6.0),)


def test_a_bucket_count_that_is_not_finite_spoils_only_its_endpoint() -> None:
    answers = merge(page(A, running=1), page(B, running=2))
    answers[BUCKETS] = [item(A, "NaN", le="1.0"), item(B, 3, le="1.0")]
    out = conv(answers, [("chat", A), ("chat", B)])
    assert out.results[("chat", A)].sample is None
    assert "not a finite number" in (out.results[("chat", A)].metrics_error or "")
    b = out.results[("chat", B)].sample
    assert b is not None and b.latency_buckets == ((1.0, 3.0),)


def test_a_value_that_is_not_a_number_fails_the_round() -> None:
    answers = page(A, running=1)
    answers["waiting"] = [item(A, "many")]
    with pytest.raises(PrometheusQueryFailed) as e:
        conv(answers, [("chat", A)])
    assert e.value.outcome == "invalid"


def test_the_sample_and_result_field_order_the_source_builds_positionally() -> None:
    """convert() builds ServerSample and ScrapeResult positionally (half the CPU of keywords
    at 5,000 endpoints a round): moving their fields must be seen here, not as wrong loads."""
    assert [f.name for f in dataclasses.fields(ServerSample)][:11] == [
        "dialect",
        "running",
        "waiting",
        "kv_use",
        "latency_sum_s",
        "latency_count",
        "successes",
        "failures",
        "token_latency_sum_s",
        "token_latency_count",
        "latency_buckets",
    ]
    assert [f.name for f in dataclasses.fields(ScrapeResult)][:6] == [
        "health_status",
        "health_error",
        "metrics_text",
        "metrics_error",
        "sample",
        "age_s",
    ]


def test_converted_samples_feed_the_store_like_scraped_pages() -> None:
    """Two rounds a second apart: the mean latency of what completed in between, and the
    sample's age from Prometheus's timestamps."""
    store = SignalStore()
    key = ("chat", A)
    first = conv(page(A, scraped=SCRAPED, **FULL), [key])
    store.record_scrape(key, first.results[key], now=100.0)
    later = {**FULL, "latency_sum_s": 150.0, "latency_count": 50, "successes": 50}
    answers = page(A, scraped=SCRAPED + 1, **later)
    answers = {
        n: [{**s, "value": [EVAL + 1, s["value"][1]]} for s in series] for n, series in answers.items()
    }
    second = conv(answers, [key], delivered=first.sample_times)
    store.record_scrape(key, second.results[key], now=101.0)
    load = store.load(key, 1.0, now=101.0)
    assert load.latency_s == pytest.approx(3.0)  # 30 s over 10 requests
    assert load.age_s == pytest.approx(1.5)
    assert (load.running, load.waiting, load.ready) == (3, 7, True)


# ---- the shell, against a loopback server answering as Prometheus ---------------------------


@dataclass
class FakePrometheus:
    """Answers /api/v1/query from `answers` ({query name: result}), or fails as told."""

    answers: dict[str, list[Any]]
    mode: str = "ok"  # ok, status_error, http_500, malformed, slow
    asked: list[str] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # promql -> query name
    failing: set[str] = field(default_factory=set)  # query names answered 503

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = request.query.get("query") or (await request.post()).get("query")
        assert isinstance(query, str)
        name = self.names.get(query, "?")
        self.asked.append(name)
        if name in self.failing:
            return web.Response(status=503, text="overloaded")
        if self.mode == "status_error":
            body = {"status": "error", "errorType": "bad_data", "error": "1:1: parse error"}
            return web.json_response(body, status=400)
        if self.mode == "http_500":
            return web.Response(status=500, text="internal error")
        if self.mode == "malformed":
            return web.Response(text='{"status": "success", "data": {', content_type="application/json")
        if self.mode == "slow":
            await asyncio.sleep(3)
        result = self.answers.get(name, [])
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})


def prometheus_fleet(url: str, models: dict[str, dict[str, list[str]]] | None = None) -> Fleet:
    text = fleet_yaml(models or {"chat": {"v1": [A, B]}}) + (
        f"signals: {{source: prometheus, prometheus: {{url: '{url}', interval: 2s, timeout: 1s}}}}\n"
    )
    return parse_fleet(text)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Scenario = Callable[[FakePrometheus, PrometheusSource, Fleet, Clock, Metrics], Awaitable[None]]


def run_against_fake(answers: dict[str, list[Any]], scenario: Scenario, mode: str = "ok") -> FakePrometheus:
    fake = FakePrometheus(answers, mode)

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/api/v1/query", fake.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        fleet = prometheus_fleet(f"http://127.0.0.1:{port}")
        assert fleet.signals.prometheus is not None
        fake.names = {q.promql: q.name for q in build_queries("instance", analysed_addresses(fleet))}
        clock, metrics = Clock(), Metrics()
        source = PrometheusSource(fleet, metrics, clock=clock)
        try:
            await scenario(fake, source, fleet, clock, metrics)
        finally:
            await source.close()
            await runner.cleanup()

    asyncio.run(main())
    return fake


TARGETS = [("chat", A), ("chat", B)]


def queries(metrics: Metrics, outcome: str) -> float:
    return sum(
        s.value
        for m in metrics.registry.collect()
        if m.name == "controlplane_signals_prometheus_queries"
        for s in m.samples
        if s.name.endswith("_total") and s.labels["outcome"] == outcome
    )


def gauge(metrics: Metrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


def test_a_round_queries_every_family_once_and_delivers_samples() -> None:
    async def scenario(
        fake: FakePrometheus, src: PrometheusSource, fleet: Fleet, clock: Clock, m: Metrics
    ) -> None:
        got = await src.collect(fleet, TARGETS, first=True)
        assert sorted(fake.asked) == sorted(ASKED)
        assert set(got) == set(TARGETS)
        a = got[("chat", A)].sample
        assert a is not None and (a.running, a.waiting) == (3, 7)
        assert got[("chat", B)].sample is None and got[("chat", B)].metrics_error is not None
        assert queries(m, "success") == len(fake.asked)
        assert gauge(m, "controlplane_signals_prometheus_series_matched") == len(ASKED)
        assert gauge(m, "controlplane_signals_prometheus_series_unmatched") == len(ASKED)  # C's
        assert gauge(m, "controlplane_signals_prometheus_endpoints_without_series") == 1
        assert m.registry.get_sample_value("controlplane_signals_prometheus_query_seconds_count") == len(
            ASKED
        )

    run_against_fake(merge(page(A, **FULL), page(C, **FULL)), scenario)


def test_weight_rounds_between_intervals_get_nothing_and_ask_nothing() -> None:
    async def scenario(
        fake: FakePrometheus, src: PrometheusSource, fleet: Fleet, clock: Clock, m: Metrics
    ) -> None:
        assert set(await src.collect(fleet, TARGETS)) == set(TARGETS)
        asked = len(fake.asked)
        clock.now += 1.0  # one weight round later: within the 2 s interval
        assert await src.collect(fleet, TARGETS) == {}
        assert len(fake.asked) == asked
        clock.now += 1.0  # due again; Prometheus has not scraped since, so nothing is new...
        got = await src.collect(fleet, TARGETS)
        assert len(fake.asked) == 2 * asked
        assert ("chat", A) not in got  # ...for A; B still has no series, and says so again
        assert got[("chat", B)].metrics_error is not None
        fake.answers = merge(page(A, scraped=SCRAPED + 2, **FULL), page(B, scraped=SCRAPED + 2, running=1))
        clock.now += 1.9  # rounds land a little early or late: still due
        got = await src.collect(fleet, TARGETS)
        assert set(got) == set(TARGETS) and all(r.sample is not None for r in got.values())
        assert src.rounds == 3

    run_against_fake(page(A, **FULL), scenario)


@pytest.mark.parametrize(
    ("mode", "outcome"),
    [("status_error", "error"), ("http_500", "http_error"), ("malformed", "invalid"), ("slow", "timeout")],
)
def test_a_failing_prometheus_gives_nothing_new_and_counts_the_error(mode: str, outcome: str) -> None:
    async def scenario(
        fake: FakePrometheus, src: PrometheusSource, fleet: Fleet, clock: Clock, m: Metrics
    ) -> None:
        assert await src.collect(fleet, TARGETS, first=True) == {}
        assert queries(m, outcome) == len(ASKED)
        assert queries(m, "success") == 0
        assert src.failed_rounds == 1
        assert src.failing  # the weight loop counts its signals round as an error
        fake.mode = "ok"  # it recovers: the next interval delivers
        clock.now += 2
        assert set(await src.collect(fleet, TARGETS)) == set(TARGETS)
        assert src.failed_rounds == 1
        assert src.failing is None

    run_against_fake(page(A, **FULL), scenario, mode)


def test_one_failed_query_voids_the_whole_round() -> None:
    """A round missing one family would deliver samples with that field unknown: none is
    delivered, so nothing jumps."""

    async def scenario(
        fake: FakePrometheus, src: PrometheusSource, fleet: Fleet, clock: Clock, m: Metrics
    ) -> None:
        fake.failing = {"waiting"}
        assert await src.collect(fleet, TARGETS) == {}
        assert queries(m, "http_error") == 1 and queries(m, "success") == len(ASKED) - 1

    run_against_fake(page(A, **FULL), scenario)


def test_a_refused_connection_gives_nothing_and_counts_unreachable() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused

        async def main() -> None:
            fleet = prometheus_fleet(f"http://127.0.0.1:{port}")
            metrics = Metrics()
            src = PrometheusSource(fleet, metrics)
            try:
                assert await src.collect(fleet, TARGETS, first=True) == {}
                assert queries(metrics, "unreachable") == len(ASKED)
            finally:
                await src.close()

        asyncio.run(main())


def test_an_unexpected_error_inside_a_round_never_leaves_collect(monkeypatch: pytest.MonkeyPatch) -> None:
    import controlplane.signals.prometheus as prom

    def boom(*args: object, **kwargs: object) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(prom, "convert", boom)

    async def scenario(
        fake: FakePrometheus, src: PrometheusSource, fleet: Fleet, clock: Clock, m: Metrics
    ) -> None:
        assert await src.collect(fleet, TARGETS) == {}
        assert src.failed_rounds == 1

    run_against_fake(page(A, **FULL), scenario)


def test_the_histogram_query_is_long_enough_to_go_by_post() -> None:
    many = [f"10.1.{i // 250}.{i % 250}:8000" for i in range(400)]

    async def main() -> None:
        fake = FakePrometheus({})
        app = web.Application()
        app.router.add_route("*", "/api/v1/query", fake.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        fleet = prometheus_fleet(f"http://127.0.0.1:{port}", {"chat": {"v1": many[:200], "v2": many[200:]}})
        fake.names = {q.promql: q.name for q in build_queries("instance", analysed_addresses(fleet))}
        metrics = Metrics()
        src = PrometheusSource(fleet, metrics)
        try:
            await src.collect(fleet, [("chat", a) for a in many])
            assert BUCKETS in fake.asked  # the server recognised the long query from the POST body
            assert queries(metrics, "success") == len(ASKED) + 2
        finally:
            await src.close()
            await runner.cleanup()

    asyncio.run(main())


def test_make_source_picks_prometheus_and_it_matches_only_its_own_settings() -> None:
    fleet = prometheus_fleet("http://127.0.0.1:9")
    src = make_source(fleet, Metrics())
    assert isinstance(src, PrometheusSource)
    assert src.matches(fleet)
    moved = prometheus_fleet("http://127.0.0.1:10")
    assert not src.matches(moved)
    assert not src.matches(parse_fleet(fleet_yaml({"chat": {"v1": [A]}})))
