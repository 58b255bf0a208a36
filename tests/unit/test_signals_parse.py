from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from controlplane.signals import parse
from controlplane.signals.parse import (
    MetricsPageInvalid,
    ServerHistogram,
    ServerSample,
    derive,
    parse_metrics,
)

# Metric names and types as vLLM documents them (production metrics, with model_name).
VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama-3-8b"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama-3-8b"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="llama-3-8b"} 0.42
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",model_name="llama-3-8b"} 90.0
vllm:request_success_total{finished_reason="length",model_name="llama-3-8b"} 10.0
# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="llama-3-8b"} 60.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="llama-3-8b"} 100.0
vllm:e2e_request_latency_seconds_count{model_name="llama-3-8b"} 100.0
vllm:e2e_request_latency_seconds_sum{model_name="llama-3-8b"} 150.0
"""


def test_vllm_page_parses_into_the_right_load() -> None:
    s = parse_metrics(VLLM, "llama-3-8b")
    assert s == ServerSample(
        dialect="vllm",
        running=3.0,
        waiting=7.0,
        kv_use=0.42,
        latency_sum_s=150.0,
        latency_count=100.0,
        successes=100.0,
        latency_buckets=((1.0, 60.0), (float("inf"), 100.0)),
    )


def test_older_vllm_gpu_cache_name_is_understood() -> None:
    page = VLLM.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_metrics(page).kv_use == 0.42


def test_other_models_on_the_same_page_are_ignored() -> None:
    page = VLLM + 'vllm:num_requests_running{model_name="other"} 50.0\n'
    assert parse_metrics(page, "llama-3-8b").running == 3.0
    assert parse_metrics(page).running == 53.0


@pytest.mark.parametrize(
    "page",
    ["", "garbage here {{{", "<html>502 Bad Gateway</html>", "process_cpu_seconds_total 12.0\n"],
)
def test_garbage_pages_are_rejected_with_a_reason(page: str) -> None:
    with pytest.raises(MetricsPageInvalid) as e:
        parse_metrics(page)
    assert str(e.value)


def test_non_finite_values_are_rejected() -> None:
    with pytest.raises(MetricsPageInvalid, match="not a finite number"):
        parse_metrics(VLLM.replace("} 7.0", "} NaN"))


def test_sglang_tgi_and_triton_dialects() -> None:
    sglang = (
        'sglang:num_running_reqs{model_name="m"} 2\n'
        'sglang:num_queue_reqs{model_name="m"} 5\n'
        'sglang:token_usage{model_name="m"} 0.5\n'
    )
    assert parse_metrics(sglang) == ServerSample(dialect="sglang", running=2, waiting=5, kv_use=0.5)
    tgi = (
        "# TYPE tgi_queue_size gauge\ntgi_queue_size 4\n# TYPE tgi_batch_current_size gauge\n"
        "tgi_batch_current_size 8\n# TYPE tgi_request_success counter\ntgi_request_success 30\n"
        "# TYPE tgi_request_failure counter\ntgi_request_failure 3\n"
    )
    t = parse_metrics(tgi)
    assert (t.dialect, t.running, t.waiting, t.successes, t.failures) == ("tgi", 8, 4, 30, 3)
    triton = (
        'nv_inference_pending_request_count{model="m",version="1"} 6\n'
        'nv_inference_request_success{model="m",version="1"} 200\n'
        'nv_inference_request_failure{model="m",version="1"} 2\n'
        'nv_inference_request_duration_us{model="m",version="1"} 4000000\n'
        'nv_inference_queue_duration_us{model="m",version="1"} 10\n'
    )
    tr = parse_metrics(triton, "m")
    assert (tr.dialect, tr.waiting, tr.successes, tr.failures) == ("triton", 6, 200, 2)
    assert tr.latency_sum_s == pytest.approx(4.0) and tr.latency_count == 200


# vLLM 0.32 prints request_success_total for every FinishReason (stop, length, abort, error,
# repetition) of every engine, zeros included.
def _finished(stop: float, length: float, abort: float, error: float, repetition: float = 0.0) -> str:
    reasons = {"stop": stop, "length": length, "abort": abort, "error": error, "repetition": repetition}
    return "# TYPE vllm:request_success_total counter\n" + "".join(
        f'vllm:request_success_total{{model_name="m",engine="0",finished_reason="{r}"}} {n}\n'
        for r, n in reasons.items()
    )


def test_vllm_successes_exclude_aborted_and_failed_requests() -> None:
    """Issue 32: an aborted request (its client left) is no success, an error one a failure."""
    s = parse_metrics(_finished(stop=90, length=10, abort=7, error=3, repetition=2), "m")
    assert (s.successes, s.failures) == (102.0, 3.0)
    later = parse_metrics(_finished(stop=130, length=10, abort=50, error=13, repetition=2), "m")
    d = derive(s, later)
    assert d.completed == 50.0  # 40 completions and 10 failures; the 43 aborts are neither
    assert d.error_rate == pytest.approx(10 / 50)


def test_a_vllm_page_of_aborts_only_completes_nothing() -> None:
    s = parse_metrics(_finished(stop=0, length=0, abort=0, error=0), "m")
    later = parse_metrics(_finished(stop=0, length=0, abort=25, error=0), "m")
    d = derive(s, later)
    assert (d.completed, d.error_rate) == (0.0, None)


def test_an_older_vllm_without_the_error_reason_has_no_failures_figure() -> None:
    page = (
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 4\n'
        'vllm:request_success_total{finished_reason="abort",model_name="m"} 9\n'
    )
    assert (parse_metrics(page).successes, parse_metrics(page).failures) == (4.0, None)


# A data-parallel vLLM (--data-parallel-size 2): one series per engine, for every family.
DATA_PARALLEL = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 4.0
vllm:num_requests_running{model_name="m",engine="1"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m",engine="0"} 2.0
vllm:num_requests_waiting{model_name="m",engine="1"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.7
vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.6
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{model_name="m",engine="0",le="1.0"} 6.0
vllm:e2e_request_latency_seconds_bucket{model_name="m",engine="0",le="+Inf"} 10.0
vllm:e2e_request_latency_seconds_count{model_name="m",engine="0"} 10.0
vllm:e2e_request_latency_seconds_sum{model_name="m",engine="0"} 12.0
vllm:e2e_request_latency_seconds_bucket{model_name="m",engine="1",le="1.0"} 1.0
vllm:e2e_request_latency_seconds_bucket{model_name="m",engine="1",le="+Inf"} 5.0
vllm:e2e_request_latency_seconds_count{model_name="m",engine="1"} 5.0
vllm:e2e_request_latency_seconds_sum{model_name="m",engine="1"} 8.0
"""


