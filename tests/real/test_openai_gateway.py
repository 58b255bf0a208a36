"""The official `openai` SDK through the gateway (a real control plane and a real Envoy) to real
llama.cpp servers (issue 32): chat and completions, streaming and not; each server-sent event
intact and in order, `[DONE]` at the end; `usage` passed through; body `model` routing (two
models, each on its own server); an unknown model as the SDK's NotFoundError.

The servers decode greedily (temperature 0) with the prompt cache off, so a request asked of a
server directly and through the gateway gets the same tokens: what the gateway passes on is
compared with what the server itself says, not only checked for a 200.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

from tests.fleets import fleet_yaml
from tests.integration.harness import ControlPlane, Envoy, wait_until
from tests.ports import free_port
from tests.real.conftest import LlamaFactory
from tests.real.llama import LlamaServer

pytestmark = [pytest.mark.real, pytest.mark.envoy]

MODELS = ("tiny-a", "tiny-b")
# Greedy and repeatable: no sampling, no prompt cache (a cached prefix changes the numbers a
# little, and the tiny random model's logits are close enough for that to change a token),
# and a fixed length (a random model may pick </s> early).
SAME_TOKENS: dict[str, Any] = {"cache_prompt": False, "ignore_eos": True, "seed": 7}
MAX_TOKENS = 48


@dataclass
class Gateway:
    listener: int
    servers: dict[str, LlamaServer]
    cp: ControlPlane
    envoy: Envoy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener}/v1"


@pytest.fixture(scope="module")
def gateway(
    module_llama_servers: LlamaFactory, tmp_path_factory: pytest.TempPathFactory, openai_sdk: ModuleType
) -> Iterator[Gateway]:
    """Two models, each served by its own llama-server, behind one control plane and one Envoy."""
    tmp = tmp_path_factory.mktemp("gateway")
    servers = {m: module_llama_servers(m) for m in MODELS}
    listener = free_port()
    fleet = tmp / "fleet.yaml"
    fleet.write_text(fleet_yaml({m: {"v1": [s.address]} for m, s in servers.items()}, port=listener))
    cp = ControlPlane(fleet, tmp)
    envoy = Envoy("envoy-1", cp.xds, tmp, listener)
    try:
        cp.start()
        envoy.start()
        client = sdk(openai_sdk, f"http://127.0.0.1:{listener}/v1")
        for m in MODELS:  # routed: each model's route and its server's endpoint are in Envoy
            wait_until(
                lambda m=m: client.completions.create(model=m, prompt="up?", max_tokens=1).model == m,  # type: ignore[misc]
                30,
                f"{m} to be served through the gateway",
                interval=0.2,
            )
        yield Gateway(listener, servers, cp, envoy)
    finally:
        envoy.stop()
        cp.stop()


def sdk(openai_sdk: ModuleType, base_url: str) -> Any:
    # No retries: a failure the SDK would hide by retrying is a failure here.
    return openai_sdk.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)


def counter(page: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", page, re.M)
    assert m, f"{name} not on the page"
    return float(m.group(1))


def sse_events(lines: list[str]) -> list[str]:
    """The `data:` payloads of a server-sent event stream, checked to be well framed: each
    event one `data:` line followed by a blank line, nothing else."""
    events: list[str] = []
    expect_blank = False
    for line in lines:
        if expect_blank:
            assert line == "", f"an event's data line not followed by a blank line: {line!r}"
            expect_blank = False
            continue
        if line == "":
            continue  # iter_lines may give the blank lines doubled at chunk edges
        assert line.startswith("data: "), f"not a data line: {line!r}"
        events.append(line[len("data: ") :])
        expect_blank = True
    return events


def stable(event: dict[str, Any]) -> dict[str, Any]:
    """An event without what differs between two runs of the same request (its id, time,
    speed and cache figures)."""
    out = {k: v for k, v in event.items() if k not in ("id", "created", "timings")}
    if isinstance(out.get("usage"), dict):
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def raw_stream(client: Any, kind: str, **body: Any) -> tuple[str, list[str]]:
    """(content type, the raw lines) of a streamed request, read below the SDK's parser."""
    api = client.chat.completions if kind == "chat" else client.completions
    with api.with_streaming_response.create(**body) as r:
        assert r.status_code == 200, r.read()
        return r.headers.get("content-type", ""), list(r.iter_lines())


