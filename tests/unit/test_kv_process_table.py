"""The picker's index process (picker/kv_process.py) end to end, with its real child process and
a real ZMQ publisher (the emulator's) on ipc://: a server's stored blocks reach the picks
through the shared key table (kvcache/table.py), and, where the machine has no memfd, through
the picker's own copy of the keys; a restart of the server (AllBlocksCleared) empties it in
both, and the child's count of the server's blocks reaches the picker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controlplane.kvcache import wire
from controlplane.kvcache.blocks import prompt_keys
from controlplane.kvcache.mirror import KvMirror
from controlplane.picker.choose import PickerState
from controlplane.picker.kv_events import KvMetrics
from controlplane.picker.kv_process import KvProcess, KvProcessMetrics
from controlplane.sim.kv_publisher import KvPublisher
from tests.waits import until

SERVER = "127.0.0.1:8001"
TOKENS = list(range(100, 164))  # four blocks of 16
WAIT_S = 60.0  # the child runs under SCHED_IDLE: on a busy machine it may start late


@pytest.mark.parametrize("shared", [True, False], ids=["table", "no-memfd"])
def test_stored_blocks_reach_the_picks_and_a_clear_empties_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    if not shared:
        monkeypatch.setattr(KvProcess, "_new_table", lambda self: None)

    async def main() -> None:
        publisher = KvPublisher(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay")
        publisher.start()
        registry = CollectorRegistry()
        mirror = KvMirror(max_blocks=1 << 16)
        state = PickerState(kv=mirror)
        process = KvProcess(state, KvMetrics(registry, events=False), KvProcessMetrics(registry))
        process.update({SERVER: (publisher.endpoint, publisher.replay_endpoint)})
        keys = {16: prompt_keys(TOKENS, 16)}
        try:
            connected = "controlplane_picker_kv_publishers_connected"
            await until(
                lambda: registry.get_sample_value(connected), "the child reaches the publisher", WAIT_S
            )
            assert (mirror.table is not None) is shared
            assert bool(registry.get_sample_value("controlplane_picker_kv_table_bytes")) is shared
            publisher.stored([1, 2, 3, 4], None, TOKENS, 16)
            await until(lambda: mirror.matched([SERVER], keys) == {SERVER: 4}, "the blocks matched", WAIT_S)
            await until(lambda: mirror.held_blocks(SERVER) == 4, "the server's count of blocks", WAIT_S)
            publisher.publish([wire.cleared()])
            await until(lambda: mirror.matched([SERVER], keys) == {SERVER: 0}, "the clear seen", WAIT_S)
            publisher.stored([5, 6], None, TOKENS[:32], 16)
            await until(
                lambda: mirror.matched([SERVER], keys) == {SERVER: 2}, "the new blocks matched", WAIT_S
            )
        finally:
            await process.close()
            await publisher.stop()

    asyncio.run(main())
