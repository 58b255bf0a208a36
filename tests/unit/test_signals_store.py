from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest

from controlplane.balancing.policies import POLICIES, PolicyConfig, adaptive
from controlplane.balancing.shedding import saturation
from controlplane.balancing.weigher import load_balance_degree
from controlplane.signals.load import counted
from controlplane.signals.parse import MetricsPageInvalid, ServerSample, parse_metrics
from controlplane.signals.store import (
    SCRAPE_ERROR_REASONS,
    UNREACHABLE_AFTER,
    ScrapeError,
    ScrapeResult,
    SignalStore,
    fetch_error,
    page_error,
)
from tests.unit.test_signals_parse import VLLM

KEY = ("llama-3-8b", "127.0.0.1:8000")
OK = ScrapeResult(health_status=200, metrics_text=VLLM)


def page(success: float, latency_sum: float, waiting: float = 7.0) -> str:
    return (
        VLLM.replace(
            'finished_reason="stop",model_name="llama-3-8b"} 90.0',
            f'finished_reason="stop",model_name="llama-3-8b"}} {success - 10}',
        )
        .replace('_count{model_name="llama-3-8b"} 100.0', f'_count{{model_name="llama-3-8b"}} {success}')
        .replace('_sum{model_name="llama-3-8b"} 150.0', f'_sum{{model_name="llama-3-8b"}} {latency_sum}')
        .replace('waiting{model_name="llama-3-8b"} 7.0', f'waiting{{model_name="llama-3-8b"}} {waiting}')
    )


def test_a_vllm_page_becomes_the_endpoint_load() -> None:
    store = SignalStore()
    store.record_scrape(KEY, OK, now=10.0)
    load = store.load(KEY, capacity=2.0, now=10.5)
    assert (load.ready, load.running, load.waiting, load.kv_use) == (True, 3.0, 7.0, 0.42)
    assert load.age_s == 0.5
    assert load.capacity == 2.0
    assert load.latency_s is None  # needs two samples: latency is per interval
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=page(110, 170.0)), now=11.0)
    assert store.load(KEY, 1.0, 11.0).latency_s == 2.0  # 20 s over 10 requests


def test_latency_is_an_ewma_over_intervals() -> None:
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=page(100, 100.0)), now=0.0)
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=page(110, 110.0)), now=1.0)  # 1 s each
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=page(120, 160.0)), now=2.0)  # 5 s each
    latency = store.load(KEY, 1.0, 2.0).latency_s
    assert latency is not None and 1.0 < latency < 5.0
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=page(120, 160.0)), now=3.0)  # none done
    assert store.load(KEY, 1.0, 3.0).latency_s == latency


def test_garbage_counts_an_error_keeps_the_sample_and_the_weight_fades_not_jumps() -> None:
    store = SignalStore()
    busy = ("m", "127.0.0.2:8000")
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=page(100, 100.0, waiting=0.0)), now=0.0)
    store.record_scrape(
        busy,
        ScrapeResult(200, metrics_text=page(100, 100.0, waiting=20.0).replace('"llama-3-8b"', '"m"')),
        now=0.0,
    )
    cfg = PolicyConfig()
    # Twice the peer's capacity: on like servers adaptive leaves queues to Envoy.
    before = adaptive([store.load(KEY, 2.0, 0.0), store.load(busy, 1.0, 0.0)], cfg)
    assert before["127.0.0.2:8000"] < before["127.0.0.1:8000"] / 2 / 2
    history = []
    for t in range(1, 40):
        store.record_scrape(busy, ScrapeResult(200, metrics_text="<html>oops</html>"), now=float(t))
        store.record_scrape(KEY, ScrapeResult(200, metrics_text=page(100, 100.0, waiting=0.0)), now=float(t))
        w = adaptive([store.load(KEY, 2.0, float(t)), store.load(busy, 1.0, float(t))], cfg)
        history.append(w["127.0.0.2:8000"])
    sig = store.endpoints[busy]
    assert sig.scrape_errors == 39
    assert sig.last_error is not None and sig.last_error.startswith("unreadable metrics page")
    assert sig.sample is not None and sig.sample.waiting == 20.0  # the last good sample stays
    assert history[0] == before["127.0.0.2:8000"]  # fresh enough: still trusted
    assert history[-1] == cfg.max_weight // 2  # fully stale: capacity only, half its peer's
    steps = [b - a for a, b in itertools.pairwise(history)]
    assert all(s >= 0 for s in steps) and max(steps) <= cfg.max_weight // 5  # gradual


