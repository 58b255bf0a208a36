"""LoRA adapters on two real vLLM servers behind a real Envoy and the picker (issue 45): vLLM's
CPU build, the tests' tiny model, random rank-8 adapters made here (tests/real/vllm_model.py
--lora), each server with `--enable-lora --max-loras 1`, lora-a registered on the first only
and lora-b on the second only (--lora-modules); the emulated twin of these tests is
tests/integration/test_adapters.py.

- Every request naming lora-a (in the body or x-model) is served by the first vLLM, every one
  naming lora-b by the second, all 200: each server's own page counts exactly its requests
  and names only its adapter.
- Without the picker (the tier without `balancing: picker`), Envoy alone keeps them so too:
  lora-a and lora-b are restricted to one server each (`endpoints:`), which makes each a
  subset of the cluster (the no-hop path).
- Without the routing (no picker, and a fleet file that does not say which server holds
  which adapter, with `affinity: false`) the same requests go by the weights alone, and
  those sent to the vLLM without the adapter get its 404.
- lora-c, which no server has, is loaded by the picker through vLLM's runtime API
  (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) onto one server before its first request goes:
  served there, and that server's /v1/models lists it.
- An adapter the fleet does not have gets the gateway's 404, as any unknown model.

The model is `placement: dynamic` (a server belongs to one model, so lora-c cannot be in a
model of its own on the same servers): lora-a and lora-b, which the servers have from their
start, are "loaded" by the picker too on their first request, and vLLM answers 400 "has
already been loaded", which the picker takes as loaded.

What vLLM 0.32 printed on its page, by hand, with one request of lora-a running and none
waiting, after one of lora-c had ended (a series per label set, its value the Unix time it
was last set, never removed; each series' value here on the line below it): both lists name
every adapter with a request in flight, running or waiting alike (vllm/v1/metrics/stats.py
keys both by every adapter with a request either way), so a running adapter cannot be told
from a waiting one; the series of an adapter stays after its requests end.

    vllm:num_requests_running{engine="0",model_name="tiny-random-llama"} 1.0
    vllm:num_requests_waiting{engine="0",model_name="tiny-random-llama"} 0.0
    vllm:lora_requests_info{max_lora="1",running_lora_adapters="lora-a",waiting_lora_adapters="lora-a"}
        1.7966030884725082e+09
    vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}
        1.7966030850605128e+09
    vllm:lora_requests_info{max_lora="1",running_lora_adapters="lora-c",waiting_lora_adapters="lora-c"}
        1.796603085038747e+09

Run with `-n 0` (two vLLMs for the module; see tests/real/test_vllm.py for the CPU pinning).
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.harness import ControlPlane, Envoy, http_get, wait_until
from tests.integration.test_adapters import complete
from tests.integration.test_picker import PickerProc
from tests.ports import free_port
from tests.real.test_vllm import MAKE_MODEL, MODEL, STARTUP_S, VllmServer

pytestmark = [pytest.mark.real, pytest.mark.envoy, pytest.mark.timeout(2 * STARTUP_S + 600)]
CLUSTER = f"{MODEL}@v1"
ADAPTERS = ("lora-a", "lora-b", "lora-c")  # on the first server, on the second, on neither
SENT = {"lora-a": 6, "lora-b": 4}  # unequal: each server's count tells whose requests it had


@dataclass
class Vllms:
    tmp: Path  # the model and the adapters' directories
    servers: list[VllmServer]


@dataclass
class Rig:
    servers: list[VllmServer]
    cp: ControlPlane
    envoy: Envoy
    picker: PickerProc | None
    listener: int


def fleet(
    tmp: Path, servers: list[VllmServer], listener: int, picker: int, picked: bool, known: bool = True
) -> str:
    """`known`: the fleet file says which server has lora-a and lora-b (else neither that nor
    adapter hashing: Envoy's weighted least request, blind to adapters)."""
    one, two = (s.address for s in servers)
    if not known:
        one_only = two_only = ""
    else:
        one_only, two_only = f", endpoints: ['{one}']", f", endpoints: ['{two}']"
    return (
        f"listener: {{port: {listener}}}\n"
        "signals: {interval: 300ms, timeout: 250ms}\n"
        f"picker: {{endpoints: ['127.0.0.1:{picker}'], timeout: 1000ms}}\n"
        f"tiers: {{small: {{timeout: 120s{', balancing: picker' if picked else ''}}}}}\n"
        "models:\n"
        f"  {MODEL}:\n"
        "    params_b: 1\n"
        "    stable: v1\n"
        "    placement: dynamic\n"
        f"{'' if known else '    affinity: false'}\n"
        "    adapters:\n"
        f"      lora-a: {{source: '{tmp}/lora-a'{one_only}}}\n"
        f"      lora-b: {{source: '{tmp}/lora-b'{two_only}}}\n"
        f"      lora-c: {{source: '{tmp}/lora-c'}}\n"
        f"    versions: {{v1: {{endpoints: ['{one}', '{two}']}}}}\n"
    )


def lora_server(python: str, tmp: Path, adapter: str) -> VllmServer:
    server = VllmServer(python, tmp / MODEL, tmp, free_port())
    server.args += [
        "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
        "--lora-modules", f"{adapter}={tmp / adapter}",
    ]  # fmt: skip
    server.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # POST /v1/load_lora_adapter
    return server


def make(python: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [python, str(MAKE_MODEL), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def made(procs: list[subprocess.Popen[str]]) -> None:
    """Wait for every maker (killed if one outlasts the timeout), then check each."""
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err[-3000:]


def gateway(vllms: Vllms, tmp: Path, picked: bool, known: bool = True) -> Rig:
    """A control plane and an Envoy (and, picked, the picker) over the running servers, once
    Envoy has both healthy; whatever started is stopped if that fails."""
    servers = vllms.servers
    listener, picker_port = free_port(), free_port()
    config = tmp / "fleet.yaml"
    config.write_text(fleet(vllms.tmp, servers, listener, picker_port, picked, known))
    cp = ControlPlane(config, tmp)
    envoy = Envoy("envoy-1", cp.xds, tmp, listener)
    picker: PickerProc | None = None
    try:
        cp.start()
        envoy.start()
        if picked:
            admin = (cp.admin, cp.state_dir / "admin-token")
            picker = PickerProc("picker", cp.xds, tmp, picker_port, admin=admin).start()
        wait_until(
            lambda: [h for _, h in envoy.endpoints(CLUSTER).values()] == ["healthy"] * 2,
            60,
            "Envoy to have both vLLMs healthy",
        )
        return Rig(servers, cp, envoy, picker, listener)
    except BaseException:
        close(Rig(servers, cp, envoy, picker, listener))
        raise


def close(rig: Rig) -> None:
    if rig.picker is not None:
        rig.picker.stop()
    rig.envoy.stop()
    rig.cp.stop()


@pytest.fixture(scope="module")
def vllms(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllms]:
    """The model, its three adapters, and two vLLMs with lora-a and lora-b, up."""
    tmp = tmp_path_factory.mktemp("vllm-lora")
    made([make(vllm_python, str(tmp / MODEL))])
    made(
        [
            make(vllm_python, "--lora", str(tmp / MODEL), str(tmp / a), "--seed", str(n))
            for n, a in enumerate(ADAPTERS)
        ]
    )
    started = [lora_server(vllm_python, tmp, "lora-a"), lora_server(vllm_python, tmp, "lora-b")]
    try:
        for s in started:  # from this thread, which outlives them (see VllmServer.start)
            s.start()
        for s in started:
            s.wait_ready()
        yield Vllms(tmp, started)
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def rig(vllms: Vllms, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """The servers behind a control plane, Envoy and the picker (the module's tests share it)."""
    rig = gateway(vllms, tmp_path_factory.mktemp("picked"), picked=True)
    try:
        yield rig
    finally:
        close(rig)


@pytest.fixture
def nohop(vllms: Vllms, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """The same servers behind a control plane and an Envoy of their own, whose tier has no
    `balancing: picker` (a few seconds to start, against the vLLMs' minutes)."""
    rig = gateway(vllms, tmp_path_factory.mktemp("nohop"), picked=False)
    try:
        yield rig
    finally:
        close(rig)


@pytest.fixture
def unrouted(vllms: Vllms, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """As `nohop`, with a fleet file that does not say where the adapters are, nor hashes."""
    rig = gateway(vllms, tmp_path_factory.mktemp("unrouted"), picked=False, known=False)
    try:
        yield rig
    finally:
        close(rig)


def successes(server: VllmServer) -> float:
    """Requests the server finished (vllm:request_success_total, every finished reason)."""
    return sum(
        float(line.split()[-1])
        for line in server.metrics().splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def adapters_named(server: VllmServer) -> set[str]:
    """Every adapter the server's lora_requests_info series name, running or waiting."""
    names: set[str] = set()
    for labels in re.findall(r"^vllm:lora_requests_info\{([^}]*)\}", server.metrics(), re.M):
        for key, value in re.findall(r'(\w+)="([^"]*)"', labels):
            if key in ("running_lora_adapters", "waiting_lora_adapters"):
                names.update(n for n in value.split(",") if n)
    return names


def served_models(server: VllmServer) -> set[str]:
    with urllib.request.urlopen(server.base + "/v1/models", timeout=10) as r:
        return {m["id"] for m in json.load(r)["data"]}


def counted(rig: Rig, before: list[float], want: list[int]) -> None:
    """Wait until each server's finished count grew by exactly `want` (vLLM counts a request
    when its engine output is processed, which may be just after the answer is sent)."""
    wait_until(
        lambda: [successes(s) - b for s, b in zip(rig.servers, before, strict=True)] == want,
        30,
        f"the servers to count {want} more requests",
    )


def loads(rig: Rig, adapter: str) -> float:
    assert rig.picker is not None
    return rig.picker.metric(
        f'controlplane_picker_adapter_loads_total{{adapter="{adapter}",model="{MODEL}",outcome="loaded"}}'
    )


def test_each_adapters_requests_all_go_to_the_vllm_that_has_it(rig: Rig) -> None:
    before = [successes(s) for s in rig.servers]
    replies: list[tuple[str, int, dict[str, object]]] = []
    for i in range(max(SENT.values())):
        for adapter, n in SENT.items():
            if i < n:
                status, body = complete(rig.listener, adapter, by_header=i % 2 == 0)
                replies.append((adapter, status, body))
    assert [s for _, s, _ in replies] == [200] * sum(SENT.values()), replies
    assert all(body["model"] == adapter for adapter, _, body in replies), replies
    # Each server's own page: exactly its adapter's requests, and only its adapter named.
    counted(rig, before, [SENT["lora-a"], SENT["lora-b"]])
    named = [adapters_named(s) for s in rig.servers]
    assert "lora-a" in named[0] and "lora-b" not in named[0], named
    assert "lora-b" in named[1] and "lora-a" not in named[1], named
    assert rig.picker is not None
    for adapter, n in SENT.items():
        name = f'controlplane_picker_adapter_requests_total{{adapter="{adapter}",model="{MODEL}"}}'
        assert rig.picker.metric(name) == n, adapter
        assert loads(rig, adapter) == 1, adapter  # vLLM's "already been loaded", taken as loaded


def test_an_adapter_no_server_has_is_loaded_onto_one_then_served_there(rig: Rig) -> None:
    assert not any("lora-c" in served_models(s) for s in rig.servers)
    before = [successes(s) for s in rig.servers]
    status, body = complete(rig.listener, "lora-c")
    assert status == 200 and body["model"] == "lora-c", body
    holders = [n for n, s in enumerate(rig.servers) if "lora-c" in served_models(s)]
    assert len(holders) == 1, holders
    for i in range(3):
        status, body = complete(rig.listener, "lora-c", by_header=i % 2 == 0)
        assert status == 200 and body["model"] == "lora-c", body
    counted(rig, before, [4 if n == holders[0] else 0 for n in range(2)])
    assert loads(rig, "lora-c") == 1
    assert "lora-c" in adapters_named(rig.servers[holders[0]])
    assert "lora-c" not in adapters_named(rig.servers[1 - holders[0]])


def test_an_adapter_the_fleet_does_not_have_gets_the_gateways_404(rig: Rig) -> None:
    status, body = complete(rig.listener, "lora-x")
    assert status == 404 and body["error"]["code"] == "model_not_found", body  # type: ignore[index]
    assert complete(rig.listener, "lora-x", by_header=True)[0] == 404
    _, listing = http_get(f"http://127.0.0.1:{rig.listener}/v1/models")
    parents = {m["id"]: m.get("parent") for m in json.loads(listing)["data"]}
    assert parents == {MODEL: None, **{a: MODEL for a in ADAPTERS}}, parents


def test_without_the_picker_envoys_subsets_keep_each_adapter_on_its_vllm(nohop: Rig) -> None:
    before = [successes(s) for s in nohop.servers]
    for i in range(6):
        for adapter in ("lora-a", "lora-b"):
            status, body = complete(nohop.listener, adapter, by_header=i % 2 == 0)
            assert status == 200 and body["model"] == adapter, (adapter, body)
    counted(nohop, before, [6, 6])


def test_without_the_routing_the_vllm_without_the_adapter_answers_404(unrouted: Rig) -> None:
    """The first test fails without the routing: by the weights alone, some of lora-a's
    requests reach the second vLLM, which does not have it and answers its own 404."""
    before = [successes(s) for s in unrouted.servers]
    replies = [complete(unrouted.listener, "lora-a") for _ in range(12)]
    statuses = [s for s, _ in replies]
    assert 404 in statuses and 200 in statuses, statuses
    counted(unrouted, before, [statuses.count(200), 0])  # the 200s all from the first
    for status, body in replies:
        if status == 404:  # vLLM's answer, not the gateway's model_not_found
            assert "does not exist" in body["error"]["message"], body  # type: ignore[index]
    assert "lora-a" not in served_models(unrouted.servers[1])
    print(
        f"\nwithout the picker, lora-a's 12 requests: {statuses.count(404)} answered 404 by the second vLLM"
    )
