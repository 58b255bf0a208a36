"""Scrape timeouts that count the time a collector ran (signals/stalls.py): the stall
bookkeeping with a fake clock, and `within` on a real event loop made to stand still."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.signals.stalls import LATE_S, MAX_EXTRA_S, TICK_S, LoopStalls, ScrapeTimeout


def test_ticks_on_time_lose_nothing() -> None:
    s = LoopStalls(0.0)
    for i in range(1, 101):
        s.tick(i * TICK_S)
    assert s.lost_between(0.0, 100 * TICK_S) == 0.0 and s.stalled_s == 0.0


def test_a_late_tick_counts_what_it_lost_within_the_window() -> None:
    s = LoopStalls(0.0)
    s.tick(0.05)
    s.tick(2.05)  # due at 0.10: stood still 1.95 s
    assert s.stalled_s == pytest.approx(1.95)
    assert s.lost_between(0.0, 2.1) == pytest.approx(1.95)
    # A scrape that started during the stall counts only its part of it.
    assert s.lost_between(1.55, 2.1) == pytest.approx(0.5)
    # One that started after it lost nothing.
    assert s.lost_between(2.06, 2.1) == 0.0


def test_the_stall_under_way_counts_before_the_ticker_has_run() -> None:
    # The scrape's timer can run before the ticker in the loop's first turn after a stall.
    s = LoopStalls(0.0)
    s.tick(0.05)
    assert s.lost_between(0.04, 3.0) == pytest.approx(3.0 - 0.05 - TICK_S)
    assert s.lost_between(1.0, 3.0) == pytest.approx(2.0)


def test_old_stalls_are_forgotten() -> None:
    s = LoopStalls(0.0)
    s.tick(5.0)
    t = 5.0
    for _ in range(3000):  # 150 s of ticks on time
        t += TICK_S
        s.tick(t)
    assert len(s._stalls) == 0 and s.stalled_s == pytest.approx(5.0 - TICK_S)


_GAP = st.floats(min_value=0.0, max_value=3.0).filter(lambda g: abs(g - LATE_S) > 1e-6)


@given(st.lists(_GAP, min_size=1, max_size=40), st.floats(0.0, 50.0))
def test_lost_time_is_never_more_than_the_window_nor_negative(gaps: list[float], start: float) -> None:
    s = LoopStalls(0.0)
    t = 0.0
    for g in gaps:
        t += TICK_S + g
        s.tick(t)
    now = t + 0.01
    lost = s.lost_between(min(start, now), now)
    assert 0.0 <= lost <= now - min(start, now) + 1e-9
    # Every late tick inside the window counts.
    assert s.lost_between(0.0, now) == pytest.approx(sum(g for g in gaps if g > LATE_S))


async def _stand_still(seconds: float) -> None:
    await asyncio.sleep(0.01)
    time.sleep(seconds)  # the whole loop stands still, as a starved or frozen process does


def _answer_soon(loop: asyncio.AbstractEventLoop) -> asyncio.Future[str]:
    """An answer that arrives at 0.05 s and takes a few loop turns to read, as an HTTP
    response does (bytes arrive, then the reader wakes, then the body is read)."""
    arrived: asyncio.Future[None] = loop.create_future()
    loop.call_later(0.05, arrived.set_result, None)

    async def read() -> str:
        await arrived
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return "answer"

    return asyncio.ensure_future(read())


def test_an_answer_that_came_while_the_loop_stood_still_is_not_a_timeout() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        stalls = LoopStalls(time.monotonic())
        ticker = asyncio.create_task(stalls.run())
        await asyncio.sleep(0.2)
        # The scenario is real: a plain timeout calls this answer late.
        still = asyncio.create_task(_stand_still(0.6))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_answer_soon(loop), 0.3)
        await still
        # With the stall counted, it is read.
        still = asyncio.create_task(_stand_still(0.6))
        result, extra = await stalls.within(_answer_soon(loop), 0.3)
        await still
        assert result == "answer" and 0.3 < extra < 1.0
        assert stalls.stalled_s > 0.5
        ticker.cancel()

    asyncio.run(main())


def test_a_hung_server_still_times_out_after_the_timeout_of_running_time() -> None:
    async def main() -> None:
        stalls = LoopStalls(time.monotonic())
        ticker = asyncio.create_task(stalls.run())
        never = asyncio.Event()
        started = time.monotonic()
        with pytest.raises(ScrapeTimeout) as e:
            await stalls.within(never.wait(), 0.3)
        assert 0.3 <= time.monotonic() - started < 0.3 + 1.0 + e.value.extra_s
        # And across a stall: the timeout plus the time lost, never forever.
        still = asyncio.create_task(_stand_still(0.5))
        started = time.monotonic()
        with pytest.raises(ScrapeTimeout) as e:
            await stalls.within(never.wait(), 0.3)
        took = time.monotonic() - started
        await still
        assert e.value.extra_s >= 0.4 and took >= 0.3 + 0.4
        assert took < 0.3 + e.value.extra_s + 1.0
        ticker.cancel()

    asyncio.run(main())


def test_extra_time_is_capped() -> None:
    s = LoopStalls(0.0)
    s.tick(0.05)
    assert min(s.lost_between(0.0, 1000.0), MAX_EXTRA_S) == MAX_EXTRA_S
