"""Batches that reach the index only by replay (a server published before the subscription
reached it) are counted as live ones are: `controlplane_picker_kv_batches_total{result}`
shows the server's batches applied, as its blocks are indexed. Real ZMQ sockets (a publisher
as the emulator's, kvcache's subscriber), on ipc:// in a temporary directory."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry

from controlplane.kvcache.index import KvIndex
from controlplane.picker.choose import PickerState
from controlplane.picker.kv_events import KvMetrics, KvSubscriptions
from controlplane.sim.kv_publisher import KvPublisher
from tests.waits import until

SERVER = "127.0.0.1:8001"


def test_blocks_published_before_the_subscription_are_replayed_and_counted_applied(tmp_path: Path) -> None:
    async def main() -> None:
        publisher = KvPublisher(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay")
        publisher.start()
        # Published before anyone subscribes: a PUB socket drops it; only the replay has it.
        publisher.stored([11, 12], None, list(range(32)), 16)
        registry = CollectorRegistry()
        state = PickerState(kv=KvIndex())
        subs = KvSubscriptions(state, KvMetrics(registry))
        subs.update({SERVER: (publisher.endpoint, publisher.replay_endpoint)})
        labels = {"server": SERVER, "result": "applied"}
        replays = {"server": SERVER, "result": "filled"}
        try:
            # The replay counted as filled: every batch it brought has been applied by then.
            await until(
                lambda: registry.get_sample_value("controlplane_picker_kv_replays_total", replays),
                "the replay is read",
            )
            assert state.kv.held_blocks(SERVER) == 2  # the replay brought them
            assert registry.get_sample_value("controlplane_picker_kv_batches_total", labels) == 1
            assert registry.get_sample_value("controlplane_picker_kv_replays_total", replays) == 1
        finally:
            await subs.close()
            await publisher.stop()

    asyncio.run(main())
