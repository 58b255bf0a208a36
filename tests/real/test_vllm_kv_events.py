"""The precise prefix index against two real vLLM servers (issue 43): vLLM's CPU build, the
tests' tiny model (its tokenizer and chat template made by transformers), each server
publishing its KV events (`--kv-events-config`, on ipc:// paths: nothing listens beyond this
host), behind a real Envoy and a picker.

- A long prompt sent directly to one server, not through the gateway, makes every later
  request sharing it go through the gateway to that server; the same for the other server and
  another prompt. The servers' own `vllm:prefix_cache_hits` counters show the hits.
- After the server restarts, its old prompts are no longer sent to it for their cache.
- Without the events the same requests do not follow the prompts (each prompt is warmed on
  the server a free choice would not give it first): the emulated twin of this test,
  tests/integration/test_kv_events.py, runs that case.

Run with `-n 0` (two vLLMs for the module; see tests/real/test_vllm.py for the CPU pinning).
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.harness import Client, ControlPlane, Envoy, http_get, wait_until
from tests.integration.test_kv_events import applied as kv_applied
from tests.integration.test_kv_events import idle_in_picker
from tests.integration.test_picker import PickerProc
from tests.ports import free_port
from tests.real.test_vllm import MAKE_MODEL, MODEL, STARTUP_S, VllmServer

pytestmark = [pytest.mark.real, pytest.mark.envoy, pytest.mark.timeout(2 * STARTUP_S + 600)]
CLUSTER = f"{MODEL}@v1"
# About 700 tokens with the tiny model's tokenizer: 5 of vLLM's CPU blocks of 128.
SYSTEM_A = "You are the assistant of the alpha team. " + " ".join(f"Rule {i}: be quick." for i in range(45))
SYSTEM_B = "You are the assistant of the beta team. " + " ".join(
    f"Law {i}: the dog waits." for i in range(40)
)


@dataclass
class Stack:
    tmp: Path
    model: Path
    servers: list[VllmServer]
    cp: ControlPlane
    envoy: Envoy
    picker: PickerProc
    listener: int


def kv_server(python: str, model: Path, tmp: Path, port: int, n: int) -> VllmServer:
    server = VllmServer(python, model, tmp, port)
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp}/kv-{n}",
        "replay_endpoint": f"ipc://{tmp}/kv-{n}-replay",
    }
    server.args += ["--kv-events-config", json.dumps(config)]
    return server


def start_all(servers: list[VllmServer]) -> None:
    """Start them from this (the main) thread, which outlives them: the parent-death signal
    follows the thread that started a process. Each loads in the background."""
    for s in servers:
        s.start()


@pytest.fixture(scope="module")
def stack(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("vllm-kv")
    model = tmp / MODEL
    made = subprocess.run(
        [vllm_python, str(MAKE_MODEL), str(model)], capture_output=True, text=True, timeout=600
    )
    assert made.returncode == 0, made.stdout + made.stderr[-3000:]
    ports = [free_port(), free_port()]
    listener, picker_port = free_port(), free_port()
    endpoints = "\n".join(
        f"          - {{address: '127.0.0.1:{p}', kv_events: 'ipc://{tmp}/kv-{n}', kv_replay: 'ipc://{tmp}/kv-{n}-replay'}}"
        for n, p in enumerate(ports)
    )
    config = tmp / "fleet.yaml"
    config.write_text(
        f"listener: {{port: {listener}}}\n"
        "signals: {interval: 300ms, timeout: 250ms}\n"
        f"picker: {{endpoints: ['127.0.0.1:{picker_port}'], timeout: 1000ms}}\n"
        f"tiers: {{small: {{timeout: {STARTUP_S:.0f}s, balancing: picker}}}}\n"
        "models:\n"
        f"  {MODEL}:\n"
        "    params_b: 1\n"
        f"    tokenizer: '{model}'\n"
        "    stable: v1\n"
        "    versions:\n"
        "      v1:\n"
        "        endpoints:\n"
        f"{endpoints}\n"
    )
    servers = [kv_server(vllm_python, model, tmp, p, n) for n, p in enumerate(ports)]
    cp = ControlPlane(config, tmp)
    envoy = Envoy("envoy-1", cp.xds, tmp, listener)
    picker: PickerProc | None = None
    try:
        cp.start()
        envoy.start()
        picker = PickerProc(
            "picker", cp.xds, tmp, picker_port, admin=(cp.admin, cp.state_dir / "admin-token")
        )
        picker.start()
        start_all(servers)
        for s in servers:
            s.wait_ready()
        wait_until(
            lambda: [h for _, h in envoy.endpoints(CLUSTER).values()] == ["healthy"] * 2,
            STARTUP_S,
            "Envoy to have both vLLMs healthy",
        )
        wait_until(
            lambda: picker.metric("controlplane_picker_kv_publishers_connected") >= 2,  # type: ignore[union-attr]
            STARTUP_S,
            "the picker to reach both vLLMs' publishers",
        )
        yield Stack(tmp, model, servers, cp, envoy, picker, listener)
    finally:
        for s in servers:
            s.stop()
        if picker is not None:
            picker.stop()
        envoy.stop()
        cp.stop()


def chat(system: str, question: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2}).encode()


def direct(server: VllmServer, body: bytes) -> None:
    req = urllib.request.Request(
        server.base + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def via_gateway(stack: Stack, body: bytes, request_id: str) -> str:
    """Send through the gateway; the server the picker named (its log, by request id), which
    the picker's served readback confirms it went to."""
    client = Client(stack.listener)
    try:
        r = client.request(
            "POST",
            "/v1/chat/completions",
            body,
            {"content-type": "application/json", "x-request-id": request_id},
        )
        assert r.status == 200, r
    finally:
        client.close()
    wait_until(lambda: request_id in stack.picker.picks(), 10, f"the picker to log {request_id}")
    return stack.picker.picks()[request_id]


