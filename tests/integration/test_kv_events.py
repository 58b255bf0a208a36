"""The precise prefix index through a real Envoy (issue 43): two emulated servers publishing
vLLM's KV events (its wire format, with a replay socket) and tokenizing with the model's
tokenizer, a picker subscribed to both, the gateway handing it each prompt.

- A long prompt sent directly to a server, past the gateway, makes every later request that
  shares its first blocks go there through the gateway (the picker saw no such request: only
  the server's events tell); the same for the other server and another prompt. The servers'
  own prefix-cache counters show the hits.
- After the server restarts (a new stream: its sequence numbers start again), its old
  prompts are no longer sent to it for their cache.
- With the events off (no kv_events in the fleet file), the same requests do not follow the
  prompts: the test's claim fails without them.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane import limits
from controlplane.kvcache import wire
from controlplane.sim.tokenizer import make_tokenizer
from tests.integration.harness import (
    Client,
    ControlPlane,
    EmulatedFleet,
    Emulator,
    Operator,
    http_get,
    wait_until,
)
from tests.integration.test_picker import PickerProc
from tests.ports import free_port

pytestmark = pytest.mark.envoy

MODEL = "chat"
# What waits on the picker's index process: it runs under SCHED_IDLE, so on a machine whose
# cores are all busy (CI's test workers) it runs only in their gaps. 15 s was once too little.
INDEX_WAIT_S = 60
CLUSTER = f"{MODEL}@v1"
SYSTEM_A = "You are the assistant of the alpha team. " + " ".join(
    f"alpha rule {i}: be quick and brown." for i in range(60)
)
SYSTEM_B = "You are the assistant of the beta team. " + " ".join(
    f"beta rule {i}: the lazy dog waits." for i in range(60)
)
SYSTEM_C = "You are the assistant of the gamma team. " + " ".join(
    f"gamma rule {i}: jump over the fence." for i in range(60)
)


class Rig:
    def __init__(self, tmp: Path, events: bool, hostile: str | None = None) -> None:
        self.hostile = hostile  # a server whose publisher is the test's (it publishes nothing itself)
        self.tmp = tmp
        self.fleet = EmulatedFleet(tmp)
        self.tokenizer = make_tokenizer(tmp / "tokenizer")
        self.kv_ports: dict[str, tuple[int, int]] = {}
        self.picker: PickerProc | None = None
        self.events = events

    def start_server(self, name: str, port: int | None = None) -> Emulator:
        events, replay = self.kv_ports.setdefault(name, (free_port(), free_port()))
        kv = (
            {}
            if name == self.hostile
            else {"kv_events": f"tcp://127.0.0.1:{events}", "kv_replay": f"tcp://127.0.0.1:{replay}"}
        )
        server = Emulator(
            name,
            self.tmp,
            MODEL,
            port=port,
            slots=8,
            decode_ms_per_token=2,
            prefill_ms_per_token=1,
            tokenizer=self.tokenizer,
            **kv,
        )
        self.fleet.servers[name] = server
        return server

    def start(self) -> Rig:
        for name in ("a", "b"):
            self.start_server(name)
        picker_port = free_port()
        endpoints = []
        for name, server in self.fleet.servers.items():
            events, replay = self.kv_ports[name]
            kv = (
                f", kv_events: 'tcp://127.0.0.1:{events}', kv_replay: 'tcp://127.0.0.1:{replay}'"
                if self.events
                else ""
            )
            endpoints.append(f"          - {{address: '{server.address}'{kv}}}")
        text = "\n".join(
            [
                "listener: {port: %d}",
                "signals: {interval: 300ms, timeout: 250ms}",
                f"picker: {{endpoints: ['127.0.0.1:{picker_port}'], timeout: 1000ms}}",
                "tiers: {small: {timeout: 30s, balancing: picker}}",
                "models:",
                f"  {MODEL}:",
                "    params_b: 8",
                f"    tokenizer: '{self.tokenizer}'",
                "    stable: v1",
                "    versions:",
                "      v1:",
                "        endpoints:",
                *endpoints,
            ]
        )
        self.fleet.serve(text % self.fleet.listener + "\n")
        cp, envoy = self.fleet.cp, self.fleet.envoy
        assert cp is not None and envoy is not None
        admin = (cp.admin, cp.state_dir / "admin-token")
        self.picker = PickerProc("picker", cp.xds, self.tmp, picker_port, admin=admin).start()
        wait_until(
            lambda: [h for _, h in envoy.endpoints(CLUSTER).values()] == ["healthy"] * 2,
            20,
            "Envoy to have both servers healthy",
        )
        if self.events:  # the emulators' publishers reached (a hostile one is bound by its test)
            picker, reached = self.picker, 2 if self.hostile is None else 1
            wait_until(
                lambda: picker.metric("controlplane_picker_kv_publishers_connected") >= reached,
                20,
                "the picker to reach the servers' publishers",
            )
        return self

    def close(self) -> None:
        if self.picker is not None:
            self.picker.stop()
        self.fleet.close()


def chat(system: str, question: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2}).encode()


def direct(server: Emulator, body: bytes) -> None:
    req = urllib.request.Request(
        f"http://{server.address}/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def applied(picker: PickerProc, server: str) -> float:
    """The batches of `server`'s events the picker's index has applied."""
    return picker.metric(f'controlplane_picker_kv_batches_total{{result="applied",server="{server}"}}')


def via_gateway(rig: Rig, body: bytes) -> str:
    client = Client(rig.fleet.listener)
    try:
        r = client.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        assert r.status == 200, r
        return r.backend
    finally:
        client.close()


def settled(rig: Rig) -> None:
    """Wait until the picker has read both servers idle from the control plane (the direct
    requests' running counts out of the pages it ranks by)."""
    assert rig.fleet.cp is not None and rig.picker is not None
    idle_in_picker(rig.fleet.cp, rig.picker, 20.0)


def idle_in_picker(cp: ControlPlane, picker: PickerProc, timeout: float) -> None:
    """Wait until the control plane reads every server idle, then for two reads of the loads
    by the picker after that (so its ranking has them)."""
    from controlplane.v1 import endpoint_pb2

    op = Operator(cp)
    try:
        wait_until(
            lambda: all(
                e.HasField("running") and e.running == 0 and e.waiting == 0
                for e in op.endpoints.List(
                    endpoint_pb2.ListEndpointsRequest(), metadata=op.md, timeout=5
                ).endpoints
            ),
            timeout,
            "the control plane to read every server idle",
        )
    finally:
        op.close()
    reads = 'controlplane_picker_load_reads_total{result="ok"}'
    so_far = picker.metric(reads)
    wait_until(lambda: picker.metric(reads) >= so_far + 2, 10, "the picker to read the loads since")


def kv_lines(picker: PickerProc) -> str:
    _, page = http_get(f"http://127.0.0.1:{picker.metrics_port}/metrics")
    return "\n".join(line for line in page.splitlines() if "_kv_" in line and not line.startswith("#"))


def assert_follow(rig: Rig, system: str, server: Emulator) -> None:
    """Three requests sharing `system`'s prompt, sent through the gateway once the picks have
    settled, all go to `server`, each picked for its cache (kv_hit)."""
    assert rig.picker is not None
    settled(rig)
    kv_hits = rig.picker.metric('controlplane_picker_picks_total{reason="kv_hit"}')
    served = [via_gateway(rig, chat(system, f"question {i}")) for i in range(3)]
    assert served == [server.address] * 3, kv_lines(rig.picker)
    assert rig.picker.metric('controlplane_picker_picks_total{reason="kv_hit"}') - kv_hits == 3


def prefix_hits(server: Emulator) -> float:
    _, page = http_get(f"http://{server.address}/metrics")
    for line in page.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total{"):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:
    param = getattr(request, "param", True)
    r = Rig(tmp_path, events=bool(param), hostile=param if isinstance(param, str) else None)
    try:
        yield r.start()
    finally:
        r.close()


def test_prompts_sent_past_the_gateway_draw_their_followers_and_a_restart_ends_it(rig: Rig) -> None:
    a, b = rig.fleet.servers["a"], rig.fleet.servers["b"]
    assert rig.picker is not None
    picker = rig.picker
    # Each prompt warmed on the server a free choice would not give it first (ties go to a).
    direct(b, chat(SYSTEM_A, "warm up"))
    direct(a, chat(SYSTEM_B, "warm up"))
    wait_until(
        lambda: all(applied(picker, s.address) >= 1 for s in (a, b)),
        INDEX_WAIT_S,
        "the picker to index both servers' blocks from their events",
    )
    settled(rig)
    hits_before = {n: prefix_hits(s) for n, s in rig.fleet.servers.items()}
    served = [
        via_gateway(rig, chat(system, f"question {i}")) for system in (SYSTEM_A, SYSTEM_B) for i in range(3)
    ]
    assert served == [b.address] * 3 + [a.address] * 3, kv_lines(picker)
    assert picker.metric('controlplane_picker_picks_total{reason="kv_hit"}') == 6
    # The picks read the keys from the table the index's process writes (kvcache/table.py).
    assert picker.metric("controlplane_picker_kv_table_bytes") > 0
    assert picker.metric("controlplane_picker_kv_table_torn_reads_total") == 0
    for n, s in rig.fleet.servers.items():
        assert prefix_hits(s) - hits_before[n] >= 3 * 60 * 16, n  # each prompt's 60-odd blocks, 3 times

    # Server b (holding SYSTEM_A) restarts on its port: a new process, a new stream, an empty cache.
    b.stop()
    rig.start_server("b", port=b.port)
    b = rig.fleet.servers["b"]
    envoy = rig.fleet.envoy
    assert envoy is not None
    wait_until(
        lambda: envoy.endpoints(CLUSTER).get(b.address, ("", ""))[1] == "healthy", 30, "b back in Envoy"
    )
    lost = f'controlplane_picker_kv_streams_lost_total{{reason="reconnect",server="{b.address}"}}'
    wait_until(lambda: picker.metric(lost) >= 1, INDEX_WAIT_S, "the picker to drop what the old b held")
    settled(rig)
    kv_hits = picker.metric('controlplane_picker_picks_total{reason="kv_hit"}')
    before = {s.address: applied(picker, s.address) for s in (a, b)}
    # The first is sent to no server for its cache (none holds it now: b's old blocks are
    # dropped, not trusted): a free choice; the next follow it there, from that server's events,
    # once they are indexed (the index's process gets only CPU time nobody else wants: the real
    # vLLM twin of this test once saw the second picked before it had read them).
    served = [via_gateway(rig, chat(SYSTEM_A, "after 0"))]
    wait_until(
        lambda: applied(picker, served[0]) > before[served[0]], INDEX_WAIT_S, "the first's blocks indexed"
    )
    served += [via_gateway(rig, chat(SYSTEM_A, f"after {i}")) for i in range(1, 4)]
    assert picker.metric('controlplane_picker_picks_total{reason="kv_hit"}') - kv_hits == 3, (
        served,
        kv_lines(picker),
    )
    assert served[1:] == [served[0]] * 3, served


def index_process(picker: PickerProc) -> int:
    """The pid of the picker's index process (its one child)."""
    assert picker.proc is not None
    pid = picker.proc.popen.pid
    children = [c for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    assert len(children) == 1, children
    return int(children[0])


def test_the_index_process_killed_is_started_again_and_the_prompts_follow_again(rig: Rig) -> None:
    """The picker reads the events in a process of its own (picker/kv_process.py), under
    SCHED_IDLE. Killed, its blocks are forgotten (the picks meanwhile take the approximate
    index), a new one starts, reaches the publishers again and reads their replay buffers (the
    prompt cached before the kill draws its followers again), and the next prompt sent past
    the gateway draws its followers as before. No request fails meanwhile."""
    a, b = rig.fleet.servers["a"], rig.fleet.servers["b"]
    assert rig.picker is not None
    picker = rig.picker
    direct(b, chat(SYSTEM_A, "warm up"))
    wait_until(
        lambda: picker.metric("controlplane_picker_kv_index_blocks") > 0, INDEX_WAIT_S, "b's blocks indexed"
    )
    first = index_process(picker)
    # It takes only CPU time nothing else wants (SCHED_IDLE: a waking pick takes its core at once),
    # every thread of it: those its imports started before it lowered its priority (numpy's
    # BLAS pool) as well as ZMQ's, started after.
    threads = [int(t) for t in os.listdir(f"/proc/{first}/task")]
    assert len(threads) > 1
    assert {t: os.sched_getscheduler(t) for t in threads} == dict.fromkeys(threads, os.SCHED_IDLE)
    # And at most --kv-index-cpu of a core (its default here).
    argv = Path(f"/proc/{first}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--cpu") + 1] == str(limits.KV_INDEX_CPU).encode()
    os.kill(first, signal.SIGKILL)
    wait_until(
        lambda: picker.metric("controlplane_picker_kv_process_restarts_total") >= 1,
        INDEX_WAIT_S,
        "the restart counted",
    )
    served = [via_gateway(rig, chat(SYSTEM_B, f"meanwhile {i}")) for i in range(2)]  # none fails
    assert set(served) <= {a.address, b.address}
    wait_until(lambda: index_process(picker) != first, INDEX_WAIT_S, "a new index process")
    wait_until(
        lambda: picker.metric("controlplane_picker_kv_publishers_connected") >= 2,
        INDEX_WAIT_S,
        "the new process to reach both publishers",
    )
    # The new process read b's replay buffer as it connected: the prompt b cached before the
    # kill draws its followers to b again, with nothing new sent to b directly.
    b_filled = f'controlplane_picker_kv_replays_total{{result="filled",server="{b.address}"}}'
    wait_until(
        lambda: picker.metric(b_filled) >= 1, INDEX_WAIT_S, "b's replay buffer read by the new process"
    )
    assert_follow(rig, SYSTEM_A, b)
    assert picker.metric("controlplane_picker_kv_table_bytes") > 0  # a new table for the new process
    # Warmed on b, which a free choice would not give it (ties go to the server holding fewer).
    direct(b, chat(SYSTEM_C, "warm up"))
    wait_until(
        lambda: applied(picker, b.address) >= 1, INDEX_WAIT_S, "b's new blocks indexed by the new process"
    )
    assert_follow(rig, SYSTEM_C, b)


@pytest.mark.parametrize("rig", [False], indirect=True)
def test_without_the_events_the_prompts_do_not_draw_their_followers(rig: Rig) -> None:
    a, b = rig.fleet.servers["a"], rig.fleet.servers["b"]
    direct(b, chat(SYSTEM_A, "warm up"))
    direct(a, chat(SYSTEM_B, "warm up"))
    settled(rig)
    served = [
        via_gateway(rig, chat(system, f"question {i}")) for system in (SYSTEM_A, SYSTEM_B) for i in range(3)
    ]
    assert served != [b.address] * 3 + [a.address] * 3, served  # the test above fails without the events
    assert rig.picker is not None
    assert rig.picker.metric('controlplane_picker_picks_total{reason="kv_hit"}') == 0


@pytest.mark.parametrize("rig", ["b"], indirect=True)
def test_a_hostile_publisher_spoils_only_its_own_entries_and_fails_no_request(rig: Rig) -> None:
    """Server b's publisher is the test's: garbage frames, a batch too large, a wrong block size,
    the very hashes server a published for other tokens, a replay socket that never answers, then
    it vanishes. Server a's entries stay, its prompt still goes to it, no request fails."""
    import zmq

    a, b = rig.fleet.servers["a"], rig.fleet.servers["b"]
    assert rig.picker is not None
    picker = rig.picker
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{rig.kv_ports['b'][0]}")
    try:
        direct(a, chat(SYSTEM_A, "warm up"))
        wait_until(lambda: applied(picker, a.address) >= 1, INDEX_WAIT_S, "a's events indexed")
        settled(rig)
        blocks = picker.metric("controlplane_picker_kv_index_blocks")
        refused = f'controlplane_picker_kv_batches_total{{result="refused",server="{b.address}"}}'

        def flood() -> None:  # until the picker has taken some: ZMQ drops what a PUB sends before
            pub.send_multipart([b"", b"nonsense", b"\xc1\xc1"])
            wrong = wire.stored([1], None, list(range(7)), 8)
            wrong["block_size"] = 16  # 7 tokens for a block of 16
            pub.send_multipart(list(wire.frames(0, time.time(), [wrong])))
            # The very hashes a published, for other tokens.
            stolen = wire.stored(list(range(1, 40)), None, list(range(5, 5 + 39 * 16)), 16)
            pub.send_multipart(list(wire.frames(1, time.time(), [stolen])))

        def taken() -> bool:
            flood()
            return picker.metric(refused) >= 2 and applied(picker, b.address) >= 1

        wait_until(taken, 20, "the picker to take the hostile publisher's messages")
        # A gap its replay socket (nobody) never fills; a message past the bound (ZMQ drops the
        # connection for it), and the publisher vanishes.
        pub.send_multipart(list(wire.frames(300, time.time(), [wire.cleared()])))
        pub.send_multipart([b"", (301).to_bytes(8, "big"), b"\x00" * (5 << 20)])
        pub.close(0)  # and it vanishes
        served = [via_gateway(rig, chat(SYSTEM_A, f"question {i}")) for i in range(4)]
        assert served == [a.address] * 4, kv_lines(picker)
        assert picker.metric('controlplane_picker_picks_total{reason="kv_hit"}') == 4
        assert picker.metric("controlplane_picker_kv_index_blocks") >= blocks  # a's all there
    finally:
        pub.close(0)
        ctx.term()
