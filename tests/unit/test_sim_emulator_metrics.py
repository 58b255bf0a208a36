"""The emulator's /metrics page: the full page is a real vLLM page's size and shape, the
compact one the emulator's original, and the control plane reads the same load from both."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.cli.main import main
from controlplane.signals.parse import parse_metrics
from controlplane.sim.emulator import EmulatorConfig
from controlplane.sim.emulator_engine import Sequence
from controlplane.sim.emulator_metrics import (
    ITERATION_BUCKETS,
    MAX_MODEL_LEN,
    TritonMetrics,
    VllmMetrics,
    one_two_five,
    sample_full_page,
    sample_page,
)

MODEL = "llama-3-8b"
COMPACT_FAMILIES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:e2e_request_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_success",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
}
# The families `controlplane.signals.parse` reads from a vLLM 0.32 page, with their labels.
PARSED = {
    "vllm:num_requests_running": {"engine", "model_name"},
    "vllm:num_requests_waiting": {"engine", "model_name"},
    "vllm:kv_cache_usage_perc": {"engine", "model_name"},
    "vllm:e2e_request_latency_seconds": {"engine", "model_name"},
    "vllm:time_to_first_token_seconds": {"engine", "model_name"},
    "vllm:inter_token_latency_seconds": {"engine", "model_name"},
    "vllm:request_time_per_output_token_seconds": {"engine", "model_name"},
    "vllm:request_success": {"engine", "model_name", "finished_reason"},
    "vllm:prompt_tokens": {"engine", "model_name"},
    "vllm:prefix_cache_hits": {"engine", "model_name"},
    "vllm:request_prefill_time_seconds": {"engine", "model_name"},
    "vllm:request_decode_time_seconds": {"engine", "model_name"},
}
REAL_PAGES = Path(__file__).resolve().parent.parent / "fixtures" / "pages" / "vllm"


def families(page: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(page)}


def value(page: str, sample: str, **labels: str) -> float:
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{sample} {labels} not on the page")


def finished(prompt: int, out: int, *, submitted: float, started: float, decode: float) -> Sequence:
    seq = Sequence(prompt, out, submitted)
    seq.started = started
    seq.first_token = started + prompt * 0.001
    seq.decode_s_per_token = decode
    seq.finished = seq.first_token + out * decode
    return seq


def test_both_pages_parse_and_compact_has_fifteen_families() -> None:
    for page in ("full", "compact"):
        metrics = VllmMetrics(MODEL, page=page)
        metrics.observe_finished(finished(100, 20, submitted=0.0, started=0.5, decode=0.02), "length")
        text = metrics.render(2, 1, 0.3).decode()
        found = families(text)
        if page == "compact":
            assert set(found) - {n for n in found if n.endswith("_created")} == COMPACT_FAMILIES
        else:
            assert set(found) > COMPACT_FAMILIES
        assert sum(f.type == "histogram" for f in found.values()) == (16 if page == "full" else 7)


def test_sample_full_page_is_a_real_pages_size_with_every_histogram_populated() -> None:
    page = sample_full_page()
    size = len(page.encode())
    print(f"sample_full_page(): {size} bytes ({size / 1024:.1f} KiB)")
    assert 30_000 <= size <= 60_000
    found = families(page)
    histograms = [f for f in found.values() if f.type == "histogram"]
    assert len(histograms) >= 12
    for family in histograms:
        assert value(page, f"{family.name}_count") > 0, family.name
    assert page == sample_full_page()  # repeatable
    assert page != sample_full_page(seed=1)
    served = sum(value(page, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert served == 5000 == value(page, "vllm:e2e_request_latency_seconds_count")
    # As on vLLM, the tokens of all engine steps are the prompt and generated tokens.
    assert value(page, "vllm:iteration_tokens_total_sum") == value(page, "vllm:prompt_tokens_total") + value(
        page, "vllm:generation_tokens_total"
    )
    for r in (100, 20_000):
        assert 30_000 <= len(sample_full_page(requests=r).encode()) <= 60_000


def test_the_control_plane_reads_the_same_load_from_both_pages() -> None:
    full, compact = (sample_page(MODEL, seed=3, requests=800, page=p) for p in ("full", "compact"))
    assert len(full) > 1.5 * len(compact)
    a, b = parse_metrics(full, MODEL), parse_metrics(compact, MODEL)
    assert a == b
    assert a.running and a.waiting is not None and a.kv_use and a.latency_count == 800
    assert a.latency_sum_s and a.successes == 800 and a.token_latency_count and a.latency_buckets


def test_the_parsed_families_keep_their_labels_on_the_full_page() -> None:
    found = families(sample_full_page(MODEL, requests=200))
    for name, labels in PARSED.items():
        for s in found[name].samples:
            assert set(s.labels) - {"le"} == labels, s
    assert found["vllm:request_prompt_tokens"].samples[0].labels["engine"] == "0"
    reasons = {s.labels["finished_reason"] for s in found["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}


def _shape(page: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Each vllm: family's type and the label names of its samples (`le` included)."""
    return {
        f.name: (f.type, frozenset(k for s in f.samples for k in s.labels))
        for f in text_string_to_metric_families(page)
        if f.name.startswith("vllm:")
    }


