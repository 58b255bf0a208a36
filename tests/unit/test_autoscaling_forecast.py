"""Predictive pre-warm's forecasts (autoscaling/forecast.py): learnt by time of season,
chosen by backtest against the last value, trusted only when they beat it."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.autoscaling.forecast import (
    ColdStarts,
    Forecaster,
    History,
    Settings,
    fit,
    holt_winters,
    seasonal,
)
from controlplane.autoscaling.kpa import Scaler
from controlplane.fleet.model import ScalingPolicy

M = 48  # buckets per season


def daily(n: int, seed: int = 1, noise: float = 0.5, trend: float = 0.0) -> list[float]:
    """A daily shape: quiet nights, a morning rise to a peak of 20, plus noise."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phase = (i % M) / M
        shape = 2 + 18 * max(0.0, math.sin(math.pi * (phase - 0.25) / 0.5)) if 0.25 <= phase <= 0.75 else 2
        out.append(max(0.0, shape + trend * i + rng.gauss(0, noise)))
    return out


def test_a_daily_shape_is_forecast_by_a_seasonal_method_that_beats_the_last_value() -> None:
    values = daily(3 * M)
    method, ahead, errors, why = fit(values, M, 4)
    assert method in ("seasonal", "holt_winters"), why
    assert errors[method] < 0.5 * errors["naive"], errors
    # Just before the morning rise (bucket 0.25 of the season) the forecast 4 buckets ahead
    # is already above the quiet level; the last value is not.
    before_rise = values[: 2 * M + int(0.25 * M) - 2]
    method, ahead, _, _ = fit(before_rise, M, 4)
    assert method and max(ahead) > before_rise[-1] + 2, (ahead, before_rise[-1])


def test_a_random_walk_has_no_season_and_no_method_is_trusted() -> None:
    rng = random.Random(7)
    walk = [10.0]
    for _ in range(3 * M):
        walk.append(max(0.0, walk[-1] + rng.gauss(0, 1)))
    method, ahead, errors, why = fit(walk, M, 2)
    assert method == "" and ahead == [], (errors, why)
    assert "no method beats the last value" in why


def test_too_little_history_is_learning() -> None:
    method, _, _, why = fit(daily(M), M, 2)
    assert method == "" and why.startswith("learning")


def test_a_named_method_is_used_when_asked_even_if_another_is_better() -> None:
    values = daily(3 * M)
    for name in ("seasonal", "holt_winters"):
        assert fit(values, M, 3, name)[0] == name


def test_a_level_shift_is_followed_by_both_methods() -> None:
    values = daily(3 * M)
    shifted = values[: 2 * M] + [v + 10 for v in values[2 * M :]]
    for method in (seasonal, holt_winters):
        _, ahead = method(shifted, M, 1)
        expected = daily(3 * M + 1)[-1] + 10
        assert abs(ahead[0] - expected) < 4, (method.__name__, ahead, expected)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=200),
    st.integers(min_value=2, max_value=40),
    st.integers(min_value=1, max_value=10),
)
def test_forecasts_are_finite_and_never_negative(values: list[float], m: int, h: int) -> None:
    h = min(h, m)
    for method in (seasonal, holt_winters):
        back, ahead = method(values, m, h)
        assert len(back) == len(values) and len(ahead) == h
        assert all(math.isfinite(x) and x >= 0 for x in ahead)
        assert all(x is None or (math.isfinite(x) and x >= 0) for x in back)
    method, ahead, errors, _ = fit(values, m, h)
    assert all(math.isfinite(e) for e in errors.values())


