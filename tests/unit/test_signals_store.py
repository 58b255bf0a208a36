from __future__ import annotations

import itertools
import math

from controlplane.balancing.policies import PolicyConfig, adaptive
from controlplane.signals.store import UNREACHABLE_AFTER, ScrapeResult, SignalStore
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