def test_a_data_parallel_vllm_sums_its_engines_and_averages_their_kv_use() -> None:
    """Issue 32 (GIE #2950): every engine's series counts, none is sampled; KV use is each
    engine's share of its own pool, so the server's is their mean, not their sum."""
    s = parse_metrics(DATA_PARALLEL, "m")
    assert (s.running, s.waiting) == (7.0, 7.0)
    assert s.kv_use == pytest.approx(0.65)
    assert (s.latency_count, s.latency_sum_s) == (15.0, 20.0)
    assert s.latency_buckets == ((1.0, 7.0), (float("inf"), 15.0))
    assert parse_metrics(DATA_PARALLEL.replace("kv_cache_usage", "gpu_cache_usage"), "m").kv_use == (
        pytest.approx(0.65)
    )


def test_an_engine_at_full_kv_is_not_read_as_a_percentage() -> None:
    page = DATA_PARALLEL.replace("} 0.7", "} 1.0").replace("} 0.6", "} 0.9")
    assert parse_metrics(page, "m").kv_use == pytest.approx(0.95)


def test_derive_gives_interval_latency_and_error_rate() -> None:
    a = ServerSample("tgi", latency_sum_s=10.0, latency_count=10, successes=10, failures=0)
    b = ServerSample("tgi", latency_sum_s=40.0, latency_count=20, successes=18, failures=2)
    d = derive(a, b)
    assert d.mean_latency_s == pytest.approx(3.0)
    assert d.error_rate == pytest.approx(0.2)
    assert d.completed == 10
    assert derive(None, b).mean_latency_s is None


def test_derive_survives_a_counter_reset() -> None:
    a = ServerSample("vllm", latency_sum_s=100.0, latency_count=50, successes=50)
    b = ServerSample("vllm", latency_sum_s=4.0, latency_count=2, successes=2)  # server restarted
    d = derive(a, b)
    assert d.mean_latency_s == pytest.approx(2.0)
    assert d.completed == 2


@given(
    running=st.integers(0, 10_000),
    waiting=st.integers(0, 10_000),
    kv=st.floats(0, 1, allow_nan=False),
    count=st.integers(0, 10**9),
)
def test_rendered_vllm_values_round_trip(running: int, waiting: int, kv: float, count: int) -> None:
    page = (
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv!r}\n'
        f'vllm:e2e_request_latency_seconds_count{{model_name="m"}} {count}\n'
    )
    s = parse_metrics(page, "m")
    assert (s.running, s.waiting, s.kv_use, s.latency_count) == (running, waiting, kv, count)


def test_a_page_serving_one_model_under_another_name_is_that_servers_model() -> None:
    page = VLLM.replace('model_name="llama-3-8b"', 'model_name="meta-llama/Meta-Llama-3-8B-Instruct"')
    s = parse_metrics(page, "llama-3-8b")
    assert (s.running, s.waiting) == (3.0, 7.0)


def test_a_page_of_several_other_models_names_them() -> None:
    page = VLLM + VLLM.replace('"llama-3-8b"', '"qwen"').replace("# HELP", "# XHELP").replace(
        "# TYPE", "# XTYPE"
    )
    with pytest.raises(
        MetricsPageInvalid, match="the page labels models llama-3-8b, qwen, none of them 'mistral'"
    ):
        parse_metrics(page, "mistral")


TPOT = """\
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="llama-3-8b"} 400.0
vllm:time_per_output_token_seconds_count{model_name="llama-3-8b"} 400.0
vllm:time_per_output_token_seconds_sum{model_name="llama-3-8b"} 8.0
"""


def test_time_per_output_token_is_read_and_derived() -> None:
    first = parse_metrics(VLLM + TPOT, "llama-3-8b")
    assert (first.token_latency_sum_s, first.token_latency_count) == (8.0, 400.0)
    later = parse_metrics(VLLM + TPOT.replace("400.0", "500.0").replace("} 8.0", "} 11.0"), "llama-3-8b")
    assert derive(first, later).mean_token_latency_s == pytest.approx(0.03)