def test_history_buckets_fill_gaps_from_the_season_before_and_round_trip() -> None:
    h = History(10.0, 40.0)  # 4 buckets a season
    for t in range(0, 200, 5):
        if 100 <= t < 120:  # down for two buckets
            continue
        h.add(1000.0 + t, float(t // 10 % 4))
    values, last = h.series()
    assert last == (1000 + 195) // 10 - 1
    assert values[10:12] == values[6:8]  # the gap is the same buckets a season before
    again = History.load(h.dump(), 10.0, 40.0)
    assert again is not None and again.buckets == h.buckets
    assert History.load(h.dump(), 5.0, 40.0) is None  # another bucket size: not mixed in


def test_history_keeps_a_few_seasons() -> None:
    h = History(1.0, 10.0)
    for t in range(200):
        h.add(float(t), 1.0)
    assert len(h.buckets) <= 3 * 10 + 1


def test_cold_start_lead_is_the_90th_percentile_of_what_was_seen() -> None:
    c = ColdStarts()
    assert c.lead("m", 30.0) == (30.0, False)
    for s in [10, 11, 12, 13, 14, 15, 16, 17, 18, 40]:
        c.observe("m", float(s))
    assert c.lead("m", 30.0) == (18.0, True)
    c.observe("m", math.inf)
    c.observe("m", -1)
    assert len(c.seen["m"]) == 10


def test_the_scaler_asks_for_replicas_a_cold_start_before_the_daily_rise() -> None:
    """End to end in the pure room: three seasons of a daily shape at one round a bucket; the
    predictive scaler has replicas up before the rise that the reactive one only asks for
    after it, sized by rate x time per request."""
    bucket = 10.0
    s = Settings(bucket, M * bucket, "auto", 40.0)  # a 40 s cold start: 4 buckets
    policy = ScalingPolicy(min_replicas=1, target_per_replica=4.0, stable_window_s=30, panic_window_s=10)
    f = Forecaster(refits_per_round=10)
    reactive, predictive = Scaler(), Scaler()
    values = daily(4 * M, noise=0.3)
    rise = 3 * M + int(0.25 * M)  # the last season's morning rise
    desired_r, desired_p = {}, {}
    reasons = []
    for i, v in enumerate(values):
        wall = i * bucket + 1
        # v requests/s arrive, each takes 1 s in a slot: v run, v x bucket complete a round.
        f.record("m", s, wall, v, v, v * bucket)
        f.refit({"m": s})
        p = f.predict("m", s, wall)
        desired_r[i] = reactive.decide(policy, wall, v, 1).desired
        d = predictive.decide(policy, wall, v, 1, predicted=p)
        desired_p[i] = d.desired
        if rise - 4 <= i <= rise:
            reasons.append(d.reason)
            assert d.forecast_method and d.predicted_demand is not None and d.lead_s == 40.0
            assert f.predict("m", s, wall) is not None
            assert abs(f._flows["m"].service_s - 1.0) < 0.05  # type: ignore[operator]
    assert any(r.startswith("pre-warm") for r in reasons), reasons
    ahead = rise + 4  # 4 buckets into the rise
    assert desired_p[rise] > desired_r[rise] >= 1
    assert desired_p[ahead - 1] >= math.ceil(values[ahead] / 4) - 1
    # Quiet nights stay quiet: pre-warm does not hold replicas the night does not need.
    night = 3 * M + 2
    assert desired_p[night] == desired_r[night]


def test_arrivals_are_what_completed_plus_what_the_demand_grew_by() -> None:
    s = Settings(10.0, 400.0, "auto", 10.0)
    f = Forecaster()
    f.record("m", s, 0.0, 0, 0, 0)
    f.record("m", s, 5.0, 10, 4, 20)  # 20 finished and 10 more wait or run: 30 in 5 s
    f.record("m", s, 10.0, 10, 4, 10)  # steady: 10 in 5 s
    assert f.histories["m"].buckets == {0: 6.0}  # the first bucket (0-10 s) closed by the sample at 10 s
    assert f._flows["m"].service_s is not None
    f.record("m", s, 200.0, 0, 0, 0)  # a pause: no rate from it
    assert 19 not in f.histories["m"].buckets


def test_a_restored_history_comes_back_for_the_same_settings_only() -> None:
    s = Settings(10.0, 400.0, "auto", 10.0)
    f = Forecaster()
    for i in range(50):
        f.record("m", s, i * 10.0, 1, 1, 10)
    f.cold_starts.observe("m", 12.0)
    saved = f.dump()
    g = Forecaster()
    assert g.restore(saved) == 1
    g.record("m", s, 500.0, 1, 1, 10)
    assert g.histories["m"].buckets == f.histories["m"].buckets
    assert g.cold_starts.lead("m", 30.0) == (12.0, True)
    other = Forecaster()
    other.restore(saved)
    other.record("m", Settings(5.0, 400.0, "auto", 10.0), 500.0, 1, 1, 10)
    assert other.histories["m"].buckets == {}  # another bucket size: learnt afresh
    damaged = Forecaster()
    assert damaged.restore({"models": {"m": {"bucket_s": "x"}}, "cold_starts": {"m": ["y", 3.0]}}) == 1
    damaged.record("m", s, 500.0, 1, 1, 10)  # a damaged file: learnt afresh, no crash
    assert damaged.histories["m"].buckets == {} and damaged.cold_starts.lead("m", 30.0) == (3.0, True)