def test_health_503_holds_out_and_recovery_starts_the_slow_start_clock() -> None:
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(health_status=200), now=0.0)
    assert store.load(KEY, 1.0, 0.0).ready_for_s == math.inf  # ready at first sight: no ramp
    store.record_scrape(KEY, ScrapeResult(health_status=503), now=1.0)
    assert not store.load(KEY, 1.0, 1.0).ready
    store.record_scrape(KEY, ScrapeResult(health_status=200), now=5.0)
    load = store.load(KEY, 1.0, 7.5)
    assert load.ready and load.ready_for_s == 2.5


def test_a_server_without_a_health_endpoint_is_ready() -> None:
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(health_status=404), now=0.0)
    assert store.load(KEY, 1.0, 0.0).ready


def test_no_answer_is_out_of_sight_after_several_failures_never_a_verdict() -> None:
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(health_status=200), now=0.0)
    for i in range(1, UNREACHABLE_AFTER):
        store.record_scrape(KEY, ScrapeResult(health_error="connection refused"), now=float(i))
        assert store.load(KEY, 1.0, float(i)).in_sight
    store.record_scrape(KEY, ScrapeResult(health_error="connection refused"), now=9.0)
    load = store.load(KEY, 1.0, 9.0)
    assert not load.in_sight and load.ready  # the server's last word (ready) stands
    assert store.out_of_sight(KEY)
    store.record_scrape(KEY, ScrapeResult(health_status=200), now=10.0)
    assert store.load(KEY, 1.0, 10.0).in_sight


def test_an_unready_server_that_goes_silent_stays_unready() -> None:
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(health_status=503), now=0.0)
    for i in range(1, UNREACHABLE_AFTER + 2):
        store.record_scrape(KEY, ScrapeResult(health_error="timed out"), now=float(i))
    load = store.load(KEY, 1.0, 9.0)
    assert not load.ready and not load.in_sight


def test_an_answer_from_the_metrics_port_keeps_a_server_in_sight() -> None:
    """Health hangs but the page answers (even with an HTTP error): the server is in sight."""
    store = SignalStore()
    for i in range(UNREACHABLE_AFTER + 2):
        store.record_scrape(
            KEY,
            ScrapeResult(health_error="timed out", metrics_error="GET /metrics: HTTP 500", reached=True),
            now=float(i),
        )
    assert store.load(KEY, 1.0, 9.0).in_sight
    for i in range(UNREACHABLE_AFTER):
        store.record_scrape(
            KEY, ScrapeResult(health_error="timed out", metrics_error="refused", reached=False), now=10.0 + i
        )
    assert not store.load(KEY, 1.0, 20.0).in_sight


def test_a_source_that_cannot_tell_reachability_changes_nothing() -> None:
    """Prometheus results carry no health and no reachability: sight is left as it was."""
    store = SignalStore()
    for i in range(UNREACHABLE_AFTER + 2):
        store.record_scrape(KEY, ScrapeResult(metrics_error="Prometheus has no series"), now=float(i))
    assert store.load(KEY, 1.0, 9.0).in_sight


def test_never_scraped_is_assumed_ready_with_no_trusted_signal() -> None:
    load = SignalStore().load(KEY, 1.5, 0.0)
    assert load.ready and load.age_s == math.inf and load.capacity == 1.5


def test_load_reports_sum_over_proxies_expire_and_feed_errors() -> None:
    store = SignalStore()
    store.record_lrs(KEY, "envoy-a", in_progress=3, issued=10, succeeded=8, failed=2, now=0.0)
    store.record_lrs(KEY, "envoy-b", in_progress=2, issued=5, succeeded=5, failed=0, now=5.0)
    assert store.lrs_totals(KEY, 6.0) == (5.0, 15.0, 13.0, 2.0)
    load = store.load(KEY, 1.0, 6.0)
    assert load.running == 5.0  # no metrics page: in flight from the proxies
    assert load.error_rate == 2 / 15
    assert store.lrs_totals(KEY, 12.0) == (2.0, 5.0, 5.0, 0.0)  # envoy-a's report is too old
    store.forget_node("envoy-b")
    assert store.lrs_totals(KEY, 12.0) == (0.0, 0.0, 0.0, 0.0)


