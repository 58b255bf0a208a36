"""The emulator's POST /tokenize (vLLM's): the token ids it answers for a chat or a completion
are the ids its KV events carry for the same request, so a router that keys blocks by token
ids (vllm-router's kv_aware asks /tokenize) finds them; with a tokenizer and without one (a
word a token). One emulated server on free loopback ports; a real ZMQ SUB reads its events."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from bench.ports import free_port
from controlplane.kvcache import wire
from controlplane.sim.emulator import EmulatedServer, EmulatorConfig
from controlplane.sim.tokenizer import make_tokenizer

CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "You answer briefly. " * 12},
        {"role": "user", "content": "Which cache holds this prompt?"},
    ],
    "max_tokens": 1,
}
COMPLETION = {"model": "m", "prompt": "one two three four five " * 8, "max_tokens": 1}


def tokenize_and_events(tokenizer: Path | None, body: dict[str, Any]) -> tuple[Any, list[int]]:
    """POST /tokenize's answer for `body`, and the token ids of the blocks the server's KV events
    stored when it then served `body` (full blocks only, as vLLM publishes), read back from its
    replay socket (no late-joining subscriber to miss them)."""

    async def run() -> tuple[Any, list[int]]:
        replay = f"tcp://127.0.0.1:{free_port()}"
        config = EmulatorConfig(
            model="m",
            seed=1,
            kv_events=f"tcp://127.0.0.1:{free_port()}",
            kv_replay=replay,
            tokenizer=str(tokenizer) if tokenizer else None,
        )
        server = EmulatedServer(config, "127.0.0.1", 0)
        await server.start()
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            async with aiohttp.ClientSession() as s:
                base = f"http://{server.address}"
                async with s.post(f"{base}/tokenize", json=body) as r:
                    assert r.status == 200, await r.text()
                    answer = await r.json()
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                async with s.post(f"{base}{path}", json=body) as r:
                    assert r.status == 200, await r.text()
            dealer.connect(replay)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            ids: list[int] = []
            while True:
                assert await dealer.poll(10_000), "the replay socket did not answer"
                seq, payload = wire.replayed(await dealer.recv_multipart())
                if seq == wire.END_SEQ:
                    return answer, ids
                for ev in wire.read_payload(seq, payload).events:
                    if isinstance(ev, wire.Stored):
                        ids += list(ev.token_ids)
        finally:
            dealer.close(linger=0)
            await server.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("body", [CHAT, COMPLETION], ids=["chat", "completion"])
@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["tokenizer", "a_word_a_token"])
def test_tokenize_answers_the_ids_the_kv_events_carry(
    tmp_path: Path, body: dict[str, Any], with_tokenizer: bool
) -> None:
    tokenizer = make_tokenizer(tmp_path / "tok") if with_tokenizer else None
    answer, stored = tokenize_and_events(tokenizer, body)
    assert set(answer) == {"count", "max_model_len", "tokens", "token_strs"}
    assert answer["count"] == len(answer["tokens"]) > 16
    assert stored, "the request stored no full block"
    assert answer["tokens"][: len(stored)] == stored
    assert len(answer["tokens"]) - len(stored) < 16  # only the partial last block is not stored


def test_tokenize_refuses_a_body_it_cannot_read_with_the_reason() -> None:
    async def run() -> tuple[int, Any]:
        server = EmulatedServer(EmulatorConfig(model="m", seed=1), "127.0.0.1", 0)
        await server.start()
        try:
            url = f"http://{server.address}/tokenize"
            async with aiohttp.ClientSession() as s, s.post(url, data=b"{not json") as r:
                return r.status, await r.json()
        finally:
            await server.stop()

    status, body = asyncio.run(run())
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