def test_the_renamed_per_token_histogram_is_used_alone_not_blended() -> None:
    renamed = TPOT.replace("vllm:time_per", "vllm:request_time_per")
    assert parse_metrics(VLLM + renamed).token_latency_count == 400.0
    both = VLLM + TPOT + renamed.replace("400.0", "7.0")
    assert parse_metrics(both).token_latency_count == 400.0


def test_vllm_0_11s_inter_token_histogram_is_the_per_token_latency_before_the_per_request_mean() -> None:
    """vLLM 0.32 has no time_per_output_token histogram: inter_token_latency (one observation
    per gap) is its per-token latency; request_time_per_output_token (one mean per request)
    only stands in where neither is on the page."""
    itl = TPOT.replace("vllm:time_per_output_token", "vllm:inter_token_latency")
    per_request = TPOT.replace("vllm:time_per", "vllm:request_time_per").replace("400.0", "7.0")
    s = parse_metrics(VLLM + per_request + itl)
    assert (s.token_latency_sum_s, s.token_latency_count) == (8.0, 400.0)
    assert parse_metrics(VLLM + per_request).token_latency_count == 7.0
    assert parse_metrics(VLLM + TPOT + itl.replace("400.0", "9.0")).token_latency_count == 400.0


def test_a_bucket_without_le_is_refused() -> None:
    page = VLLM.replace('le="1.0",', "")
    with pytest.raises(MetricsPageInvalid, match="numeric 'le'"):
        parse_metrics(page, "llama-3-8b")


# ---- the selective parse reads what prometheus_client reads ---------------------------------

_NAMES = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:e2e_request_latency_seconds_sum",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_success_total",
        "vllm:time_per_output_token_seconds_sum",
        "vllm:time_per_output_token_seconds_count",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:lora_requests_info",
        "vllm:iteration_tokens_total_bucket",  # a family not read
    ]
)
_VALUE = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=32).map(repr),
    st.integers(-5, 10**9).map(str),
    st.sampled_from(["1e3", "0.5", "+Inf", "-Inf", "NaN", "1E-2", "1_0", "nan", "Infinity", "0x10", "1 2 3"]),
)
_LABEL_VALUE = st.one_of(
    st.sampled_from(["m", "other", "0.5", "+Inf", "a,b", "x}y", "p=q", " sp "]),
    st.text(alphabet='ab "\\\n,=}{', max_size=6).map(
        lambda s: s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    ),
)


@st.composite
def _lines(draw: st.DrawFn) -> str:
    name = draw(_NAMES)
    labels = draw(
        st.dictionaries(
            st.sampled_from(["model_name", "le", "engine", "x", "__name__", "9bad"]), _LABEL_VALUE, max_size=3
        )
    )
    if name.endswith("_bucket"):
        labels["le"] = draw(st.sampled_from(["0.1", "1.0", "+Inf", "2.5e1"]))
    if name == "vllm:lora_requests_info":  # mostly whole label sets, some broken
        adapters = st.one_of(st.sampled_from(["", "a", "a,b", " b , ,a,b", "x" * 257]), _LABEL_VALUE)
        for key, values in (
            ("max_lora", st.sampled_from(["2", "0", "1024", "1025", "2.0", "-1", "", "x"])),
            ("running_lora_adapters", adapters),
            ("waiting_lora_adapters", adapters),
        ):
            if draw(st.integers(0, 9)):
                labels[key] = draw(values)
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    sep = draw(st.sampled_from([" ", "  ", "\t"]))
    ts = draw(st.sampled_from(["", " 1700000000000", ' # {a="b"} 1', "\t5", " -3"]))
    return f"{name}{{{body}}}{sep}{draw(_VALUE)}{ts}" if labels else f"{name}{sep}{draw(_VALUE)}{ts}"


@settings(max_examples=1000, deadline=None)
@given(lines=st.lists(_lines(), min_size=1, max_size=12), model=st.sampled_from([None, "m", "other"]))
@example(  # a page with none of the read families is parsed whole, an unread line's fault named
    lines=["vllm:lora_requests_info 0.0", 'vllm:iteration_tokens_total_bucket{__name__="m",le="0.1"} 0.0'],
    model=None,
)
def test_the_selective_parse_agrees_with_prometheus_client(lines: list[str], model: str | None) -> None:
    page = "\n".join(lines) + "\n"
    # Lines of families that are not read never matter (even malformed ones).
    read = "\n".join(x for x in lines if not x.startswith("vllm:iteration_tokens")) + "\n"

    def outcome(text: str, select: bool) -> object:
        try:
            return parse_metrics(text, model, select=select)
        except MetricsPageInvalid as e:
            return ("invalid", str(e).split(":")[0])

    ours, theirs = outcome(page, True), outcome(read, False)
    if read.strip():
        again = outcome(read, True)
        # Unread lines never change what is read. A page with none of the load metrics is
        # parsed whole, for the precise reason, which may then be an unread line's: both refuse.
        refused = isinstance(ours, tuple) and isinstance(again, tuple)
        assert ours == again or ours != ours or refused
    if isinstance(ours, tuple) and isinstance(theirs, tuple):
        return  # both refuse it (the wording may differ by which line they stopped at)
    if ours != theirs and isinstance(ours, ServerSample) and isinstance(theirs, ServerSample):
        # NaN never equals itself: compare field by field treating NaN as equal.
        for f in ours.__dataclass_fields__:
            a, b = getattr(ours, f), getattr(theirs, f)
            assert a == b or (a != a and b != b), (f, a, b)
        return
    assert ours == theirs