def test_retain_forgets_endpoints_that_left_the_fleet() -> None:
    store = SignalStore()
    store.record_scrape(KEY, OK, now=0.0)
    store.record_scrape(("m", "127.0.0.9:1"), OK, now=0.0)
    store.retain({KEY})
    assert set(store.endpoints) == {KEY}


def busy_page(running: float, completed: float) -> str:
    return page(completed, completed).replace(
        'running{model_name="llama-3-8b"} 3.0', f'running{{model_name="llama-3-8b"}} {running}'
    )


def test_throughput_is_learnt_only_while_busy() -> None:
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=busy_page(0, 100)), now=0.0)
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=busy_page(0, 101)), now=1.0)
    assert store.learnt_throughput(KEY) is None  # idle: says nothing about capacity
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=busy_page(4, 101)), now=2.0)
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=busy_page(4, 109)), now=3.0)
    # 8 completions in 1 s with 4 running: 2 per running request per second, x 4 slots seen.
    assert store.learnt_throughput(KEY) == 8.0
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=busy_page(4, 113)), now=4.0)
    learnt = store.learnt_throughput(KEY)
    assert learnt is not None and 4.0 < learnt < 8.0  # smoothed towards the new 4/s


def test_time_per_output_token_reaches_the_load() -> None:
    from tests.unit.test_signals_parse import TPOT

    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=VLLM + TPOT), now=0.0)
    assert store.load(KEY, 1.0, 0.0).token_latency_s is None
    later = TPOT.replace("400.0", "500.0").replace("} 8.0", "} 10.0")
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=VLLM + later), now=1.0)
    assert store.load(KEY, 1.0, 1.0).token_latency_s == 0.02


def test_a_spike_of_running_requests_neither_jumps_the_peak_nor_stays() -> None:
    """Issue 16, F5: a few samples claiming 100,000 requests running (a lie or a bug) moved
    the learnt peak, and with it the learnt capacity, for good."""
    from controlplane.signals.parse import ServerSample

    store = SignalStore()

    def at(t: float, running: float, done: float) -> None:
        store.record_scrape(
            KEY, ScrapeResult(sample=ServerSample("vllm", running=running, successes=done)), t
        )

    done = 0.0
    for t in range(10):
        done += 4
        at(float(t), 4, done)
    assert store.endpoints[KEY].peak_running == 4
    for t in range(10, 13):
        done += 4
        at(float(t), 100_000, done)
    assert store.endpoints[KEY].peak_running <= 8 * 2**2  # a few doublings at most, not 100,000
    done += 4
    at(13.0, 4, done)  # the sample after the spike still pairs with it: one more doubling
    assert store.endpoints[KEY].peak_running <= 8 * 2**3
    for t in range(14, 130):
        done += 4
        at(float(t), 4, done)
    assert store.endpoints[KEY].peak_running < 6  # faded back towards what it really runs


# ---- unknown is not zero (issue 32) ---------------------------------------------------------

LLAMACPP_BUSY = (Path(__file__).parents[1] / "fixtures/pages/llamacpp/metrics-busy.txt").read_text()
# A page of another exporter: what a wrong signals.metrics_path (or a server of no supported
# kind) serves.
NODE_EXPORTER = '# TYPE node_cpu_seconds_total counter\nnode_cpu_seconds_total{cpu="0"} 12.5\n'


def test_a_figure_never_read_is_unknown_not_zero() -> None:
    store = SignalStore()
    never = store.load(KEY, 1.0, 0.0)
    assert (never.running, never.waiting, never.kv_use, never.latency_s, never.error_rate) == (None,) * 5
    # A real llama.cpp page has no KV gauge, and one page gives no rate yet.
    llama = ("m", "127.0.0.3:8080")
    store.record_scrape(llama, ScrapeResult(200, metrics_text=LLAMACPP_BUSY), now=0.0)
    load = store.load(llama, 1.0, 0.0)
    assert (load.running, load.waiting, load.kv_use, load.error_rate) == (2.0, 4.0, None, None)
    # Proxies' reports alone: running is what they have in flight, the queue is not known.
    lrs = ("m", "127.0.0.4:8000")
    store.record_lrs(lrs, "envoy-a", in_progress=0, issued=0, succeeded=0, failed=0, now=0.0)
    load = store.load(lrs, 1.0, 1.0)
    assert (load.running, load.waiting, load.kv_use, load.error_rate) == (0.0, None, None, None)
    # ...until their report expires: then running is unknown again.
    assert store.load(lrs, 1.0, 20.0).running is None
    # A garbage page read first gives nothing either.
    bad = ("m", "127.0.0.5:8000")
    store.record_scrape(bad, ScrapeResult(200, metrics_text="<html>oops</html>"), now=0.0)
    assert store.load(bad, 1.0, 0.0).waiting is None


