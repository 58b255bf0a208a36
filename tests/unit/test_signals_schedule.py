from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.signals.schedule import JITTER, MAX_BACKOFF_S, Schedule, phase
from controlplane.signals.store import UNREACHABLE_AFTER


def keys(n: int) -> list[tuple[str, str]]:
    return [("m", f"127.0.{i // 250}.{i % 250 + 1}:8000") for i in range(n)]


def test_a_fleet_is_spread_over_the_interval_not_burst_at_its_top() -> None:
    s = Schedule(1.0)
    s.set_targets(keys(2000), now=0.0)
    buckets = [0] * 10
    for _, due in s.due(1.0):
        buckets[min(9, int(due * 10))] += 1
    assert sum(buckets) == 2000
    assert max(buckets) < 2000 * 0.15, buckets  # about a tenth in every tenth of the interval
    assert s.due(100.0) == []  # taken off until done


def test_an_endpoint_keeps_its_phase_and_a_late_scrape_skips_ahead() -> None:
    s = Schedule(1.0)
    [key] = keys(1)
    s.set_targets([key], now=10.0)
    [(k, due)] = s.due(11.0)
    assert due == pytest.approx(10.0 + phase(key[1]))
    assert s.done(k, due, reached=True, now=due + 0.2) == pytest.approx(due + 1.0)
    [(_, due2)] = s.due(due + 1.0)
    # A scrape that ended 2.5 intervals late: the next is at the phase, in the future.
    nxt = s.done(k, due2, reached=True, now=due2 + 2.5)
    assert nxt is not None and nxt > due2 + 2.5
    assert (nxt - due) % 1.0 == pytest.approx(0.0, abs=1e-9) or (nxt - due) % 1.0 == pytest.approx(1.0)


def test_unreachable_endpoints_back_off_after_the_hold_out_threshold_and_come_back_at_once() -> None:
    s = Schedule(1.0, seed=7)
    [key] = keys(1)
    s.set_targets([key], now=0.0, first=True)
    now = 0.0
    gaps = []
    for _ in range(12):
        [(k, due)] = s.due(now)
        nxt = s.done(k, due, reached=False, now=now + 0.5)
        assert nxt is not None
        gaps.append(nxt - now)
        now = nxt
    assert all(g == pytest.approx(1.0) for g in gaps[:UNREACHABLE_AFTER])  # held out on time
    later = gaps[UNREACHABLE_AFTER:]
    assert later[0] >= 1.5 and later[-1] <= MAX_BACKOFF_S * (1 + JITTER) + 0.5
    assert max(later) > 10.0  # grown towards the cap
    assert s.backing_off() == 1
    [(k, due)] = s.due(now)
    nxt = s.done(k, due, reached=True, now=now + 0.1)
    assert nxt == pytest.approx(due + 1.0) and s.backing_off() == 0


def test_removed_targets_are_not_rescheduled_and_a_new_interval_rephases() -> None:
    s = Schedule(1.0)
    a, b = keys(2)
    s.set_targets([a, b], now=0.0, first=True)
    got = dict(s.due(0.0))
    s.set_targets([b], now=0.0)
    assert s.done(a, got[a], reached=True, now=0.1) is None
    assert s.done(b, got[b], reached=True, now=0.1) == pytest.approx(1.0)
    s.set_interval(5.0, now=0.2)
    assert s.next_due() == pytest.approx(0.2 + phase(b[1]) * 5.0)
    assert len(s) == 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 19), st.booleans(), st.floats(0.0, 3.0)),
        max_size=200,
    )
)
def test_every_target_always_has_exactly_one_next_scrape_in_the_future(
    steps: list[tuple[int, bool, float]],
) -> None:
    s = Schedule(0.5, seed=1)
    targets = keys(20)
    s.set_targets(targets, now=0.0)
    now = 0.0
    in_progress: dict[tuple[str, str], float] = {}
    for i, reached, dt in steps:
        now += dt
        for k, due in s.due(now):
            assert k not in in_progress
            in_progress[k] = due
        key = targets[i]
        if key in in_progress:
            nxt = s.done(key, in_progress.pop(key), reached, now)
            assert nxt is not None and nxt > now
    # Every target is either being scraped or has a time to be.
    scheduled = {k for k, _ in s.due(now + 10 * MAX_BACKOFF_S)}
    assert scheduled | set(in_progress) == set(targets)
    assert not scheduled & set(in_progress)