def test_a_full_vllm_page_reads_the_same_both_ways() -> None:
    from controlplane.sim.emulator_metrics import sample_full_page

    page = sample_full_page("m", seed=3)
    assert parse_metrics(page, "m") == parse_metrics(page, "m", select=False)


def test_a_negative_value_makes_the_page_unreadable() -> None:
    """Issue 16, F5: a negative latency would win every comparison and hold out honest peers."""
    page = (
        'vllm:num_requests_running{model_name="m"} 1\n'
        'vllm:e2e_request_latency_seconds_sum{model_name="m"} -5\n'
        'vllm:e2e_request_latency_seconds_count{model_name="m"} 3\n'
    )
    with pytest.raises(
        MetricsPageInvalid, match="vllm:e2e_request_latency_seconds_sum: value -5 is negative"
    ):
        parse_metrics(page, "m")


def test_a_histogram_sum_that_goes_down_resets_its_count_too() -> None:
    """Issue 16, F1: a per-token sum that went down while its count rose was read as a reset of
    the sum alone, and the mean as whatever that gave; both now reset together."""
    before = ServerSample("vllm", token_latency_sum_s=10.0, token_latency_count=100.0,
                          latency_sum_s=50.0, latency_count=10.0)  # fmt: skip
    after = ServerSample("vllm", token_latency_sum_s=2.0, token_latency_count=120.0,
                         latency_sum_s=55.0, latency_count=8.0)  # fmt: skip
    d = derive(before, after)
    assert d.mean_token_latency_s == pytest.approx(2.0 / 120.0)
    assert d.mean_latency_s == pytest.approx(55.0 / 8.0)
    assert d.mean_token_latency_s > 0 and d.mean_latency_s > 0


def test_a_page_with_too_many_series_or_an_absurd_queue_is_unreadable() -> None:
    """Issue 16, F5: a huge valid page costs seconds to parse; a running count of a million
    is a lie that would scale a learnt capacity."""
    from controlplane import limits

    many = "".join(
        f'vllm:num_requests_running{{model_name="m",x="{i}"}} 1\n'
        for i in range(limits.METRICS_MAX_SERIES + 1)
    )
    with pytest.raises(MetricsPageInvalid, match="over the 20000 limit"):
        parse_metrics(many, "m")
    with pytest.raises(MetricsPageInvalid, match="vllm:num_requests_running: value 1e\\+06 is over"):
        parse_metrics('vllm:num_requests_running{model_name="m"} 1000000\n', "m")
    assert parse_metrics('vllm:num_requests_running{model_name="m"} 100000\n', "m").running == 100000


# ---- TTFT and TPOT histograms, whole -----------------------------------------------------------

TTFT_V1 = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="llama-3-8b"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="llama-3-8b"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="llama-3-8b"} 90.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama-3-8b"} 100.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama-3-8b"} 100.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama-3-8b"} 31.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.001",model_name="llama-3-8b"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="llama-3-8b"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="llama-3-8b"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="llama-3-8b"} 4.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="llama-3-8b"} 4.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="llama-3-8b"} 2.5
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="other"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="other"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="other"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="other"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="other"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="other"} 0.007
vllm:time_to_first_token_seconds_created{engine="0",model_name="llama-3-8b"} 1.7e9
"""


def test_ttft_is_read_whole_summed_over_the_models_label_sets() -> None:
    s = parse_metrics(VLLM + TTFT_V1, "llama-3-8b")
    assert s.ttft == ServerHistogram((0.001, 0.1, 1.0), (1.0, 42.0, 93.0), 104.0, 34.0)
    assert s.tpot is None  # not on the page
    # Without a model: every label set.
    assert parse_metrics(VLLM + TTFT_V1).ttft == ServerHistogram(
        (0.001, 0.1, 1.0), (8.0, 49.0, 100.0), 111.0, 34.007
    )
    assert parse_metrics(VLLM, "llama-3-8b").ttft is None


def test_the_full_vllm_page_gives_both_histograms_with_the_servers_buckets() -> None:
    from controlplane.sim.emulator_metrics import TPOT_BUCKETS, TTFT_BUCKETS, sample_full_page

    page = sample_full_page("m", seed=5)
    s = parse_metrics(page, "m")
    assert s.ttft is not None and s.tpot is not None
    assert s.ttft.bounds == TTFT_BUCKETS and s.tpot.bounds == TPOT_BUCKETS
    assert list(s.ttft.counts) == sorted(s.ttft.counts) and s.ttft.counts[-1] <= s.ttft.count
    # _count and _sum as the page has them, and the TPOT ones are the per-token fields too.
    assert s.ttft.count == s.latency_count
    assert (s.tpot.count, s.tpot.sum) == (s.token_latency_count, s.token_latency_sum_s)
    # The same bounds tuple for every page: records of a batch share it.
    assert parse_metrics(sample_full_page("m", seed=6), "m").ttft.bounds is s.ttft.bounds  # type: ignore[union-attr]


def test_the_renamed_inter_token_histogram_stands_in_for_tpot_only_when_tpot_is_absent() -> None:
    itl = """\