@pytest.mark.parametrize("page", ["full", "compact"])
def test_the_emulators_page_has_a_real_vllm_0_32_pages_names_types_and_labels(page: str) -> None:
    """Issue 32: the emulator cannot drift from what it imitates. Against the page captured
    from a real vLLM 0.32 (tests/fixtures/pages/vllm/, scripts/capture_vllm_pages.py): every
    family the parser reads has the same type and label names on both; every other family of
    the emulator's is on the real page, with the same type, its label names among the real
    one's (cache_config_info prints a few of vLLM's 38 configuration labels)."""
    real = _shape((REAL_PAGES / "metrics-after.txt").read_text())
    ours = _shape(sample_page(MODEL, requests=300, page=page))  # type: ignore[arg-type]
    for name in PARSED:
        assert name in real, f"{name}: not on the real page"
        assert ours.get(name) == real[name], name
    for name, (kind, labels) in ours.items():
        assert name in real, f"{name}: the emulator has it, vLLM 0.32 does not"
        assert kind == real[name][0], name
        assert labels <= real[name][1], (name, labels - real[name][1])
    # The parser reads the same quantities from both pages.
    fields = ("running", "waiting", "kv_use", "latency_count", "successes", "failures", "token_latency_count")
    got = parse_metrics(sample_page(MODEL, requests=300, page=page), MODEL)  # type: ignore[arg-type]
    want = parse_metrics((REAL_PAGES / "metrics-after.txt").read_text(), MODEL)
    assert [getattr(got, f) is None for f in fields] == [getattr(want, f) is None for f in fields]
    assert (got.ttft is None, got.tpot is None) == (want.ttft is None, want.tpot is None)


