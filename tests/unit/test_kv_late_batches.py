"""A subscription that fell behind its publisher (a flood past its CPU budget: the messages
queue) does not trust what it reads late: a batch stamped more than limits.KV_EVENT_LAG_MAX_S
ago is not applied, the server's blocks are dropped once (`streams_lost{reason="late"}`), and
the first batch in time starts its stream again. Real ZMQ sockets on ipc:// (an XPUB, so the
test knows the subscription has reached it before it publishes), kvcache's subscriber."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from controlplane import limits
from controlplane.kvcache import wire
from controlplane.kvcache.index import KvIndex
from controlplane.picker.choose import PickerState
from controlplane.picker.kv_events import KvMetrics, KvSubscriptions
from tests.waits import until

SERVER = "127.0.0.1:8001"
OTHER = "127.0.0.1:8002"


def test_a_batch_read_too_late_drops_the_servers_blocks_and_a_batch_in_time_starts_again(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context.instance()
        pubs = {}
        for server in (SERVER, OTHER):
            pub = ctx.socket(zmq.XPUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(f"ipc://{tmp_path}/{server[-4:]}")
            pubs[server] = pub
        registry = CollectorRegistry()
        state = PickerState(kv=KvIndex())
        subs = KvSubscriptions(state, KvMetrics(registry))
        subs.update({s: (str(p.getsockopt(zmq.LAST_ENDPOINT), "ascii"), None) for s, p in pubs.items()})

        def sample(name: str, **labels: str) -> float:
            return registry.get_sample_value(name, {"server": SERVER, **labels}) or 0.0

        async def send(server: str, seq: int, age_s: float, hashes: list[int], parent: int | None) -> None:
            event = wire.stored(hashes, parent, list(range(16 * len(hashes))), 16)
            await pubs[server].send_multipart(list(wire.frames(seq, time.time() - age_s, [event])))

        try:
            for pub in pubs.values():
                assert (await pub.recv()) == b"\x01"  # subscribed: what is sent now is read
            await send(SERVER, 0, 0.0, [1, 2], None)
            await send(OTHER, 0, 0.0, [7], None)
            await until(lambda: state.kv.held_blocks(SERVER) == 2, "the batch in time is applied")
            await until(lambda: state.kv.held_blocks(OTHER) == 1, "the other server's too")
            late = limits.KV_EVENT_LAG_MAX_S + 3.0
            await send(SERVER, 1, late, [3], 2)
            await send(SERVER, 2, late, [4], 3)
            await until(lambda: sample("controlplane_picker_kv_batches_total", result="late") == 2, "read")
            assert state.kv.held_blocks(SERVER) == 0  # dropped, not trusted: the late ones not applied
            assert sample("controlplane_picker_kv_streams_lost_total", reason="late") == 1  # once
            assert sample("controlplane_picker_kv_event_lag_seconds") >= late
            assert state.kv.held_blocks(OTHER) == 1  # no other server's entries change
            # In time again (seq 3 follows 2: no gap is asked of a replay socket it has not got).
            await send(SERVER, 3, 0.0, [5, 6], None)
            await until(lambda: state.kv.held_blocks(SERVER) == 2, "the batch in time starts again")
            assert sample("controlplane_picker_kv_batches_total", result="applied") == 2
            assert sample("controlplane_picker_kv_streams_lost_total", reason="gap") == 0
            assert sample("controlplane_picker_kv_event_lag_seconds") < limits.KV_EVENT_LAG_MAX_S
        finally:
            await subs.close()
            for pub in pubs.values():
                pub.close(linger=0)

    asyncio.run(main())


def test_behind_it_skips_what_is_queued_and_starts_again_only_once_caught_up() -> None:
    """Once a batch is late, the batches queued behind it are skipped, in time or not (no
    indexing one and dropping it again); the first in time with nothing queued behind it starts
    the stream again. A batch between the lag bound and the threshold of a skewed clock (in
    time, nothing queued) is applied: only a lag past the bound, or a backlog, is skipped."""

    async def main() -> None:
        registry = CollectorRegistry()
        state = PickerState(kv=KvIndex())
        subs = KvSubscriptions(state, KvMetrics(registry))

        async def take(seq: int, age_s: float, hashes: list[int], queued: bool) -> None:
            event = wire.stored(hashes, None, [hashes[0]] * 16 * len(hashes), 16)  # a key each
            await subs._take(SERVER, list(wire.frames(seq, time.time() - age_s, [event])), None, queued)

        def count(name: str, **labels: str) -> float:
            return registry.get_sample_value(name, {"server": SERVER, **labels}) or 0.0

        late = limits.KV_EVENT_LAG_MAX_S + 1.0
        await take(0, limits.KV_EVENT_LAG_MAX_S - 1.0, [1], queued=False)  # slow, within the bound
        assert state.kv.held_blocks(SERVER) == 1
        await take(1, late, [2], queued=True)
        assert state.kv.held_blocks(SERVER) == 0
        await take(2, 0.0, [3], queued=True)  # in time, but a backlog behind it: skipped
        await take(3, 0.0, [4], queued=True)
        assert state.kv.held_blocks(SERVER) == 0
        assert count("controlplane_picker_kv_batches_total", result="late") == 3
        assert count("controlplane_picker_kv_streams_lost_total", reason="late") == 1  # once
        await take(4, 0.0, [5], queued=False)  # caught up: a new stream from here
        assert state.kv.held_blocks(SERVER) == 1
        await take(5, 0.0, [6], queued=True)  # not behind now: a backlog alone skips nothing
        assert state.kv.held_blocks(SERVER) == 2
        assert count("controlplane_picker_kv_batches_total", result="applied") == 3
        await subs.close()

    asyncio.run(main())