def test_error_rate_is_known_once_either_source_counted_completions() -> None:
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=page(100, 100.0)), now=0.0)
    assert store.load(KEY, 1.0, 0.0).error_rate is None  # counters need two pages
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=page(110, 110.0)), now=1.0)
    assert store.load(KEY, 1.0, 1.0).error_rate == 0.0
    other = ("m", "127.0.0.6:8000")
    store.record_lrs(other, "envoy-a", in_progress=1, issued=4, succeeded=3, failed=1, now=0.0)
    assert store.load(other, 1.0, 1.0).error_rate == 0.25


def test_unknown_figures_weigh_exactly_as_the_zeros_they_replace() -> None:
    """The weights predate "unknown": every policy gives the loads with None the weights it
    gave the same loads with the 0 the store used to put there."""
    store = SignalStore()
    keys = [("m", f"127.0.0.{i}:8000") for i in range(1, 6)]
    store.record_scrape(keys[0], ScrapeResult(200, metrics_text=page(100, 100.0, waiting=3.0)), now=0.0)
    store.record_scrape(keys[0], ScrapeResult(200, metrics_text=page(110, 130.0, waiting=3.0)), now=1.0)
    store.record_scrape(keys[1], ScrapeResult(200, metrics_text=LLAMACPP_BUSY), now=1.0)  # no KV
    store.record_lrs(keys[2], "envoy-a", in_progress=2, issued=5, succeeded=4, failed=1, now=1.0)
    store.record_scrape(keys[3], ScrapeResult(200, metrics_text=NODE_EXPORTER), now=1.0)  # unreadable
    # keys[4]: never heard of
    loads = [store.load(k, 1.0 + i % 2, 2.0) for i, k in enumerate(keys)]
    assert any(v is None for ld in loads for v in (ld.running, ld.waiting, ld.kv_use, ld.error_rate))
    zeros = [
        dataclasses.replace(
            ld,
            running=counted(ld.running),
            waiting=counted(ld.waiting),
            kv_use=counted(ld.kv_use),
            error_rate=counted(ld.error_rate),
        )
        for ld in loads
    ]
    cfg = PolicyConfig(slow_start_s=0.0)
    for name, policy in POLICIES.items():
        assert policy(loads, cfg) == policy(zeros, cfg), name
    # What the store and policies gave for these inputs before (commit 2208b30).
    before = {
        "adaptive": [12, 14, 50, 100, 50],
        "least_connections": [14, 14, 33, 100, 100],
        "model_aware": [7, 14, 50, 100, 50],
    }
    for name, weights in before.items():
        assert list(POLICIES[name](loads, cfg).values()) == weights, name
    assert load_balance_degree(loads) == load_balance_degree(zeros)
    assert saturation(loads) == saturation(zeros)


def test_the_last_scrape_error_is_kept_with_its_reason_until_a_page_is_read() -> None:
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=NODE_EXPORTER), now=0.0)
    sig = store.endpoints[KEY]
    assert sig.scrape_error_reason == "no_dialect"
    assert sig.scrape_error is not None and "metrics on the page" in sig.scrape_error
    # A health answer alone (the page not fetched) is no new outcome of the metrics scrape.
    store.record_scrape(KEY, ScrapeResult(health_status=200), now=1.0)
    assert sig.scrape_error_reason == "no_dialect"
    store.record_scrape(KEY, ScrapeResult(200, metrics_text="<html>oops</html>"), now=2.0)
    assert sig.scrape_error_reason == "unreadable"
    failed = ScrapeResult(200, metrics_error="GET /metrics answered HTTP 404", error_reason="http_error")
    store.record_scrape(KEY, failed, now=3.0)
    assert (sig.scrape_error, sig.scrape_error_reason) == ("GET /metrics answered HTTP 404", "http_error")
    store.record_scrape(KEY, ScrapeResult(metrics_error="from a source that does not say"), now=4.0)
    assert sig.scrape_error_reason == "other"
    store.record_scrape(KEY, OK, now=5.0)
    assert (sig.scrape_error, sig.scrape_error_reason) == (None, None)
    assert sig.scrape_errors == 4
    assert sig.scrape_errors_by_reason == {"no_dialect": 1, "unreadable": 1, "http_error": 1, "other": 1}


