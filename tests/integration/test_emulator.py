"""The inference-server emulator over real HTTP on loopback (free ports, small token times)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from controlplane.cli.main import main as cli_main
from controlplane.signals.parse import MetricsPageInvalid, parse_metrics
from controlplane.sim.emulator import (
    EmulatedServer,
    EmulatorConfig,
    Emulators,
    EmulatorsThread,
    Faults,
    FaultsInvalid,
    start_emulators,
)
from tests.ports import free_ports

MODEL = "llama-3-8b"
# Fast enough for tests, slow enough that queueing and pacing are measurable.
FAST = EmulatorConfig(MODEL, prefill_s_per_token=0.0, decode_s_per_token=0.002, slots=4)

Body = dict[str, Any]


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


async def post(
    s: aiohttp.ClientSession, server: EmulatedServer, path: str, body: object
) -> tuple[int, Body, float]:
    start = time.monotonic()
    async with s.post(server.url + path, json=body) as r:
        data = await r.json()
        assert r.headers["x-emulator-server"] == server.address
        return r.status, data, time.monotonic() - start


async def complete(
    s: aiohttp.ClientSession, server: EmulatedServer, **body: object
) -> tuple[int, Body, float]:
    return await post(s, server, "/v1/completions", {"model": MODEL, "prompt": "hello there", **body})


async def metrics(s: aiohttp.ClientSession, server: EmulatedServer) -> str:
    async with s.get(server.url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


def test_completion_counts_words_as_tokens_and_honours_max_tokens() -> None:
    async def body() -> None:
        async with await start_emulators([FAST]) as em, aiohttp.ClientSession() as s:
            status, data, _ = await complete(s, em[0], prompt="why is the sky blue", max_tokens=7)
            assert status == 200
            assert data["object"] == "text_completion" and data["model"] == MODEL
            assert data["id"].startswith("cmpl-") and isinstance(data["created"], int)
            assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
            [choice] = data["choices"]
            assert len(choice["text"].split()) == 7 and choice["finish_reason"] == "length"
            # No max_tokens: the configured default, and the model "stops" by itself.
            status, data, _ = await complete(s, em[0], prompt=["one two three"])
            assert data["usage"]["completion_tokens"] == FAST.default_max_tokens == 16
            assert data["usage"]["prompt_tokens"] == 3
            assert data["choices"][0]["finish_reason"] == "stop"
            status, data, _ = await complete(s, em[0], prompt=[1, 2, 3, 4], max_completion_tokens=2)
            assert data["usage"]["prompt_tokens"] == 4 and data["usage"]["completion_tokens"] == 2
            assert em[0].requests_total == 3 and em[0].responses_by_status[200] == 3

    run(body)


def test_chat_completion_counts_words_of_every_message() -> None:
    async def body() -> None:
        async with await start_emulators([FAST]) as em, aiohttp.ClientSession() as s:
            messages = [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is a GPU"}]},
            ]
            status, data, _ = await post(
                s, em[0], "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3}
            )
            assert status == 200 and data["object"] == "chat.completion"
            assert data["id"].startswith("chatcmpl-")
            assert data["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
            message = data["choices"][0]["message"]
            assert message["role"] == "assistant" and len(message["content"].split()) == 3

    run(body)


async def read_sse(r: aiohttp.ClientResponse) -> list[tuple[float, str]]:
    events = []
    async for line in r.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            events.append((time.monotonic(), text.removeprefix("data: ")))
    return events


def test_streams_one_chunk_per_token_at_the_decode_rate() -> None:
    async def body() -> None:
        config = replace(FAST, decode_s_per_token=0.03)
        async with await start_emulators([config]) as em, aiohttp.ClientSession() as s:
            start = time.monotonic()
            request = {"model": MODEL, "prompt": "a b", "max_tokens": 5, "stream": True}
            async with s.post(em[0].url + "/v1/completions", json=request) as r:
                assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
                assert r.headers["x-emulator-server"] == em[0].address
                events = await read_sse(r)
            assert events[-1][1] == "[DONE]"
            chunks = [json.loads(e) for _, e in events[:-1]]
            tokens = [c["choices"][0]["text"] for c in chunks[:5]]
            assert "".join(tokens).split() == tokens_as_words(tokens) and len(tokens) == 5
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:5])
            assert chunks[5]["choices"][0]["finish_reason"] == "length"
            # Paced: 5 decode steps of 30 ms; the tokens do not arrive in one burst.
            times = [t for t, _ in events[:5]]
            assert times[-1] - times[0] >= 4 * 0.03 * 0.8
            assert events[-1][0] - start >= 5 * 0.03 * 0.9

    run(body)


def tokens_as_words(tokens: list[str]) -> list[str]:
    return [t.strip() for t in tokens]


def test_chat_stream_has_role_then_deltas_and_optional_usage() -> None:
    async def body() -> None:
        async with await start_emulators([FAST]) as em, aiohttp.ClientSession() as s:
            request = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi there"}],
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with s.post(em[0].url + "/v1/chat/completions", json=request) as r:
                events = [e for _, e in await read_sse(r)]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
            assert len(content.split()) == 3
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["choices"] == []
            assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}

    run(body)


@pytest.mark.parametrize(
    ("path", "raw", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"prompt": "hi"}', 400, "model"),
        ("/v1/completions", b'{"model": 7, "prompt": "hi"}', 400, "model"),
        ("/v1/completions", b'{"model": "other-model", "prompt": "hi"}', 404, "model"),
        ("/v1/completions", b'{"model": "llama-3-8b"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "llama-3-8b", "prompt": {"a": 1}}', 400, "prompt"),
        ("/v1/completions", b'{"model": "llama-3-8b", "prompt": ["a", "b"]}', 400, "prompt"),
        ("/v1/completions", b'{"model": "llama-3-8b", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        (
            "/v1/completions",
            b'{"model": "llama-3-8b", "prompt": "hi", "max_tokens": true}',
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            b'{"model": "llama-3-8b", "prompt": "hi", "max_tokens": 5000}',
            400,
            "max_tokens",
        ),
        ("/v1/completions", b'{"model": "llama-3-8b", "prompt": "hi", "stream": "yes"}', 400, "stream"),
        ("/v1/completions", b'{"model": "llama-3-8b", "prompt": "hi", "n": 2}', 400, "n"),
        ("/v1/chat/completions", b'{"model": "llama-3-8b"}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "llama-3-8b", "messages": []}', 400, "messages"),
        (
            "/v1/chat/completions",
            b'{"model": "llama-3-8b", "messages": [{"content": "x"}]}',
            400,
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": 3}]}',
            400,
            "messages[0].content",
        ),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(
    path: str, raw: bytes, status: int, param: str | None
) -> None:
    async def body() -> None:
        async with await start_emulators([FAST]) as em, aiohttp.ClientSession() as s:
            headers = {"content-type": "application/json"}
            async with s.post(em[0].url + path, data=raw, headers=headers) as r:
                assert r.status == status
                assert r.headers["x-emulator-server"] == em[0].address
                error = (await r.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == param and error["type"] == "invalid_request_error"
            assert error["message"]
            if status == 404:
                assert error["code"] == "model_not_found" and "other-model" in error["message"]
            assert em[0].responses_by_status[status] == 1

    run(body)


def test_models_health_and_unknown_paths() -> None:
    async def body() -> None:
        async with await start_emulators([FAST]) as em, aiohttp.ClientSession() as s:
            async with s.get(em[0].url + "/v1/models") as r:
                data = await r.json()
            assert data["object"] == "list" and [m["id"] for m in data["data"]] == [MODEL]
            async with s.get(em[0].url + "/health") as r:
                assert r.status == 200
            async with s.get(em[0].url + "/v2/nothing") as r:
                assert r.status == 404 and r.headers["x-emulator-server"] == em[0].address
                assert "error" in await r.json()

    run(body)


def test_sglang_load_endpoint_and_probes_are_not_requests() -> None:
    async def body() -> None:
        # 2 slots, 3 requests of 10 prompt words and 100 tokens x 10 ms: 2 running, 1 waiting.
        config = replace(FAST, slots=2, decode_s_per_token=0.01)
        async with await start_emulators([config]) as em, aiohttp.ClientSession() as s:
            async with s.get(em[0].url + "/get_load") as r:
                assert r.status == 200
                assert await r.json() == [
                    {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
                ]
            words = " ".join(["w"] * 10)
            requests = [
                asyncio.create_task(complete(s, em[0], prompt=words, max_tokens=100)) for _ in range(3)
            ]
            deadline = time.monotonic() + 10
            while em[0].requests_total < 3:  # all three arrived (each runs 1 s: they stay put)
                assert time.monotonic() < deadline, "the three requests never all arrived"
                await asyncio.sleep(0.01)
            async with s.get(em[0].url + "/get_load") as r:
                (load,) = await r.json()
            assert (load["num_reqs"], load["num_waiting_reqs"]) == (3, 1)
            # Two running hold their prompts and the tokens made so far; the waiting one its prompt.
            assert 2 * 10 + 10 <= load["num_tokens"] <= 2 * 110 + 10
            # A router's probes, of paths the server has and of paths it has not, are no requests.
            for path in ("/health", "/get_server_info", "/get_server_info", "/metrics"):
                async with s.get(em[0].url + path) as r:
                    await r.read()
            async with s.get(em[0].url + "/v1/completions") as r:
                assert r.status == 405
            await asyncio.gather(*requests)
            stats = em[0].stats()
            assert stats["requests_total"] == 3 == em[0].requests_total
            assert stats["responses_by_status"] == {"200": 3}
            assert stats["probes_by_path"] == {
                "GET /get_load": 2,
                "GET /get_server_info": 2,
                "GET /health": 1,
                "GET /metrics": 1,
                "GET /v1/completions": 1,
            }

    run(body)


def test_cold_start_answers_503_until_warm() -> None:
    async def body() -> None:
        async with (
            await start_emulators([replace(FAST, cold_start_s=0.6)]) as em,
            aiohttp.ClientSession() as s,
        ):
            started = time.monotonic()
            async with s.get(em[0].url + "/health") as r:
                assert r.status == 503
            status, data, _ = await complete(s, em[0])
            assert status == 503 and data["error"]["code"] == "model_loading"
            async with s.get(em[0].url + "/v1/models") as r:
                assert r.status == 503
            while True:
                async with s.get(em[0].url + "/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.02)
            assert time.monotonic() - started >= 0.55
            status, _, _ = await complete(s, em[0])
            assert status == 200

    run(body)


def test_metrics_page_parses_and_shows_the_queue_under_load() -> None:
    async def body() -> None:
        # 50 tokens x 10 ms = 0.5 s per request; 2 slots, 5 requests: 0.5, 0.5, 1.0, 1.0, 1.5 s.
        config = replace(FAST, slots=2, decode_s_per_token=0.01, kv_capacity_tokens=1000)
        async with await start_emulators([config]) as em, aiohttp.ClientSession() as s:
            fresh = parse_metrics(await metrics(s, em[0]), MODEL)
            assert (fresh.dialect, fresh.running, fresh.waiting, fresh.successes) == ("vllm", 0, 0, 0)
            words = " ".join(["w"] * 100)
            requests = [
                asyncio.create_task(complete(s, em[0], prompt=words, max_tokens=50)) for _ in range(5)
            ]
            while em[0].requests_total < 5:
                await asyncio.sleep(0.01)
            page = await metrics(s, em[0])
            busy = parse_metrics(page, MODEL)
            assert (busy.running, busy.waiting) == (2, 3)
            # 2 x (100 prompt + up to 50 generated) of 1000.
            assert busy.kv_use is not None and 0.2 <= busy.kv_use <= 0.3
            assert 'vllm:kv_cache_usage_perc{engine="0",model_name="llama-3-8b"}' in page
            latencies = sorted(t for _, _, t in await asyncio.gather(*requests))
            for got, want in zip(latencies, [0.5, 0.5, 1.0, 1.0, 1.5], strict=True):
                assert want - 0.01 <= got <= want + 0.3  # loose above: a busy machine adds, never takes
            done = parse_metrics(await metrics(s, em[0]), MODEL)
            assert (done.running, done.waiting, done.kv_use) == (0, 0, 0)
            assert done.successes == 5 and done.latency_count == 5
            assert done.latency_sum_s == pytest.approx(4.5, abs=0.15)  # the server's own view
            page = await metrics(s, em[0])
            labels = 'engine="0",model_name="llama-3-8b"'  # vLLM 0.32's labels, in its order
            assert (
                'vllm:request_success_total{engine="0",finished_reason="length",model_name="llama-3-8b"} 5.0'
                in page
            )
            assert f"vllm:prompt_tokens_total{{{labels}}} 500.0" in page
            assert f"vllm:generation_tokens_total{{{labels}}} 250.0" in page
            assert f"vllm:request_queue_time_seconds_count{{{labels}}} 5.0" in page
            assert f"vllm:time_to_first_token_seconds_count{{{labels}}} 5.0" in page
            # A page that serves one model under another name is that server's model.
            assert parse_metrics(page, "another-model") == parse_metrics(page, "llama-3-8b")

    run(body)


def test_slower_gpus_and_the_slow_fault_stretch_latency() -> None:
    async def body() -> None:
        config = replace(FAST, decode_s_per_token=0.01)  # 20 tokens: 0.2 s at speed 1
        async with (
            await start_emulators([config, replace(config, speed=0.33)]) as em,
            aiohttp.ClientSession() as s,
        ):
            for server in em:
                await complete(s, server, max_tokens=1)  # connect first: time only the service
            _, _, fast = await complete(s, em[0], max_tokens=20)
            _, _, slow = await complete(s, em[1], max_tokens=20)
            # Lower bounds are the model; upper bounds leave room for a busy machine.
            assert 0.2 <= fast < 0.3 and 0.6 <= slow < 0.8
            assert 2.3 <= slow / fast <= 3.1
            await em[0].set_faults(slow=3)
            _, _, slowed = await complete(s, em[0], max_tokens=20)
            assert 0.6 <= slowed < 0.8
            await em[0].set_faults(slow=1)
            _, _, back = await complete(s, em[0], max_tokens=20)
            assert back < 0.3

    run(body)


def test_error_and_oom_rates() -> None:
    async def body() -> None:
        config = replace(FAST, decode_s_per_token=0.0001, seed=7)
        async with await start_emulators([config]) as em, aiohttp.ClientSession() as s:
            server = em[0]
            await server.set_faults(error_rate=1.0)
            status, data, _ = await complete(s, server, max_tokens=1)
            assert status == 500 and data["error"]["type"] == "server_error"
            await server.set_faults(error_rate=0.0, oom_rate=1.0)
            status, data, _ = await complete(s, server, max_tokens=1)
            assert status == 507 and data["error"]["code"] == "out_of_memory"
            await server.set_faults(error_rate=0.3, oom_rate=0.2)
            results = await asyncio.gather(*(complete(s, server, max_tokens=1) for _ in range(300)))
            counts = Counter(status for status, _, _ in results)
            assert 60 <= counts[500] <= 120 and 35 <= counts[507] <= 85
            assert counts[200] == 300 - counts[500] - counts[507]
            stats = server.stats()
            assert stats["responses_by_status"]["500"] == counts[500] + 1
            # Failed requests are not successes on the vLLM page (vLLM has no failure counter).
            assert parse_metrics(await metrics(s, server), MODEL).successes == counts[200]

    run(body)


def test_backlog_fault_fills_the_queue_and_clears() -> None:
    async def body() -> None:
        # Phantoms run 20 x 10 ms = 0.2 s each and queue again at the tail.
        config = replace(
            FAST, slots=2, decode_s_per_token=0.01, phantom_prompt_tokens=0, phantom_output_tokens=20
        )
        async with await start_emulators([config]) as em, aiohttp.ClientSession() as s:
            server = em[0]
            _, _, idle = await complete(s, server, max_tokens=1)
            status, data, _ = await post(s, server, "/emulator/faults", {"backlog": 5})
            assert status == 200 and data["backlog"] == 5
            loaded = parse_metrics(await metrics(s, server), MODEL)
            assert (loaded.running, loaded.waiting) == (2, 3)
            # Behind three phantoms on two slots: it starts when the second pair finishes.
            _, _, queued = await complete(s, server, max_tokens=1)
            assert queued >= 0.3 > 5 * idle
            assert parse_metrics(await metrics(s, server), MODEL).successes == 2  # phantoms are not counted
            status, data, _ = await post(s, server, "/emulator/faults", {"backlog": 0})
            assert data["backlog"] == 0
            cleared = parse_metrics(await metrics(s, server), MODEL)
            assert (cleared.running, cleared.waiting) == (0, 0)
            _, _, after = await complete(s, server, max_tokens=1)
            assert after < 0.2

    run(body)


def test_garbage_metrics_fault() -> None:
    async def body() -> None:
        async with await start_emulators([FAST]) as em, aiohttp.ClientSession() as s:
            await em[0].set_faults(garbage_metrics=True)
            with pytest.raises(MetricsPageInvalid):
                parse_metrics(await metrics(s, em[0]), MODEL)
            await em[0].set_faults(garbage_metrics=False)
            assert parse_metrics(await metrics(s, em[0]), MODEL).running == 0

    run(body)


def test_fault_endpoint_validates_and_reports() -> None:
    async def body() -> None:
        async with await start_emulators([FAST]) as em, aiohttp.ClientSession() as s:
            async with s.get(em[0].url + "/emulator/faults") as r:
                assert await r.json() == Faults().to_json()
            for bad, param in [
                ({"slow": 0}, "slow"),
                ({"slow": "fast"}, "slow"),
                ({"error_rate": 1.5}, "error_rate"),
                ({"error_rate": 0.6, "oom_rate": 0.6}, "oom_rate"),
                ({"backlog": -1}, "backlog"),
                ({"backlog": 2.5}, "backlog"),
                ({"crash": "yes"}, "crash"),
                ({"melt": True}, "melt"),
            ]:
                status, data, _ = await post(s, em[0], "/emulator/faults", bad)
                assert status == 400 and data["error"]["param"] == param, bad
            async with s.post(em[0].url + "/emulator/faults", data=b"{oops") as r:
                assert r.status == 400
            # Partial updates keep the other fields; nothing above changed anything.
            _, data, _ = await post(s, em[0], "/emulator/faults", {"slow": 2})
            _, data, _ = await post(s, em[0], "/emulator/faults", {"error_rate": 0.25})
            assert data == {**Faults().to_json(), "slow": 2.0, "error_rate": 0.25}
            assert em[0].faults == Faults(slow=2.0, error_rate=0.25)
            with pytest.raises(FaultsInvalid) as e:
                await em[0].set_faults(oom_rate=-0.1)
            assert e.value.field == "oom_rate"
            async with s.get(em[0].url + "/emulator/stats") as r:
                stats = await r.json()
            assert stats["model"] == MODEL and stats["running"] == 0 and stats["requests_total"] == 0

    run(body)


def test_crash_refuses_connections_until_restart() -> None:
    async def body() -> None:
        config = replace(FAST, decode_s_per_token=0.01)
        async with await start_emulators([config]) as em, aiohttp.ClientSession() as s:
            server = em[0]
            await complete(s, server, max_tokens=1)
            in_flight = asyncio.create_task(complete(s, server, max_tokens=200))  # 2 s
            await asyncio.sleep(0.1)
            status, data, _ = await post(s, server, "/emulator/faults", {"crash": True})
            assert status == 200 and data["crash"] is True
            with pytest.raises(aiohttp.ClientError):  # reset mid-answer, as a dead process does
                await in_flight
            with pytest.raises(aiohttp.ClientConnectorError) as refused:
                async with s.get(server.url + "/health"):
                    pass
            assert isinstance(refused.value.os_error, ConnectionRefusedError)
            assert not server.is_up and server.crashes == 1 and server.faults.crash
            port = server.port
            await server.restart()
            assert server.port == port and server.faults.crash is False
            async with s.get(server.url + "/health") as r:
                assert r.status == 200
            fresh = parse_metrics(await metrics(s, server), MODEL)
            assert fresh.successes == 0  # a new process: counters start again
            status, _, _ = await complete(s, server, max_tokens=1)
            assert status == 200 and server.responses_by_status[200] == 3  # bookkeeping survives
            await server.set_faults(crash=True)
            assert not server.is_up and server.crashes == 2

    run(body)


def test_client_that_gives_up_frees_its_slot() -> None:
    async def body() -> None:
        config = replace(FAST, slots=1, decode_s_per_token=0.01)
        async with await start_emulators([config]) as em, aiohttp.ClientSession() as s:
            server = em[0]
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(
                    server.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "x", "max_tokens": 300},  # 3 s
                    timeout=aiohttp.ClientTimeout(total=0.1),
                ):
                    pass
            _, _, latency = await complete(s, server, max_tokens=1)
            assert latency < 0.5  # not 3 s behind the abandoned request
            assert server.aborted_total == 1

    run(body)


def test_many_servers_in_one_process() -> None:
    async def body() -> None:
        configs = [replace(FAST, gpu=g) for g in ("A100", "L4", "H100")]
        async with Emulators(configs) as em, aiohttp.ClientSession() as s:
            assert len({sv.port for sv in em}) == 3 and all(sv.port for sv in em)
            seen: Counter[str] = Counter()
            for i in range(9):
                server = em[i % 3]
                async with s.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
                    seen[r.headers["x-emulator-server"]] += 1
            assert seen == Counter({a: 3 for a in em.addresses})
            assert [sv.requests_total for sv in em] == [3, 3, 3]
            assert [sv.stats()["gpu"] for sv in em] == ["A100", "L4", "H100"]
        assert not any(sv.is_up for sv in em)

    run(body)


def test_a_taken_port_fails_the_start_and_stops_the_others() -> None:
    async def body() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            em = Emulators([FAST, FAST], ports=[0, taken.getsockname()[1]])
            with pytest.raises(OSError):
                await em.start()
            assert not any(sv.is_up for sv in em)

    run(body)


def test_config_is_validated() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"speed": 0}, "speed"),
        ({"slots": 0}, "slots"),
        ({"decode_s_per_token": 0}, "decode_s_per_token"),
        ({"cold_start_s": -1}, "cold_start_s"),
        ({"default_max_tokens": 5000}, "default_max_tokens"),
        ({"model": ""}, "model"),
        ({"faults": Faults(crash=True)}, "faults.crash"),
    ]
    for bad, name in cases:
        with pytest.raises(ValueError, match=name):
            EmulatorConfig(**{"model": MODEL, **bad})


def test_thread_runner_serves_synchronous_callers() -> None:
    with EmulatorsThread([FAST]) as em:
        request = urllib.request.Request(
            f"{em[0].url}/v1/completions",
            data=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 2
        assert em.call(em[0].set_faults(error_rate=1.0)).error_rate == 1.0
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=5)
        with e.value:
            assert e.value.code == 500


# --- the command -------------------------------------------------------------------------


def test_cli_emulate_runs_count_servers_until_sigterm() -> None:
    port = free_ports(2)
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "controlplane", "emulate", "--listen", f"127.0.0.1:{port}"),
            *("--count", "2", "--model", MODEL, "--gpu", "A100", "--speed", "0.5"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 15
        for p in (port, port + 1):
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{p}/health", timeout=1) as r:
                        assert r.status == 200 and r.headers["x-emulator-server"] == f"127.0.0.1:{p}"
                        break
                except OSError:
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, "emulators did not come up"
                    time.sleep(0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/emulator/stats", timeout=1) as r:
            stats = json.load(r)
        assert (stats["gpu"], stats["speed"]) == ("A100", 0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert err.decode().count("emulated server started") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slots", "0"], "argument --slots: must be >= 1, got '0'"),
        (["--speed", "fast"], "argument --speed: expected a number, got 'fast'"),
        (["--error-rate", "1.5"], "argument --error-rate: must be between 0 and 1, got '1.5'"),
        (["--decode-ms-per-token", "0"], "argument --decode-ms-per-token: must be > 0, got '0'"),
        (["--max-tokens", "5000"], "argument --max-tokens: must be between 1 and 4096, got '5000'"),
    ],
)
def test_cli_emulate_rejects_bad_flags(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["emulate", "--model", MODEL, *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_emulate_rejects_bad_listen_and_rate_sum(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["emulate", "--model", MODEL, "--listen", "nowhere"]) == 2
    assert "--listen: expected HOST:PORT" in capsys.readouterr().err
    assert cli_main(["emulate", "--model", MODEL, "--error-rate", "0.6", "--oom-rate", "0.6"]) == 2
    assert "--oom-rate:" in capsys.readouterr().err