vllm:inter_token_latency_seconds_bucket{le="0.01",model_name="llama-3-8b"} 5.0
vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="llama-3-8b"} 9.0
vllm:inter_token_latency_seconds_count{model_name="llama-3-8b"} 9.0
vllm:inter_token_latency_seconds_sum{model_name="llama-3-8b"} 0.2
"""
    assert parse_metrics(VLLM + itl, "llama-3-8b").tpot == ServerHistogram((0.01,), (5.0,), 9.0, 0.2)
    both = parse_metrics(VLLM + TPOT + itl, "llama-3-8b")
    assert both.tpot == ServerHistogram((), (), 400.0, 8.0)


def test_a_histogram_without_count_takes_its_inf_bucket_and_one_without_either_is_none() -> None:
    no_count = TTFT_V1.replace("_count{", "_nocount{")
    assert parse_metrics(VLLM + no_count, "llama-3-8b").ttft == ServerHistogram(
        (0.001, 0.1, 1.0), (1.0, 42.0, 93.0), 104.0, 34.0
    )
    no_sum = TTFT_V1.replace("_sum{", "_nosum{")
    assert parse_metrics(VLLM + no_sum, "llama-3-8b").ttft.sum is None  # type: ignore[union-attr]
    neither = "\n".join(x for x in no_count.splitlines() if 'le="+Inf"' not in x) + "\n"
    assert parse_metrics(VLLM + neither, "llama-3-8b").ttft is None


def test_sglang_and_tgi_latency_histograms() -> None:
    sglang = (
        'sglang:num_running_reqs{model_name="m"} 2\n'
        'sglang:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 3\n'
        'sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4\n'
        'sglang:time_to_first_token_seconds_count{model_name="m"} 4\n'
        'sglang:time_to_first_token_seconds_sum{model_name="m"} 1.5\n'
        'sglang:time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 30\n'
        'sglang:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 40\n'
        'sglang:time_per_output_token_seconds_count{model_name="m"} 40\n'
        'sglang:time_per_output_token_seconds_sum{model_name="m"} 1.2\n'
    )
    s = parse_metrics(sglang, "m")
    assert s.ttft == ServerHistogram((0.5,), (3.0,), 4.0, 1.5)
    assert s.tpot == ServerHistogram((0.05,), (30.0,), 40.0, 1.2)
    tgi = (
        "tgi_queue_size 4\n"
        'tgi_request_mean_time_per_token_duration_bucket{le="0.01"} 7\n'
        'tgi_request_mean_time_per_token_duration_bucket{le="+Inf"} 10\n'
        "tgi_request_mean_time_per_token_duration_count 10\n"
        "tgi_request_mean_time_per_token_duration_sum 0.3\n"
    )
    t = parse_metrics(tgi)
    assert t.ttft is None  # TGI has no first-token histogram
    assert t.tpot == ServerHistogram((0.01,), (7.0,), 10.0, 0.3)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('vllm:time_to_first_token_seconds_bucket{le="NaN",model_name="llama-3-8b"} 1\n', "numeric 'le'"),
        ('vllm:time_to_first_token_seconds_bucket{model_name="llama-3-8b"} 1\n', "numeric 'le'"),
        ('vllm:time_to_first_token_seconds_bucket{le="1",model_name="llama-3-8b"} -1\n', "negative"),
        ('vllm:time_to_first_token_seconds_count{model_name="llama-3-8b"} +Inf\n', "not a finite"),
    ],
)
def test_a_bad_latency_histogram_makes_the_page_unreadable(line: str, error: str) -> None:
    with pytest.raises(MetricsPageInvalid, match=error):
        parse_metrics(VLLM + line, "llama-3-8b")


# ---- a known line head costs a lookup and reads exactly as the full parse ----------------------

_HEAD = st.sampled_from(
    [
        'vllm:num_requests_running{model_name="m"}',
        'vllm:e2e_request_latency_seconds_bucket{le="0.5",model_name="m"}',
        'vllm:x{a="1 2"}',
        'vllm:y{a="b"} 1}',
        "vllm:bare",
        "vllm:bare ",
        "vllm:z{}",
        'vllm:w{a="b",}',
    ]
)
_TAIL = st.one_of(
    st.sampled_from(
        [
            "1",
            "1.5",
            "+Inf",
            "NaN",
            "1e3",
            "1_0",
            "1\t",
            "\t1",
            "",
            "0x10",
            "1 2",
            "1 -3",
            "1 x",
            "\u0661",
            "\\1",
        ]
    ),
    st.sampled_from([' # {a="b"} 1', " 1700000000000", "  1", "__name__", "1}"]),
    st.text(alphabet=' 1.e_\t#{}"', max_size=5),
)


@settings(max_examples=500, deadline=None)
@given(
    seen=st.lists(st.tuples(_HEAD, _TAIL), max_size=6), lines=st.lists(st.tuples(_HEAD, _TAIL), max_size=6)
)
def test_a_cached_head_reads_the_same_as_the_full_parse(
    seen: list[tuple[str, str]], lines: list[tuple[str, str]]
) -> None:
    parse._HEADS.clear()
    for head, tail in seen:
        parse._plain(f"{head} {tail}")
    for head, tail in lines:
        line = f"{head} {tail}"
        cached = parse._plain(line)
        parse._HEADS.clear()
        assert repr(cached) == repr(parse._plain_uncached(line)), line  # NaN == NaN here
        for h, t in seen:  # the cache as it was
            parse._plain(f"{h} {t}")


def test_the_head_cache_is_bounded() -> None:
    parse._HEADS.clear()
    for i in range(parse.HEADS_MAX + 5):
        parse._plain(f'vllm:num_requests_running{{model_name="m{i}"}} 1')
    assert len(parse._HEADS) <= parse.HEADS_MAX


def h(
    counts: tuple[float, ...], count: float, total: float | None = None, bounds=(0.1, 1.0)
) -> ServerHistogram:  # type: ignore[no-untyped-def]
    return ServerHistogram(bounds, counts, count, total)


@pytest.mark.parametrize(
    ("before", "after", "continues_"),
    [
        (h((1, 2), 3, 1.0), h((1, 2), 3, 1.0), True),  # nothing new
        (h((1, 2), 3, 1.0), h((2, 4), 6, 1.5), True),  # rises 1, 2, 3
        (h((1, 2), 3), h((1, 2), 4), True),  # one slow request
        (h((1, 2), 3, 1.0), h((0, 2), 3, 1.0), False),  # a bucket went down
        (h((1, 2), 3, 1.0), h((1, 2), 2, 1.0), False),  # the count went down
        (h((1, 2), 3, 1.0), h((1, 2), 3, 0.5), False),  # the sum went down
        (h((0, 1), 1), h((5, 5), 5), False),  # past the old counts, but fast bucket +5, count +4
        (h((1, 2), 3), h((1, 2), 3, bounds=(0.1, 2.0)), False),  # other bounds
        (h((), 3), h((), 5), True),  # only a count
    ],
)
def test_a_histogram_continues_its_predecessor_only_if_the_increase_is_a_histogram(
    before: ServerHistogram, after: ServerHistogram, continues_: bool
) -> None:
    from controlplane.signals.parse import continues, same_life

    assert continues(before, after) is continues_
    assert same_life(before, after) is continues_
    assert not same_life(h((1, 2), 3, 1.0), h((1, 2), 4, None))  # the sum came and went


def test_pages_captured_from_a_real_vllm_0_32_read_as_it_said() -> None:
    """tests/fixtures/pages/vllm/ (scripts/capture_vllm_pages.py): 4 running, 4 waiting."""
    from pathlib import Path

    pages = Path(__file__).resolve().parent.parent / "fixtures" / "pages" / "vllm"
    busy = parse_metrics((pages / "metrics-busy.txt").read_text(), "tiny-random-llama")
    assert (busy.dialect, busy.running, busy.waiting) == ("vllm", 4.0, 4.0)
    assert busy.kv_use is not None and 0 < busy.kv_use < 0.01
    after = parse_metrics((pages / "metrics-after.txt").read_text(), "some-other-name")
    assert (after.running, after.waiting, after.successes, after.failures) == (0.0, 0.0, 8.0, 0.0)
    assert after.latency_count == 8.0
    # The stream its client closed is in neither count, yet its first token and the gaps
    # the engine made before it let go were observed: 9 first tokens, and 210 gaps past the
    # others' 8 x 399.
    assert after.ttft is not None and after.ttft.count == 9.0
    # The per-token latency is the inter-token histogram's, one observation per gap.
    assert after.tpot is not None and after.token_latency_count == after.tpot.count == 8 * 399 + 210


PREFILL = """\
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{model_name="llama-3-8b"}} {prompt}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{model_name="llama-3-8b"}} {hits}
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{{le="+Inf",model_name="llama-3-8b"}} {n}
vllm:request_prefill_time_seconds_count{{model_name="llama-3-8b"}} {n}
vllm:request_prefill_time_seconds_sum{{model_name="llama-3-8b"}} {prefill}
# TYPE vllm:request_decode_time_seconds histogram
vllm:request_decode_time_seconds_bucket{{le="+Inf",model_name="llama-3-8b"}} {n}
vllm:request_decode_time_seconds_count{{model_name="llama-3-8b"}} {n}
vllm:request_decode_time_seconds_sum{{model_name="llama-3-8b"}} {decode}
"""


def test_prefill_per_uncached_token_and_decode_per_request_are_read_and_derived() -> None:
    first = parse_metrics(
        VLLM + PREFILL.format(prompt=1000, hits=400, n=10, prefill=1.2, decode=5.0), "llama-3-8b"
    )
    assert (first.prompt_tokens, first.prompt_seconds) == (600.0, 1.2)  # the cached tokens cost nothing
    assert (first.decode_sum_s, first.decode_count) == (5.0, 10.0)
    # 3,000 more prompt tokens, 2,000 of them cached: 1,000 computed in 0.5 s; 10 requests
    # decoded in 4 s.
    later = parse_metrics(
        VLLM + PREFILL.format(prompt=4000, hits=2400, n=20, prefill=1.7, decode=9.0), "llama-3-8b"
    )
    d = derive(first, later)
    assert d.prefill_s_per_token == pytest.approx(0.0005)
    assert d.decode_s_per_request == pytest.approx(0.4)
    # Every token cached in between: nothing computed, no figure (not an infinitely fast one).
    same = parse_metrics(
        VLLM + PREFILL.format(prompt=5000, hits=3400, n=21, prefill=1.7, decode=9.1), "llama-3-8b"
    )
    assert derive(later, same).prefill_s_per_token is None
    # A page without them: unknown.
    assert derive(parse_metrics(VLLM), parse_metrics(VLLM)).prefill_s_per_token is None


# ---- vLLM's LoRA adapters: the newest vllm:lora_requests_info series ---------------------------

LORA_HEAD = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
"""