def test_a_page_of_no_dialect_is_told_from_other_unreadable_pages() -> None:
    """page_error reads parse.py's message: this holds it to the words it looks for."""
    with pytest.raises(MetricsPageInvalid) as e:
        parse_metrics(NODE_EXPORTER, "m")
    assert page_error(e.value) == ScrapeError(f"unreadable metrics page: {e.value}", "no_dialect")
    for text in ("<html>oops</html>", VLLM.replace("3.0", "-3.0")):
        with pytest.raises(MetricsPageInvalid) as e:
            parse_metrics(text, "llama-3-8b")
        assert page_error(e.value) == ScrapeError(f"unreadable metrics page: {e.value}", "unreadable")


REFUSED = "GET /m failed: ClientConnectorError: refused"
TIMED_OUT = "GET /m timed out after 0.5s"
TOO_BIG = "page is over the 4194304 byte limit"


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        # no HTTP answer (refused, timed out): the probe's words, unreachable
        (None, REFUSED, ScrapeError(REFUSED, "unreachable")),
        (None, TIMED_OUT, ScrapeError(TIMED_OUT, "unreachable")),
        # an answer whose page was refused (over the size limit): unreadable, whatever the status
        (200, TOO_BIG, ScrapeError(TOO_BIG, "unreadable")),
        (503, TOO_BIG, ScrapeError(TOO_BIG, "unreadable")),
        # an answer other than 200: http_error, named with the path the fleet gave
        (404, None, ScrapeError("GET /m answered HTTP 404", "http_error")),
        (503, None, ScrapeError("GET /m answered HTTP 503", "http_error")),
        (204, None, ScrapeError("GET /m answered HTTP 204", "http_error")),
        # a page to read, or nothing fetched (metrics: none): no error
        (200, None, None),
        (None, None, None),
    ],
)
def test_a_fetch_that_brought_no_page_says_why(
    status: int | None, error: str | None, expected: ScrapeError | None
) -> None:
    assert fetch_error("/m", status, error) == expected
    assert expected is None or expected.reason in SCRAPE_ERROR_REASONS


def test_a_server_never_seen_ready_whose_serving_port_refuses_is_not_ready_and_in_sight() -> None:
    """A vLLM keeps its port closed while it loads: the proxies' connections would be
    refused too, so it is not ready yet (held out, its model's requests held), not a server
    out of sight kept on a verdict that was never given."""
    store = SignalStore()
    refused = ScrapeResult(health_error="GET /health failed: Connection refused", serving_refused=True)
    for i in range(UNREACHABLE_AFTER + 2):
        store.record_scrape(KEY, refused, now=float(i))
        load = store.load(KEY, 1.0, float(i))
        assert not load.ready and load.in_sight, i
    assert store.heard(KEY)  # weighed (0), not left to the benefit of the doubt
    assert "never seen ready" in (store.endpoints[KEY].last_error or "")
    store.record_scrape(KEY, ScrapeResult(health_status=200), now=10.0)
    load = store.load(KEY, 1.0, 12.0)
    assert load.ready and load.ready_for_s == 2.0  # seen turning ready: it ramps up


def test_a_refusal_after_the_server_was_seen_ready_is_no_verdict() -> None:
    """Once seen ready, a refused port is the fail-static case again: the last verdict
    stands, and it goes out of sight."""
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(health_status=200), now=0.0)
    refused = ScrapeResult(health_error="GET /health failed: Connection refused", serving_refused=True)
    for i in range(1, UNREACHABLE_AFTER + 1):
        store.record_scrape(KEY, refused, now=float(i))
    load = store.load(KEY, 1.0, 9.0)
    assert load.ready and not load.in_sight