CHAT = {"messages": [{"role": "user", "content": "Say something long."}]}
COMPLETION = {"prompt": "Once upon a time"}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_non_streaming_answer_is_the_servers_own(gateway: Gateway, openai_sdk: ModuleType, kind: str) -> None:
    """Through the gateway, the same text, finish reason and usage as the server gives directly."""
    for model, server in gateway.servers.items():
        via = sdk(openai_sdk, gateway.url)
        direct = sdk(openai_sdk, server.base + "/v1")
        body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": SAME_TOKENS}
        if kind == "chat":
            got = via.chat.completions.create(**CHAT, **body)
            want = direct.chat.completions.create(**CHAT, **body)
            assert got.object == "chat.completion"
            [choice], [want_choice] = got.choices, want.choices
            assert choice.message.role == "assistant"
            assert choice.message.content == want_choice.message.content
            text = choice.message.content
        else:
            got = via.completions.create(**COMPLETION, **body)
            want = direct.completions.create(**COMPLETION, **body)
            assert got.object == "text_completion"
            [choice], [want_choice] = got.choices, want.choices
            assert choice.text == want_choice.text
            text = choice.text
        assert got.model == model  # its own server answered (each server's alias is its model)
        assert text, "an empty answer"
        assert choice.finish_reason == want_choice.finish_reason == "length"
        assert got.usage is not None and want.usage is not None
        assert got.usage.completion_tokens == MAX_TOKENS
        assert (got.usage.prompt_tokens, got.usage.total_tokens) == (
            want.usage.prompt_tokens,
            want.usage.total_tokens,
        )
        assert got.usage.total_tokens == got.usage.prompt_tokens + MAX_TOKENS


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_arrives_intact_in_order_and_ends_with_done(
    gateway: Gateway, openai_sdk: ModuleType, kind: str
) -> None:
    """Every event the server sends arrives, unchanged and in order, then `[DONE]` and nothing
    after; with include_usage, the last chunk carries the usage."""
    model = MODELS[0]
    server = gateway.servers[model]
    body = {
        **(CHAT if kind == "chat" else COMPLETION),
        "model": model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": SAME_TOKENS,
    }
    content_type, lines = raw_stream(sdk(openai_sdk, gateway.url), kind, **body)
    _, direct_lines = raw_stream(sdk(openai_sdk, server.base + "/v1"), kind, **body)
    assert content_type.startswith("text/event-stream"), content_type
    events, direct_events = sse_events(lines), sse_events(direct_lines)

    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]  # each one whole JSON: none cut or merged
    direct_chunks = [json.loads(e) for e in direct_events[:-1]]
    assert [stable(c) for c in chunks] == [stable(c) for c in direct_chunks]
    assert len({c["id"] for c in chunks}) == 1  # one response's events, not two interleaved
    assert {c["model"] for c in chunks} == {model}

    # The usage comes once, in the last chunk: for chat a chunk of its own with no choices (as
    # OpenAI sends it); llama.cpp's completions put it on the chunk with the finish reason.
    assert [("usage" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
    content = [c for c in chunks if c["choices"]]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert len(content) > 2  # streamed in pieces, not one buffered answer


def sdk_stream_text(client: Any, kind: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """The SDK's own parse of a stream: (the deltas joined, the chunks)."""
    if kind == "chat":
        chunks = list(
            client.chat.completions.create(
                **CHAT, **body, stream=True, stream_options={"include_usage": True}
            )
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks
    chunks = list(
        client.completions.create(**COMPLETION, **body, stream=True, stream_options={"include_usage": True})
    )
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_sdk_stream_reassembles_the_answer(gateway: Gateway, openai_sdk: ModuleType, kind: str) -> None:
    """The SDK's own stream parser over the gateway: its deltas, joined, are what they are from
    the server directly, and the answer the same request gets unstreamed; the usage comes."""
    client = sdk(openai_sdk, gateway.url)
    model = MODELS[1]
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": SAME_TOKENS}
    text, chunks = sdk_stream_text(client, kind, body)
    direct, _ = sdk_stream_text(sdk(openai_sdk, gateway.servers[model].base + "/v1"), kind, body)
    if kind == "chat":
        whole = client.chat.completions.create(**CHAT, **body).choices[0].message.content
    else:
        whole = client.completions.create(**COMPLETION, **body).choices[0].text
    assert text and text == direct
    # The tiny model's tokens are single bytes: a stream ending inside a UTF-8 sequence has
    # llama.cpp drop the incomplete byte, where the unstreamed answer shows it as U+FFFD (the
    # same from the server directly).
    assert whole in (text, text + "\ufffd")
    assert {c.model for c in chunks} == {model}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_body_model_routes_each_model_to_its_own_server(gateway: Gateway, openai_sdk: ModuleType) -> None:
    """Requests for each model, interleaved: each answered by its own server (the answer's
    model, and the tokens counted on that server's /metrics and not on the other's)."""
    client = sdk(openai_sdk, gateway.url)
    name = "llamacpp:tokens_predicted_total"
    before = {m: counter(s.metrics(), name) for m, s in gateway.servers.items()}
    sent = {m: 0 for m in MODELS}
    for i in range(6):
        model = MODELS[i % 2] if i < 4 else MODELS[0]  # 4 to tiny-a, 2 to tiny-b
        n = 5 + i
        if i % 3 == 0:
            answer = client.chat.completions.create(model=model, max_tokens=n, extra_body=SAME_TOKENS, **CHAT)
        else:
            answer = client.completions.create(
                model=model, max_tokens=n, extra_body=SAME_TOKENS, **COMPLETION
            )
        assert answer.model == model
        assert answer.usage.completion_tokens == n
        sent[model] += n
    after = {m: counter(s.metrics(), name) for m, s in gateway.servers.items()}
    assert {m: after[m] - before[m] for m in MODELS} == sent


def test_models_list_names_the_fleets_models(gateway: Gateway, openai_sdk: ModuleType) -> None:
    assert sorted(m.id for m in sdk(openai_sdk, gateway.url).models.list()) == sorted(MODELS)


def prompt_tokens(gateway: Gateway) -> dict[str, float]:
    return {m: counter(s.metrics(), "llamacpp:prompt_tokens_total") for m, s in gateway.servers.items()}


def expected_error(code: str) -> dict[str, str]:
    """The error object of the gateway's own answers (controlplane/routing/translate.py)."""
    from controlplane.routing.translate import ERR_NO_MODEL, ERR_UNKNOWN_MODEL

    return {"model_not_found": ERR_UNKNOWN_MODEL, "model_required": ERR_NO_MODEL}[code]["error"]


@pytest.mark.parametrize("kind", ["chat", "completion", "chat-stream", "completion-stream"])
def test_unknown_model_is_the_sdks_not_found_error(
    gateway: Gateway, openai_sdk: ModuleType, kind: str
) -> None:
    """An unknown model: 404 with an OpenAI-style error body, which the SDK raises as
    NotFoundError carrying its code, type and message, streaming or not; no server sees it."""
    client = sdk(openai_sdk, gateway.url)
    before = prompt_tokens(gateway)
    stream = kind.endswith("-stream")
    with pytest.raises(openai_sdk.NotFoundError) as caught:
        if kind.startswith("chat"):
            answer = client.chat.completions.create(
                model="no-such-model", max_tokens=3, stream=stream, **CHAT
            )
        else:
            answer = client.completions.create(
                model="no-such-model", max_tokens=3, stream=stream, **COMPLETION
            )
        if stream:
            list(answer)
    e = caught.value
    assert e.status_code == 404
    assert (e.code, e.type) == ("model_not_found", "invalid_request_error")
    assert e.body == expected_error("model_not_found")
    assert "The model does not exist on this gateway." in str(e)
    assert prompt_tokens(gateway) == before


def test_no_model_is_the_sdks_bad_request_error(gateway: Gateway, openai_sdk: ModuleType) -> None:
    """A body without `model` (sent with the SDK's generic post, as its typed calls insist on
    one): 400, raised as BadRequestError with the gateway's model_required error."""
    client = sdk(openai_sdk, gateway.url)
    before = prompt_tokens(gateway)
    with pytest.raises(openai_sdk.BadRequestError) as caught:
        client.post(
            "/completions", body={"prompt": "hi", "max_tokens": 3}, cast_to=openai_sdk.types.Completion
        )
    e = caught.value
    assert e.status_code == 400
    assert (e.code, e.type) == ("model_required", "invalid_request_error")
    assert e.body == expected_error("model_required")
    assert prompt_tokens(gateway) == before