def lora(running: str, waiting: str = "", max_lora: str = "2", at: str = "1.7650e9") -> str:
    """One series of vLLM's LoRA gauge, as its PrometheusStatLogger prints it."""
    return (
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {at}\n'
    )


def adapters(page: str, model: str | None = "llama-3-8b") -> tuple[object, object, object]:
    """(running, waiting, slots) read from the page, the same both ways (selective and whole)."""
    s = parse_metrics(page, model)
    assert s == parse_metrics(page, model, select=False)
    return s.lora_running, s.lora_waiting, s.max_lora


def test_the_newest_lora_series_is_the_servers_adapters_whatever_the_order_of_the_lines() -> None:
    series = [
        lora("", at="1.7650e9"),
        lora("sql-lora", at="1.7650001e9"),
        lora("sql-lora,chat-lora", "x", at="1.7650002e9"),
    ]
    for order in (series, series[::-1], [series[1], series[2], series[0]]):
        page = VLLM + LORA_HEAD + "".join(order)
        assert adapters(page) == (("sql-lora", "chat-lora"), ("x",), 2)
    # The load figures are what they are without the gauge.
    assert parse_metrics(VLLM + LORA_HEAD + "".join(series), "llama-3-8b") == dataclasses.replace(
        parse_metrics(VLLM, "llama-3-8b"),
        lora_running=("sql-lora", "chat-lora"),
        lora_waiting=("x",),
        max_lora=2,
    )
    # Before the load's lines, and with no model asked for: the same.
    assert adapters(LORA_HEAD + "".join(series) + VLLM, None) == (("sql-lora", "chat-lora"), ("x",), 2)