def test_a_timeout_on_a_server_never_seen_is_still_no_verdict() -> None:
    store = SignalStore()
    for i in range(UNREACHABLE_AFTER):
        store.record_scrape(KEY, ScrapeResult(health_error="GET /health timed out after 0.5s"), now=float(i))
    load = store.load(KEY, 1.0, 9.0)
    assert load.ready and not load.in_sight  # the control plane may be the one that cannot see


def test_vllms_error_finish_reason_is_not_a_failure_count_a_rollout_may_rely_on() -> None:
    """vLLM 0.32 prints request_success_total{finished_reason="error"} (0 included), but a
    request answered 500 before the engine took it is counted nowhere: the rollout must still
    know that a failing canary can go unseen on a vLLM without load reports."""
    page = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0\n'
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 5\n'
        'vllm:request_success_total{engine="0",finished_reason="error",model_name="m"} 0\n'
    )
    store = SignalStore()
    store.record_scrape(KEY, ScrapeResult(health_status=200, metrics_text=page), now=0.0)
    c = store.counters(KEY)
    assert c.dialect == "vllm" and c.server_ok == 5
    assert not c.server_counts_failures


def test_seen_ready_takes_a_ready_health_answer_where_health_is_probed() -> None:
    """A page read while the health probe goes unanswered is heard, not seen ready; where
    health is not probed at all (the Prometheus source), a page read is all there is."""
    store = SignalStore()
    assert not store.seen_ready(KEY)
    page = ServerSample("vllm", running=0, waiting=0)
    store.record_scrape(KEY, ScrapeResult(health_error="timeout", sample=page, reached=True), now=1.0)
    assert store.heard(KEY) and not store.seen_ready(KEY)
    store.record_scrape(KEY, ScrapeResult(health_status=503, sample=page), now=2.0)
    assert not store.seen_ready(KEY)
    store.record_scrape(KEY, ScrapeResult(health_status=200, sample=page), now=3.0)
    assert store.seen_ready(KEY)
    store.record_scrape(KEY, ScrapeResult(health_status=503, sample=page), now=4.0)
    assert store.seen_ready(KEY)  # once seen ready, it was; readiness itself is ready=False
    other = ("m", "127.0.0.99:8000")
    store.record_scrape(other, ScrapeResult(sample=page), now=1.0)  # no health observed
    assert store.seen_ready(other)


def test_lora_adapters_reach_the_load_from_the_newest_page_and_age_with_it() -> None:
    from tests.unit.test_signals_parse import lora

    store = SignalStore()
    assert store.load(KEY, 1.0, 0.0).max_lora is None  # never scraped: unknown
    held = VLLM + lora("", at="1") + lora("sql,chat", "x", at="2")
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=held), now=10.0)
    load = store.load(KEY, 1.0, 10.5)
    assert (load.lora_running, load.lora_waiting, load.max_lora) == (("sql", "chat"), ("x",), 2)
    assert load.age_s == 0.5
    # A refused page keeps the last good sample, adapters and all, and they age with it.
    store.record_scrape(KEY, ScrapeResult(200, metrics_text="<html>oops</html>"), now=11.0)
    load = store.load(KEY, 1.0, 40.0)
    assert (load.lora_running, load.max_lora, load.age_s) == (("sql", "chat"), 2, 30.0)
    # A page whose gauge is refused (a name too long) reads its load, and no adapters.
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=VLLM + lora("x" * 257, at="3")), now=41.0)
    load = store.load(KEY, 1.0, 41.0)
    assert (load.running, load.lora_running, load.lora_waiting, load.max_lora) == (3.0, None, None, None)
    # None held: known, empty.
    store.record_scrape(KEY, ScrapeResult(200, metrics_text=VLLM + lora("", at="4")), now=42.0)
    assert (store.load(KEY, 1.0, 42.0).lora_running, store.load(KEY, 1.0, 42.0).max_lora) == ((), 2)
    # A server started again without --enable-lora: unknown again.
    store.record_scrape(KEY, OK, now=43.0)
    load = store.load(KEY, 1.0, 43.0)
    assert (load.lora_running, load.lora_waiting, load.max_lora) == (None, None, None)
