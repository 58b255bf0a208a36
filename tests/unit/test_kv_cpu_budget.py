"""The index process's CPU budget (picker/kv_process.CpuBudget, --kv-index-cpu): at most
`share` of a core, every thread's CPU time counted, with a burst of at most share x
CPU_WINDOW_S; past it, the wait that pays the excess back. A fake clock and CPU counter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.picker.kv_process import CPU_WINDOW_S, CpuBudget

THROTTLED = "controlplane_picker_kv_throttled_seconds_total"


class Fake:
    def __init__(self) -> None:
        self.now, self.used = 100.0, 5.0

    def work(self, seconds: float) -> None:  # busy: wall time and CPU time alike
        self.now += seconds
        self.used += seconds


def budget(share: float) -> tuple[CpuBudget, Fake]:
    f = Fake()
    return CpuBudget(share, clock=lambda: f.now, cpu=lambda: f.used), f


def test_within_its_share_it_never_waits() -> None:
    b, f = budget(0.25)
    for _ in range(100):
        f.work(0.02)  # 20 ms busy, 60 ms idle: 0.25 of a core
        assert b.due() == 0.0
        f.now += 0.06


def test_past_its_share_it_waits_until_the_excess_is_paid_back() -> None:
    b, f = budget(0.25)
    f.work(0.05)  # 50 ms of CPU at once: it may burst 25 ms (what it earns meanwhile is past the cap)
    assert b.due() == pytest.approx((0.05 - 0.025) / 0.25)
    f.now += b.due()
    assert b.due() == pytest.approx(0.0)
    f.work(0.001)
    assert b.due() == pytest.approx((0.001 - 0.25 * 0.001) / 0.25)  # the burst spent: each step paid


def test_idle_time_banks_no_more_than_one_burst() -> None:
    b, f = budget(0.25)
    f.now += 3600.0
    f.work(0.5)
    assert b.due() == pytest.approx((0.5 - 0.025) / 0.25)


def test_a_step_longer_than_the_window_is_paid_for_in_full() -> None:
    b, f = budget(0.25)
    f.work(0.4)  # the table's rebuild, one step
    assert b.due() == pytest.approx((0.4 - 0.025) / 0.25)


def test_cpu_another_thread_spent_counts() -> None:
    b, f = budget(0.5)
    f.now += 0.01
    f.used += 0.08  # ZMQ's thread used CPU meanwhile
    assert b.due() == pytest.approx((0.08 - 0.05) / 0.5)


@given(
    share=st.floats(0.01, 4.0),
    bursts=st.lists(st.floats(0.0, 0.2), min_size=1, max_size=60),
)
def test_following_its_waits_holds_the_average_to_its_share(share: float, bursts: list[float]) -> None:
    """However the work comes, following its waits keeps the CPU time used within `share` of
    the wall time, plus the one burst it starts with."""
    b, f = budget(share)
    start_now, start_used = f.now, f.used
    for burst in bursts:
        f.work(burst)
        f.now += b.due()
    elapsed, used = f.now - start_now, f.used - start_used
    assert used <= share * elapsed + share * CPU_WINDOW_S + 1e-9


def test_the_index_process_stops_reading_for_what_its_budget_says_and_counts_it() -> None:
    import asyncio
    import time

    from prometheus_client import CollectorRegistry

    from controlplane.kvcache.index import KvIndex
    from controlplane.picker.choose import PickerState
    from controlplane.picker.kv_events import KvMetrics
    from controlplane.picker.kv_process import _Subscriptions

    async def main() -> None:
        registry = CollectorRegistry()
        b, f = budget(0.25)
        f.work(0.05)  # 25 ms past its burst: 0.1 s to pay back
        subs = _Subscriptions(
            PickerState(kv=KvIndex(journal=[])),
            KvMetrics(registry),
            busy_share=1.0,
            step_pause_s=0.0,
            drained=asyncio.Event(),
            cpu=b,
        )
        t0 = time.monotonic()
        await subs._budget()
        assert time.monotonic() - t0 >= 0.09
        assert registry.get_sample_value(THROTTLED) == pytest.approx(0.1)
        f.now += 1.0  # paid back, and more
        await subs._budget()
        assert registry.get_sample_value(THROTTLED) == pytest.approx(0.1)

    asyncio.run(main())