def test_the_emulators_lora_gauge_reads_as_it_was_set() -> None:
    """Another writer of the gauge (sim/emulator_metrics.py, prometheus_client's own output):
    a label set set again is the newest, wherever its series is on the page."""
    from controlplane.sim.emulator_metrics import VllmMetrics

    metrics = VllmMetrics("m", page="compact", max_loras=2)
    for running, waiting in (([], []), (["sql"], []), (["sql", "chat"], ["x"]), (["sql"], [])):
        metrics.observe_lora(running, waiting)
    page = metrics.render(2, 1, 0.3).decode()
    assert adapters(page, "m") == (("sql",), (), 2)


def test_empty_adapter_lists_are_known_and_a_page_without_the_gauge_is_unknown() -> None:
    assert adapters(VLLM + lora("", "")) == ((), (), 2)
    assert adapters(VLLM + lora("", "", max_lora="0")) == ((), (), 0)
    assert adapters(VLLM) == (None, None, None)
    # Not vLLM: no such gauge to read.
    sglang = 'sglang:num_running_reqs{model_name="m"} 1\nsglang:num_queue_reqs{model_name="m"} 0\n'
    assert adapters(sglang + lora("a"), "m") == (None, None, None)


def test_adapter_names_are_stripped_and_empty_and_repeated_ones_dropped_in_order() -> None:
    assert adapters(VLLM + lora(" b , ,a,b,, a", "c,c")) == (("b", "a"), ("c",), 2)
    # A name with an escaped quote or backslash reads as prometheus_client unescapes it.
    assert adapters(VLLM + lora('q\\"x,back\\\\slash')) == (('q"x', "back\\slash"), (), 2)


def test_a_tie_goes_to_the_same_series_in_any_order() -> None:
    a, b = lora("a", at="5"), lora("b", at="5")
    assert adapters(VLLM + a + b) == adapters(VLLM + b + a) == (("b",), (), 2)


def test_the_adapters_of_another_model_are_not_this_ones() -> None:
    other = lora("o", max_lora="4", at="9").replace("{", '{model_name="other",')
    assert adapters(VLLM + lora("mine", at="1") + other) == (("mine",), (), 2)
    assert adapters(VLLM + other) == (None, None, None)


@pytest.mark.parametrize(
    "series",
    [
        lora("a", max_lora="abc"),
        lora("a", max_lora="-1"),
        lora("a", max_lora="1025"),
        lora("a", max_lora="2.0"),
        lora("a", max_lora=""),
        lora("a", max_lora="1" * 5000),  # past Python's own limit on int(): refused first
        'vllm:lora_requests_info{running_lora_adapters="a",waiting_lora_adapters=""} 1\n',  # no max_lora
        'vllm:lora_requests_info{max_lora="2",waiting_lora_adapters=""} 1\n',  # no running list
        lora("x" * 257),  # a name over API_NAME_MAX_CHARS
        lora(",".join(f"a{i}" for i in range(65))),  # 65 names: over METRICS_LORA_MAX_ADAPTERS
        lora("a", ",".join(f"w{i}" for i in range(65))),
        lora("a," * 9000),  # a list longer than 64 names of 256 characters can be
        lora("tab\there"),
        lora("line\\nbreak"),  # an escaped line break: a name no terminal shows as it is
        lora("a", at="NaN"),
        lora("a", at="+Inf"),
        lora("a", at="-Inf"),
    ],
)
def test_a_lora_series_out_of_bounds_leaves_the_adapters_unknown_and_the_rest_of_the_page_read(
    series: str,
) -> None:
    page = VLLM + LORA_HEAD + lora("older", at="0.5") + series
    assert adapters(page) == (None, None, None)
    assert parse_metrics(page, "llama-3-8b") == parse_metrics(VLLM, "llama-3-8b")


