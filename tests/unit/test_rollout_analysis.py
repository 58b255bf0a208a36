from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.rollout.analysis import analysis, figures, quantile
from controlplane.signals.store import EndpointCounters

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
