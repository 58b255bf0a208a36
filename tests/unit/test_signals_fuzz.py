"""Property-based fuzzing of the metrics reader and of the store behind it (issue 16): any
page gives a sample or a precise MetricsPageInvalid, never another exception; whatever
pages arrive, the load the policies see stays finite and within range."""

from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.balancing.policies import POLICIES, PolicyConfig
from controlplane.signals.parse import MetricsPageInvalid, ServerSample, derive, parse_metrics
from controlplane.signals.store import ScrapeResult, SignalStore

N = int(os.environ.get("FUZZ_EXAMPLES", "300"))
NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total",
    "vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_count",
    "sglang:num_running_reqs", "tgi_queue_size", "tgi_request_failure", "nv_inference_request_success",
    "nv_inference_request_duration_us", "nv_inference_pending_request_count", "other_metric",
    "vllm:lora_requests_info",
]  # fmt: skip
LABELS = [
    '{model_name="m"}',
    '{model_name="x"}',
    '{le="0.5"}',
    '{le="+Inf",model_name="m"}',
    "",
    '{le="x"}',
    "{",
    '{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""}',
    '{max_lora="x",running_lora_adapters=",,",waiting_lora_adapters="a\\nb"}',
]
VALUES = ["0", "1", "3.5", "-1", "NaN", "+Inf", "1e300", "1e6", "abc", "", "1 1700000000000"]
OTHER_LINES = ["# TYPE vllm:num_requests_running gauge", "# HELP x y", "#", "", "garbage line", "\x00"]
sample_line = st.builds(
    lambda n, lab, v: f"{n}{lab} {v}",
    st.sampled_from(NAMES),
    st.sampled_from(LABELS),
    st.sampled_from(VALUES),
)
line = st.one_of(sample_line, st.sampled_from(OTHER_LINES))
pages = st.lists(line, max_size=30).map("\n".join)


@settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pages, st.sampled_from(["m", "x", None]))
def test_any_page_gets_a_sample_or_a_precise_refusal(page: str, model: str | None) -> None:
    try:
        sample = parse_metrics(page, model)
    except MetricsPageInvalid as e:
        assert str(e)
        return
    for v in (sample.running, sample.waiting, sample.kv_use, sample.latency_sum_s, sample.successes):
        assert v is None or (math.isfinite(v) and v >= 0)
    # The LoRA adapters: known all together or not at all, within their bounds.
    if sample.max_lora is None:
        assert sample.lora_running is None and sample.lora_waiting is None
    else:
        assert 0 <= sample.max_lora <= 1024 and sample.lora_running is not None
        assert sample.lora_waiting is not None and len(sample.lora_running) <= 64


@settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(pages, min_size=1, max_size=6))
def test_whatever_pages_arrive_the_policies_see_a_sane_load(sequence: list[str]) -> None:
    store = SignalStore()
    key = ("m", "127.0.0.1:8000")
    peer = ("m", "127.0.0.2:8000")
    honest = ServerSample("vllm", running=2, waiting=0, latency_sum_s=1.0, latency_count=10, successes=10)
    for t, page in enumerate(sequence):
        store.record_scrape(key, ScrapeResult(200, metrics_text=page), float(t))
        store.record_scrape(peer, ScrapeResult(200, sample=honest), float(t))
    loads = [store.load(k, 1.0, float(len(sequence))) for k in (key, peer)]
    for load in loads:
        for v in (load.running, load.waiting, load.kv_use, load.error_rate, load.latency_s):
            assert v is None or (math.isfinite(v) and v >= 0)  # None: never read
    for name, policy in POLICIES.items():
        weights = policy(loads, PolicyConfig())
        assert weights["127.0.0.2:8000"] > 0, name  # the honest peer is never held out by a liar


@settings(max_examples=N, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.floats(0, 1e9)), min_size=4, max_size=4),
    st.lists(st.one_of(st.none(), st.floats(0, 1e9)), min_size=4, max_size=4),
)
def test_derive_never_gives_a_negative_or_non_finite_rate(
    a: list[float | None], b: list[float | None]
) -> None:
    def sample(v: list[float | None]) -> ServerSample:
        return ServerSample("vllm", latency_sum_s=v[0], latency_count=v[1], successes=v[2],
                            token_latency_sum_s=v[3], token_latency_count=v[1])  # fmt: skip

    d = derive(sample(a), sample(b))
    for v in (d.mean_latency_s, d.mean_token_latency_s, d.error_rate):
        assert v is None or (math.isfinite(v) and v >= 0)
