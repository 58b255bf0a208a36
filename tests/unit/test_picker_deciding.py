"""Picks first: the KV mirror's steps wait for the picks being decided (picker/kv_process.py's
Deciding), and the picker counts a pick as deciding from its request's headers to its answer's
sending, and never after, whatever way its stream goes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from controlplane.picker.kv_process import PICKS_FIRST_MAX_S, Deciding
from controlplane.picker.service import Picker, PickerMetrics
from tests.unit.test_picker_request import message


async def turns(n: int = 10) -> None:
    """Let the event loop run every ready task `n` times over (what a step waiting on nothing
    would need to finish)."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_with_no_pick_being_decided_a_step_goes_at_once() -> None:
    async def main() -> None:
        d = Deciding()
        await asyncio.wait_for(d.none(most_s=10.0), 0.5)

    asyncio.run(main())


def test_a_step_waits_for_the_pick_being_decided_then_goes() -> None:
    async def main() -> None:
        d = Deciding()
        d.start()
        d.start()
        waiting = asyncio.ensure_future(d.none(most_s=10.0))
        await turns()
        assert not waiting.done()
        d.end()
        await turns()
        assert not waiting.done()  # one pick is still being decided
        d.end()
        await asyncio.wait_for(waiting, 0.5)
        assert d.n == 0

    asyncio.run(main())


def test_under_picks_that_never_pause_a_step_still_goes_after_its_most() -> None:
    async def main() -> None:
        d = Deciding()
        d.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(d.none(), 1.0)
        assert loop.time() - t0 >= PICKS_FIRST_MAX_S * 0.9
        assert d.n == 1  # still deciding: the step went anyway

    asyncio.run(main())


def test_more_ends_than_starts_never_leave_the_count_below_zero() -> None:
    async def main() -> None:
        d = Deciding()
        d.end()
        assert d.n == 0
        await asyncio.wait_for(d.none(most_s=10.0), 0.5)
        d.start()
        assert d.n == 1

    asyncio.run(main())


def picker() -> Picker:
    return Picker("127.0.0.1:1", "node", PickerMetrics())


async def _stream(*reqs: ep.ProcessingRequest) -> AsyncIterator[ep.ProcessingRequest]:
    for r in reqs:
        yield r


@pytest.mark.parametrize("then", ["response_headers", "closed", "cancelled"])
def test_a_pick_counts_as_deciding_until_its_answer_is_sent_and_never_after(then: str) -> None:
    """While the answer to its headers is being sent (the generator suspended at its yield),
    the pick counts; once the stream asks for the next message, or ends or is cancelled
    there, it counts no more."""

    async def main() -> None:
        p = picker()
        reqs = [message("m@v1")]
        if then == "response_headers":
            reqs.append(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
        gen = p.Process(_stream(*reqs), None)
        first = await anext(gen)
        assert first.HasField("request_headers")
        assert p.deciding.n == 1  # the answer is being written
        if then == "cancelled":
            await gen.aclose()  # the stream reset right there
        elif then == "response_headers":
            await anext(gen)  # the response's headers, answered: the pick was decided long since
            assert p.deciding.n == 0
            async for _ in gen:
                pass
        else:
            async for _ in gen:
                pass
        assert p.deciding.n == 0

    asyncio.run(main())


def test_many_streams_one_after_another_leave_nothing_deciding() -> None:
    async def main() -> None:
        p = picker()
        for _ in range(50):
            async for _ in p.Process(
                _stream(message("m@v1"), ep.ProcessingRequest(response_headers=ep.HttpHeaders())), None
            ):
                pass
        assert p.deciding.n == 0
        assert p.deciding._none.is_set()

    asyncio.run(main())
