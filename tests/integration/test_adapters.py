"""LoRA adapters through a real Envoy and a picker (issue 45), on emulated vLLM servers with
adapter slots: a request naming an adapter goes to a server that has it (and fails without
the routing), an unknown one gets the unknown model's 404, and with placement: dynamic the
picker loads an adapter no server has before the request goes, while one that fails to load
gets a 503 naming it and costs the base model nothing."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import EmulatedFleet, Emulator, http_get, wait_until
from tests.integration.test_picker import PickerProc
from tests.ports import free_port

pytestmark = pytest.mark.envoy

IDLE_UNLOAD_S = 4  # the picker's --adapter-idle-unload: a dynamic adapter unused this long is unloaded


def fleet(servers: dict[str, Emulator], picker: str, picked: bool, known: bool = True) -> str:
    """`known`: the fleet file says which server has sql and chat, and hashes adapters (else
    Envoy's weighted least request, blind to adapters: `affinity: false`)."""
    a, b, c, d = (servers[n].address for n in "abcd")
    only_a, only_b = (f", endpoints: ['{a}']", f", endpoints: ['{b}']") if known else ("", "")
    return f"""
listener: {{port: %d}}
signals: {{interval: 300ms, timeout: 250ms}}
picker: {{endpoints: ['{picker}'], timeout: 1000ms}}
tiers: {{small: {{timeout: 30s{", balancing: picker" if picked else ""}}}}}
models:
  base:
    params_b: 8
    stable: v1{"" if known else chr(10) + "    affinity: false"}
    adapters:
      sql: {{source: /adapters/sql{only_a}}}
      chat: {{source: /adapters/chat{only_b}}}
      shared: {{source: /adapters/shared}}
    versions: {{v1: {{endpoints: [{{address: '{a}'}}, {{address: '{b}'}}]}}}}
  dyn:
    params_b: 8
    stable: v1
    placement: dynamic
    adapters:
      fresh: {{source: /adapters/fresh}}
      broken: {{source: /adapters/broken}}
    versions: {{v1: {{endpoints: [{{address: '{c}'}}, {{address: '{d}'}}]}}}}
"""


def emulators(tmp_path: Path) -> dict[str, Emulator]:
    out: dict[str, Emulator] = {}
    try:
        shared = "shared=/adapters/shared"  # on both
        out["a"] = Emulator(
            "a", tmp_path, "base", slots=4, lora_modules=["sql=/adapters/sql", shared], max_loras=1
        )
        out["b"] = Emulator(
            "b", tmp_path, "base", slots=4, lora_modules=["chat=/adapters/chat", shared], max_loras=1
        )
        for n in "cd":  # LoRA on, nothing registered: adapters come at runtime
            out[n] = Emulator(n, tmp_path, "dyn", slots=4, max_loras=1, lora_load_s=0.2)
            out[n].set_faults(lora_load_fail=["broken"])
    except BaseException:
        for e in out.values():
            e.stop()
        raise
    return out


def rig(
    tmp_path: Path, picked: bool, known: bool = True
) -> Iterator[tuple[EmulatedFleet, PickerProc | None]]:
    fl = EmulatedFleet(tmp_path)
    picker: PickerProc | None = None
    try:
        fl.servers.update(emulators(tmp_path))
        picker_port = free_port()
        fl.serve(fleet(fl.servers, f"127.0.0.1:{picker_port}", picked, known) % fl.listener)
        assert fl.cp is not None and fl.envoy is not None
        if picked:
            admin = (fl.cp.admin, fl.cp.state_dir / "admin-token")
            idle = ("--adapter-idle-unload", str(IDLE_UNLOAD_S))
            picker = PickerProc("picker", fl.cp.xds, tmp_path, picker_port, admin=admin, extra=idle).start()
        envoy = fl.envoy
        for cluster in ("base@v1", "dyn@v1"):
            wait_until(
                lambda c=cluster: [h for _, h in envoy.endpoints(c).values()] == ["healthy"] * 2,  # type: ignore[misc]
                20,
                f"Envoy to have {cluster}'s servers healthy",
            )
        if picker is not None:  # and the picker to pick in both clusters (its EDS may lag Envoy's)
            for model in ("base", "dyn"):
                wait_until(lambda m=model: _picked(fl.listener, picker, m), 20, f"the picker to pick {model}")  # type: ignore[misc]
        yield fl, picker
    finally:
        if picker is not None:
            picker.stop()
        fl.close()


@pytest.fixture
def picked(tmp_path: Path) -> Iterator[tuple[EmulatedFleet, PickerProc | None]]:
    yield from rig(tmp_path, picked=True)


@pytest.fixture
def unpicked(tmp_path: Path) -> Iterator[tuple[EmulatedFleet, PickerProc | None]]:
    yield from rig(tmp_path, picked=False)


@pytest.fixture
def unrouted(tmp_path: Path) -> Iterator[tuple[EmulatedFleet, PickerProc | None]]:
    yield from rig(tmp_path, picked=False, known=False)


def _picked(port: int, picker: PickerProc, model: str) -> bool:
    """A request of `model` (the base) through the gateway was picked by the picker."""
    rid = f"warm-{model}-{time.monotonic_ns()}"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 1}).encode()
        conn.request(
            "POST", "/v1/completions", body, {"content-type": "application/json", "x-request-id": rid}
        )
        conn.getresponse().read()
    finally:
        conn.close()
    return rid in picker.picks()