def test_a_series_out_of_bounds_that_is_not_the_newest_does_not_matter_but_one_not_finite_does() -> None:
    stale = lora("x" * 257, max_lora="9999", at="1")
    assert adapters(VLLM + stale + lora("a", at="2")) == (("a",), (), 2)
    # A NaN cannot be ordered, and a +Inf would be the newest for ever: unknown.
    assert adapters(VLLM + lora("a", at="2") + lora("b", at="NaN")) == (None, None, None)
    # A negative time still orders (the server's clock is its own).
    assert adapters(VLLM + lora("a", at="-2") + lora("b", at="-1")) == (("b",), (), 2)


def test_the_most_names_and_the_longest_name_within_bounds_are_read() -> None:
    from controlplane import limits

    names = [
        f"n{i:03d}" + "x" * (limits.API_NAME_MAX_CHARS - 4) for i in range(limits.METRICS_LORA_MAX_ADAPTERS)
    ]
    running, waiting, slots = adapters(
        VLLM + lora(",".join(names), max_lora=str(limits.METRICS_LORA_MAX_SLOTS))
    )
    assert running == tuple(names) and waiting == () and slots == limits.METRICS_LORA_MAX_SLOTS


def test_lora_series_are_bounded_on_their_own_not_with_the_pages_series(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from controlplane import limits

    monkeypatch.setattr(limits, "METRICS_LORA_MAX_SERIES", 3)
    three = "".join(lora(f"a{i}", at=str(i)) for i in range(3))
    assert adapters(VLLM + three) == (("a2",), (), 2)
    assert adapters(VLLM + three + lora("a3", at="3")) == (None, None, None)
    # However many, they do not count in METRICS_MAX_SERIES (the load's lines do).
    monkeypatch.setattr(limits, "METRICS_MAX_SERIES", 10)
    many = "".join(lora(f"a{i}", at=str(i)) for i in range(20))
    assert parse_metrics(VLLM + many, "llama-3-8b").running == 3.0


def test_lora_heads_are_cached_apart_from_the_load_figures_heads() -> None:
    parse._HEADS.clear()
    parse._LORA_HEADS.clear()
    parse_metrics(VLLM + "".join(lora(f"a{i}", at=str(i)) for i in range(5)), "llama-3-8b")
    assert len(parse._LORA_HEADS) == 5
    assert not any("lora" in head for head in parse._HEADS)
    for i in range(parse.LORA_HEADS_MAX + 5):
        parse._plain(lora(f"b{i}").rstrip("\n"), parse._LORA_HEADS, parse.LORA_HEADS_MAX)
    assert len(parse._LORA_HEADS) <= parse.LORA_HEADS_MAX


_ADAPTER_LISTS = st.one_of(st.sampled_from(["", "a", "a,b", "b,a", " a ,,b,a", "x" * 257]), _LABEL_VALUE)


@st.composite
def _lora_lines(draw: st.DrawFn) -> str:
    labels = {
        key: draw(values)
        for key, values in (
            ("max_lora", st.sampled_from(["2", "0", "1024", "1025", "2.0", "-1", "", "x"])),
            ("running_lora_adapters", _ADAPTER_LISTS),
            ("waiting_lora_adapters", _ADAPTER_LISTS),
            ("model_name", st.sampled_from(["llama-3-8b", "other"])),
        )
        if draw(st.integers(0, 5))
    }
    keys = draw(st.permutations(list(labels)))
    value = draw(
        st.one_of(
            st.sampled_from(["1.765e9", "1765000000.5", "1", "NaN", "+Inf", "-Inf", "-1", "0"]),
            st.floats(width=32).map(repr),
        )
    )
    body = ",".join(f'{k}="{labels[k]}"' for k in keys)
    return f"vllm:lora_requests_info{{{body}}} {value}\n"


@settings(max_examples=500, deadline=None)
@given(series=st.lists(_lora_lines(), max_size=8), data=st.data())
def test_lora_series_read_the_same_both_ways_in_any_order_and_change_nothing_else(
    series: list[str], data: st.DataObject
) -> None:
    expected = parse_metrics(VLLM, "llama-3-8b")
    got = parse_metrics(VLLM + "".join(series), "llama-3-8b")
    assert got == parse_metrics(VLLM + "".join(series), "llama-3-8b", select=False)
    shuffled = data.draw(st.permutations(series))
    assert got == parse_metrics("".join(shuffled) + VLLM, "llama-3-8b")
    assert dataclasses.replace(got, lora_running=None, lora_waiting=None, max_lora=None) == expected
    # Known all together or not at all, and within the bounds when known.
    known = [got.lora_running is not None, got.lora_waiting is not None, got.max_lora is not None]
    assert all(known) or not any(known)
    if got.max_lora is not None:
        assert got.lora_running is not None and got.lora_waiting is not None
        assert 0 <= got.max_lora <= 1024
        for names in (got.lora_running, got.lora_waiting):
            assert len(names) <= 64 and len(set(names)) == len(names)
            assert all(n and n == n.strip() and len(n) <= 256 for n in names)
