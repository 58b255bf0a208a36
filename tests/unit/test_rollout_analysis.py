from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.rollout.analysis import analysis, figures, quantile, with_peer_reports
from controlplane.rollout.machine import UNSCRAPED
from controlplane.signals.parse import ServerSample
from controlplane.signals.store import EndpointCounters, ScrapeResult, SignalStore

INF = float("inf")


def test_quantile_interpolates_within_the_bucket() -> None:
    # 100 requests: 90 under 1 s, 10 between 1 and 2 s: p99 is 90% of the way into (1, 2].
    assert quantile({1.0: 90, 2.0: 100, INF: 100}, 0.99) == pytest.approx(1.9)
    assert quantile({1.0: 100, INF: 100}, 0.5) == pytest.approx(0.5)


def test_quantile_of_nothing_is_none_and_overflow_is_the_last_bound() -> None:
    assert quantile({}, 0.99) is None
    assert quantile({1.0: 0, INF: 0}, 0.99) is None
    assert quantile({1.0: 1, INF: 100}, 0.99) == 1.0


@given(st.lists(st.floats(min_value=0, max_value=1000), min_size=1, max_size=8))
def test_quantile_is_monotonic_in_q(counts: list[float]) -> None:
    cum, total = {}, 0.0
    for i, c in enumerate(counts):
        total += c
        cum[float(i + 1)] = total
    qs = [quantile(cum, q) for q in (0.1, 0.5, 0.9, 0.99)]
    if total == 0:
        assert qs == [None] * 4
    else:
        vals = [q for q in qs if q is not None]
        assert vals == sorted(vals)


def test_figures_take_the_step_delta_and_the_larger_source() -> None:
    base = {"a": EndpointCounters(server_ok=100, lrs_ok=90, lrs_failed=1), "b": EndpointCounters()}
    now = {
        "a": EndpointCounters(server_ok=150, lrs_ok=140, lrs_failed=11),  # 50 served, 10 5xx at the proxy
        "b": EndpointCounters(server_ok=10, lrs_ok=10),
    }
    f = figures(now, base, ["a", "b"])
    assert f.requests == 60 + 10  # a: max(50 server, 60 LRS); b: 10
    assert f.errors == 10
    assert f.error_rate == pytest.approx(10 / 70)


def test_a_restarted_server_counts_from_zero() -> None:
    base = {"a": EndpointCounters(server_ok=500, buckets=((1.0, 500), (INF, 500)))}
    now = {"a": EndpointCounters(server_ok=20, buckets=((1.0, 10), (INF, 20)))}
    f = figures(now, base, ["a"])
    assert f.requests == 20
    assert f.p99_s == 1.0  # half the requests are beyond 1 s: the overflow bucket


def test_analysis_compares_canary_and_stable_latency() -> None:
    base = {"c": EndpointCounters(), "s": EndpointCounters()}
    now = {
        "c": EndpointCounters(lrs_ok=100, buckets=((1.0, 0), (4.0, 100), (INF, 100))),
        "s": EndpointCounters(lrs_ok=100, buckets=((1.0, 100), (4.0, 100), (INF, 100))),
    }
    a = analysis(figures(now, base, ["c"]), figures(now, base, ["s"]))
    assert a.canary_requests == 100
    assert a.canary_p99_s is not None and a.stable_p99_s is not None
    assert a.canary_p99_s > 3 * a.stable_p99_s
    assert math.isclose(a.canary_error_rate, 0.0)


# ---- what could have been seen ---------------------------------------------------------------


def test_a_load_report_in_the_window_counts_even_with_zero_counts() -> None:
    base = {"a": EndpointCounters(lrs_reported_at=10.0), "b": EndpointCounters()}
    assert figures(base, base, ["a", "b"]).load_reports is False  # nothing new since the baseline
    zeros = {**base, "a": EndpointCounters(lrs_reported_at=11.0)}
    assert figures(zeros, base, ["a"]).load_reports is True
    first = {**base, "b": EndpointCounters(lrs_reported_at=11.0)}
    assert figures(first, base, ["b"]).load_reports is True
    counted = {**base, "b": EndpointCounters(lrs_ok=3)}  # the proxy went away since: counts stay
    assert figures(counted, base, ["b"]).load_reports is True


def test_servers_that_count_no_failures_are_named_by_dialect() -> None:
    now = {
        "v": EndpointCounters(dialect="vllm"),
        "s": EndpointCounters(dialect="sglang"),
        "t": EndpointCounters(dialect="tgi", server_counts_failures=True),
    }
    assert figures(now, {}, ["v", "s", "t"]).uncounted == ("sglang", "vllm")
    assert figures(now, {}, ["t"]).uncounted == ()
    assert figures(now, {}, ["never-scraped"]).uncounted == (UNSCRAPED,)


def test_the_analysis_carries_coverage_and_stable_traffic() -> None:
    base = {"c": EndpointCounters(dialect="vllm"), "s": EndpointCounters(dialect="vllm")}
    now = {
        "c": EndpointCounters(server_ok=5, dialect="vllm"),
        "s": EndpointCounters(server_ok=95, dialect="vllm", lrs_ok=90, lrs_reported_at=3.0),
    }
    a = analysis(figures(now, base, ["c"]), figures(now, base, ["s"]), window_s=7.0)
    # Proxies that report stable's endpoints would count the canary's 5xx too.
    assert (a.canary_requests, a.stable_requests, a.load_reports) == (5, 95, True)
    assert (a.canary_uncounted, a.window_s) == (("vllm",), 7.0)
    blind = analysis(figures(now, base, ["c"]), figures(base, base, ["s"]))
    assert blind.load_reports is False


def test_peer_replicas_reports_add_to_the_local_ones() -> None:
    local = EndpointCounters(server_ok=7, dialect="vllm", lrs_ok=10, lrs_failed=1, lrs_reported_at=5.0)
    merged = with_peer_reports(local, EndpointCounters(lrs_ok=4, lrs_failed=2, lrs_reported_at=9.0))
    assert (merged.server_ok, merged.dialect, merged.lrs_ok, merged.lrs_failed) == (7, "vllm", 14, 3)
    assert merged.lrs_reported_at == 9.0
    assert with_peer_reports(EndpointCounters(), EndpointCounters()).lrs_reported_at is None


def test_the_store_says_which_servers_count_failures_and_when_reports_came() -> None:
    store = SignalStore()
    key = ("m", "127.0.0.1:8000")
    assert store.counters(key) == EndpointCounters()
    for dialect, failures, counts in (
        ("vllm", None, False),
        ("sglang", None, False),
        ("tgi", None, True),  # TGI's failure counter appears with the first failure
        ("triton", 0.0, True),
    ):
        store.record_scrape(
            key, ScrapeResult(sample=ServerSample(dialect, successes=1.0, failures=failures)), 1.0
        )
        c = store.counters(key)
        assert (c.dialect, c.server_counts_failures) == (dialect, counts)
        store.retain(set())
    store.record_lrs(key, "envoy-1", in_progress=0, issued=0, succeeded=0, failed=0, now=20.0)
    store.record_lrs(key, "envoy-2", in_progress=0, issued=0, succeeded=0, failed=0, now=21.0)
    assert store.counters(key).lrs_reported_at == 21.0
