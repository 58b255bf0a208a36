"""The picker's index process (picker/kv_process.py) end to end, with its real child process and
a real ZMQ publisher (the emulator's) on ipc://: a server's stored blocks reach the picks
through the shared key table (kvcache/table.py), and, where the machine has no memfd, through
the picker's own copy of the keys; a restart of the server (AllBlocksCleared) empties it in
both, and the child's count of the server's blocks reaches the picker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
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


LOWER = """
import json, os, sys, threading
import numpy  # starts a thread of its own (the BLAS pool) before the priority is lowered
from controlplane.picker.kv_process import _lower_priority, _threads
done = threading.Event()
waiter = threading.Thread(target=done.wait)
waiter.start()
said = _lower_priority(sys.argv[1] == "idle", 7)
threads = _threads()
print(json.dumps({
    "said": said,
    "threads": len(threads),
    "policies": sorted({os.sched_getscheduler(t) for t in threads}),
    "nice": sorted({os.getpriority(os.PRIO_PROCESS, t) for t in threads}),
}))
done.set()
"""


@pytest.mark.parametrize("idle", [True, False])
def test_the_index_process_lowers_every_thread_it_has_not_only_the_first(idle: bool) -> None:
    """Linux keeps a policy and a nice value per thread, and a thread takes its creator's: the
    threads the child's imports started before it lowered its priority must be lowered too."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    got = json.loads(
        subprocess.run(
            [sys.executable, "-c", LOWER, "idle" if idle else "nice"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    assert got["threads"] >= 3  # the main thread, numpy's and the waiter
    if idle:
        assert (got["said"], got["policies"]) == ("idle", [os.SCHED_IDLE])
    else:
        want = ("nice 7", [os.SCHED_OTHER], [min(19, base + 7)])
        assert (got["said"], got["policies"], got["nice"]) == want