def complete(port: int, model: str, by_header: bool = False) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"model": model, "prompt": "hello", "max_tokens": 2}  # the server reads the body's
        headers = {"content-type": "application/json"}
        if by_header:  # the gateway routes by the header first
            headers["x-model"] = model
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), headers)
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, {"text": text}
    finally:
        conn.close()


def lora(e: Emulator) -> dict[str, object]:
    _, text = http_get(f"http://{e.address}/emulator/stats")
    out = json.loads(text)["lora"]
    assert isinstance(out, dict)
    return out


def total(e: Emulator) -> int:
    _, text = http_get(f"http://{e.address}/emulator/stats")
    return int(json.loads(text)["requests_total"])


def test_adapters_go_where_they_are_and_dynamic_ones_are_loaded(
    picked: tuple[EmulatedFleet, PickerProc | None],
) -> None:
    fl, picker = picked
    assert picker is not None
    for i in range(12):
        for adapter in ("sql", "chat"):
            status, body = complete(fl.listener, adapter, by_header=i % 2 == 0)
            assert status == 200, (adapter, body)
            assert body["model"] == adapter
    # Each server's own count: every request of an adapter went to the one server that has it.
    assert lora(fl.servers["a"])["requests"] == {"sql": 12}
    assert lora(fl.servers["b"])["requests"] == {"chat": 12}
    assert picker.metric('controlplane_picker_adapter_requests_total{adapter="sql",model="base"}') == 12

    # An adapter no model has: the unknown model's 404, as for any name.
    status, body = complete(fl.listener, "nope")
    assert status == 404 and body["error"]["code"] == "model_not_found", body  # type: ignore[index]
    status, _ = complete(fl.listener, "nope", by_header=True)
    assert status == 404
    _, listing = http_get(f"http://127.0.0.1:{fl.listener}/v1/models")
    ids = {m["id"]: m.get("parent") for m in json.loads(listing)["data"]}
    assert ids["sql"] == "base" and ids["fresh"] == "dyn" and ids["base"] is None

    # placement: dynamic: no server has `fresh`; the picker loads it onto one, then sends.
    status, body = complete(fl.listener, "fresh")
    assert status == 200, body
    holders = [n for n in "cd" if "fresh" in lora(fl.servers[n])["registered"]]  # type: ignore[operator]
    assert len(holders) == 1, holders
    for _ in range(5):
        assert complete(fl.listener, "fresh")[0] == 200
    assert lora(fl.servers[holders[0]])["requests"] == {"fresh": 6}
    assert (
        picker.metric('controlplane_picker_adapter_loads_total{adapter="fresh",model="dyn",outcome="loaded"}')
        == 1
    )

    # The server loses it (a restart forgets adapters loaded at runtime; here, unloaded behind
    # the gateway's back): its next request there gets the server's 404, which tells the
    # picker, and the one after is loaded again and served.
    unload = urllib.request.Request(
        f"http://{fl.servers[holders[0]].address}/v1/unload_lora_adapter",
        data=json.dumps({"lora_name": "fresh"}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(unload, timeout=10) as r:
        assert r.status == 200
    assert complete(fl.listener, "fresh")[0] == 404
    assert complete(fl.listener, "fresh")[0] == 200
    loaded = 'controlplane_picker_adapter_loads_total{adapter="fresh",model="dyn",outcome="loaded"}'
    assert picker.metric(loaded) == 2
    holders = [n for n in "cd" if "fresh" in lora(fl.servers[n])["registered"]]  # type: ignore[operator]
    assert len(holders) == 1, holders

    # One that fails to load on every server: a 503 naming it; the base model is untouched.
    status, body = complete(fl.listener, "broken")
    assert status == 503, body
    assert "broken" in str(body["error"]["message"]), body  # type: ignore[index]
    assert complete(fl.listener, "dyn")[0] == 200
    assert complete(fl.listener, "base")[0] == 200
    assert (
        picker.metric(
            'controlplane_picker_adapter_loads_total{adapter="broken",model="dyn",outcome="failed"}'
        )
        == 1
    )

    # Unused for --adapter-idle-unload, `fresh` goes cold: unloaded from its server.
    wait_until(
        lambda: "fresh" not in lora(fl.servers[holders[0]])["registered"],  # type: ignore[operator]
        IDLE_UNLOAD_S + 20,
        "the cold adapter to be unloaded",
    )
    unloaded = 'controlplane_picker_adapter_loads_total{adapter="fresh",model="dyn",outcome="unloaded"}'
    assert picker.metric(unloaded) == 1
    assert complete(fl.listener, "fresh")[0] == 200  # asked for again: loaded again
    assert picker.metric(loaded) == 3


def test_without_the_picker_envoy_keeps_adapters_on_their_servers(
    unpicked: tuple[EmulatedFleet, PickerProc | None],
) -> None:
    """The no-hop path: sql and chat, each restricted to one server, are subsets of the
    cluster (Envoy's subset load balancer on the name the gateway copies to envoy.lb);
    `shared`, on both, is hashed on its name (Maglev, bounded load): all on one server while
    that one is not loaded past the bound, as here, one request at a time."""
    fl, _ = unpicked
    for i in range(8):
        for adapter in ("sql", "chat", "shared"):
            status, body = complete(fl.listener, adapter, by_header=i % 2 == 0)
            assert status == 200, (adapter, body)
    counts = [lora(fl.servers[n])["requests"] for n in "ab"]
    assert counts[0].get("sql") == 8 and "chat" not in counts[0], counts  # type: ignore[attr-defined]
    assert counts[1].get("chat") == 8 and "sql" not in counts[1], counts  # type: ignore[attr-defined]
    assert sorted(c.get("shared", 0) for c in counts) == [0, 8], counts  # type: ignore[attr-defined]
    # The base model's own requests have no key: Maglev at random, both servers take some.
    before = [total(fl.servers[n]) for n in "ab"]
    for _ in range(20):
        assert complete(fl.listener, "base")[0] == 200
    grew = [total(fl.servers[n]) - b for n, b in zip("ab", before, strict=True)]
    assert sum(grew) == 20 and min(grew) > 0, grew  # all on one: 2 * 0.5^20

    # sql's only server down: its requests get Envoy's 503, never the other server (which
    # would answer 404); chat and the base model are served as before.
    fl.servers["a"].stop()
    assert fl.envoy is not None
    envoy = fl.envoy
    wait_until(
        lambda: (
            [h for a, (_, h) in envoy.endpoints("base@v1").items() if a == fl.servers["a"].address]
            != ["healthy"]
        ),
        20,
        "Envoy to hold the stopped server out",
    )
    chat_before = lora(fl.servers["b"])["requests"]
    assert [complete(fl.listener, "sql", by_header=i % 2 == 0)[0] for i in range(4)] == [503] * 4
    assert lora(fl.servers["b"])["requests"] == chat_before  # none reached b
    assert complete(fl.listener, "chat")[0] == 200 and complete(fl.listener, "base")[0] == 200


def test_without_the_routing_adapter_requests_reach_servers_without_them(
    unrouted: tuple[EmulatedFleet, PickerProc | None],
) -> None:
    """The tests above fail without the routing (no picker, a fleet file that does not say
    where the adapters are, `affinity: false`): by the weights alone, half the requests for
    an adapter go to the server that does not have it, and get its 404."""
    fl, _ = unrouted
    statuses = [complete(fl.listener, "sql")[0] for _ in range(12)]
    assert 404 in statuses and 200 in statuses, statuses