def prefix_hits(server: VllmServer) -> float:
    page = server.metrics()
    return sum(
        float(line.split()[-1])
        for line in page.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


def settled(stack: Stack) -> None:
    idle_in_picker(stack.cp, stack.picker, 60.0)


def applied(stack: Stack, server: VllmServer) -> float:
    return kv_applied(stack.picker, server.address)


def test_prompts_sent_past_the_gateway_draw_their_followers_to_the_vllm_that_holds_them(stack: Stack) -> None:
    one, two = stack.servers
    picker = stack.picker
    direct(two, chat(SYSTEM_A, "warm up"))  # each on the server a free choice would not give it first
    direct(one, chat(SYSTEM_B, "warm up"))
    wait_until(
        lambda: applied(stack, one) >= 1 and applied(stack, two) >= 1, 30, "both vLLMs' events indexed"
    )
    settled(stack)
    hits = [prefix_hits(s) for s in stack.servers]
    served = [
        via_gateway(stack, chat(system, f"question {i}"), f"q-{k}-{i}")
        for k, system in enumerate((SYSTEM_A, SYSTEM_B))
        for i in range(3)
    ]
    assert served == [two.address] * 3 + [one.address] * 3, served
    assert picker.metric('controlplane_picker_picks_total{reason="kv_hit"}') == 6
    assert picker.metric('controlplane_picker_served_total{where="picked"}') >= 6
    # vLLM's own counters: each follower found its system prompt's blocks (5 of 128 tokens).
    for server, before in zip(stack.servers, hits, strict=True):
        assert prefix_hits(server) - before >= 3 * 4 * 128, server.address

    # vLLM two restarts: a new process, a new stream, an empty cache.
    two.stop()
    two.proc = None
    two.ready_at = None
    start_all([two])
    two.wait_ready()
    wait_until(
        lambda: stack.envoy.endpoints(CLUSTER).get(two.address, ("", ""))[1] == "healthy",
        STARTUP_S,
        "two back",
    )
    lost = f'controlplane_picker_kv_streams_lost_total{{reason="reconnect",server="{two.address}"}}'
    wait_until(lambda: picker.metric(lost) >= 1, 30, "the picker to drop what the old vLLM two held")
    settled(stack)
    kv_hits = picker.metric('controlplane_picker_picks_total{reason="kv_hit"}')
    before = {s.address: applied(stack, s) for s in stack.servers}
    # The first goes to no server for its cache (none holds it: two's old blocks are dropped),
    # the next follow it wherever it went, from that vLLM's new events: once they are indexed.
    # (Sent the moment the first is answered, the second may be picked before the index's
    # process, which gets only CPU time nobody else wants, has read them: CI saw that once.)
    after = [via_gateway(stack, chat(SYSTEM_A, "after 0"), "after-0")]
    first = next(s for s in stack.servers if s.address == after[0])
    wait_until(lambda: applied(stack, first) > before[first.address], 30, "the first's blocks indexed")
    after += [via_gateway(stack, chat(SYSTEM_A, f"after {i}"), f"after-{i}") for i in range(1, 4)]
    assert picker.metric('controlplane_picker_picks_total{reason="kv_hit"}') - kv_hits == 3, after
    assert after[1:] == [after[0]] * 3, after
    print(f"\nvLLM kv events: served {served}, after the restart {after}")
    _, page = http_get(f"http://127.0.0.1:{picker.metrics_port}/metrics")
    print("\n".join(line for line in page.splitlines() if "_kv_" in line and not line.startswith("#"))[:3000])