def test_the_histograms_observe_what_the_request_did() -> None:
    metrics = VllmMetrics(MODEL, page="full", kv_capacity_tokens=1600)
    # Queued 0.5 s, 100 prompt tokens prefilled in 0.1 s, 20 tokens at 0.05 s: 1.0 s decode.
    seq = finished(100, 20, submitted=0.0, started=0.5, decode=0.05)
    metrics.observe_finished(seq, "stop", batch_size=4, max_tokens=64)
    metrics.observe_prefix(100, 32)  # 2 blocks of its prompt were cached
    page = metrics.render(0, 0, 0.0).decode()
    e = {"engine": "0"}
    for sample, want in [
        ("vllm:request_queue_time_seconds_sum", 0.5),
        ("vllm:time_to_first_token_seconds_sum", 0.6),
        ("vllm:request_prefill_time_seconds_sum", 0.1),
        ("vllm:request_decode_time_seconds_sum", 1.0),
        ("vllm:request_inference_time_seconds_sum", 1.1),
        ("vllm:e2e_request_latency_seconds_sum", 1.6),
        ("vllm:request_prompt_tokens_sum", 100),
        ("vllm:request_generation_tokens_sum", 20),
        ("vllm:request_params_max_tokens_sum", 64),
        ("vllm:request_params_n_sum", 1),
        ("vllm:prefix_cache_queries_total", 100),
        ("vllm:prefix_cache_hits_total", 32),
        ("vllm:num_preemptions_total", 0),
    ]:
        assert value(page, sample) == pytest.approx(want), sample
    # One observation per gap between tokens; one per request of its mean.
    assert value(page, "vllm:inter_token_latency_seconds_count") == 19
    assert value(page, "vllm:inter_token_latency_seconds_sum") == pytest.approx(19 * 0.05)
    assert value(page, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(page, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.05)
    # Steps: the prefill with the first token (101), then 19 tokens in steps of 4: 4 x 4 + 3.
    assert value(page, "vllm:iteration_tokens_total_count") == 6
    assert value(page, "vllm:iteration_tokens_total_bucket", le="1.0", **e) == 0
    assert value(page, "vllm:iteration_tokens_total_bucket", le="8.0", **e) == 5  # cumulative
    assert value(page, "vllm:iteration_tokens_total_bucket", le="128.0", **e) == 6
    assert value(page, "vllm:iteration_tokens_total_sum") == 120
    assert value(page, "vllm:cache_config_info", num_gpu_blocks="100") == 1


def test_bucket_lists() -> None:
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five(MAX_MODEL_LEN)[-1] == 20_000
    assert ITERATION_BUCKETS[:3] == (1, 8, 16) and ITERATION_BUCKETS[-1] == 16384  # vLLM 0.32's
    assert len(ITERATION_BUCKETS) == 13
    assert all(math.isfinite(b) for b in ITERATION_BUCKETS)


def test_the_page_mode_is_a_server_setting() -> None:
    assert EmulatorConfig(MODEL).metrics_page == "full"
    assert EmulatorConfig(MODEL, metrics_page="compact").metrics_page == "compact"
    with pytest.raises(ValueError, match="metrics_page"):
        EmulatorConfig(MODEL, metrics_page="huge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page"):
        VllmMetrics(MODEL, page="huge")  # type: ignore[arg-type]


def test_the_emulate_command_takes_the_page_mode(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[EmulatorConfig] = []
    metrics_ports: list[list[int] | None] = []

    async def run(
        config: EmulatorConfig,
        host: str,
        ports: list[int],
        crash_after: float | None,
        mports: list[int] | None = None,
    ) -> int:
        started.append(config)
        metrics_ports.append(mports)
        return 0

    monkeypatch.setattr("controlplane.cli.commands.emulate._run_emulators_until_signal", run)
    assert main(["emulate", "--model", MODEL, "--metrics-page", "compact"]) == 0
    assert main(["emulate", "--model", MODEL]) == 0
    assert (
        main(
            [
                "emulate",
                "--model",
                MODEL,
                "--metrics-page",
                "triton",
                "--metrics-port",
                "9002",
                "--count",
                "2",
            ]
        )
        == 0
    )
    assert [c.metrics_page for c in started] == ["compact", "full", "triton"]
    assert metrics_ports == [None, None, [9002, 9003]]
    with pytest.raises(SystemExit) as bad:
        main(["emulate", "--model", MODEL, "--metrics-page", "huge"])
    assert bad.value.code == 2
    assert "--metrics-page" in capsys.readouterr().err
    with pytest.raises(SystemExit) as shown:
        main(["emulate", "--help"])
    assert shown.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--metrics-page {full,compact,triton}" in help_text and "(default: full)" in help_text


def test_the_triton_page_is_read_as_triton_with_failures_counted() -> None:
    m = TritonMetrics(MODEL)
    for i in range(4):
        m.observe_finished(finished(10, 5, submitted=i, started=i + 0.5, decode=0.02), "length")
    m.observe_failed()
    page = m.render(running=2, waiting=3, kv_use=0.25).decode()
    assert "vllm:" not in page and families(page)  # valid Prometheus text, Triton names only
    sample = parse_metrics(page, MODEL)
    assert sample.dialect == "triton"
    assert (sample.successes, sample.failures, sample.waiting) == (4.0, 1.0, 3.0)
    assert sample.latency_count == 4.0
    assert sample.latency_sum_s == pytest.approx(4 * (0.5 + 0.01 + 0.1), rel=1e-3)
    # The emulator's faults are answered before its engine, where vLLM counts nothing: a
    # failure leaves its page as it was (its `error` reason at 0).
    v = VllmMetrics(MODEL)
    before = v.render(0, 0, 0.0)
    v.observe_failed()
    assert parse_metrics(v.render(0, 0, 0.0).decode(), MODEL).failures == 0.0
    assert parse_metrics(before.decode(), MODEL).failures == 0.0
