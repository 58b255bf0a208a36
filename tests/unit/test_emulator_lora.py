"""The emulator serves LoRA adapters as vLLM does (issue 45): a request naming an adapter runs
with it; at most `max_loras` adapters sit in GPU slots; one not resident waits for a slot and
costs `lora_load_s` before its prefill; the least recently used idle adapter is evicted, one
with running requests never; requests blocked on a slot hold back neither base-model requests
nor those of resident adapters; `vllm:lora_requests_info` keeps a series per label set; the
runtime load and unload API; an adapter that fails to load.

One emulated server per test on a free loopback port. Held requests (a long answer whose
client goes away when the test says so) keep adapters running; the tests wait on the
server's state, never on fixed sleeps. Prefill is free (`prefill_s_per_token=0`), so the
page's prefill-time sum is exactly the load time the finished requests paid."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.kvcache import wire
from controlplane.sim.emulator import EmulatedServer, EmulatorConfig, FaultsInvalid
from controlplane.sim.emulator_lora import AdapterLoadFailed, AdapterSlots
from controlplane.sim.emulator_metrics import VllmMetrics
from controlplane.sim.prefix_cache import BLOCK_TOKENS, PrefixCache
from tests.waits import until

BASE = "base"
LOAD_S = 0.25
HOLD_TOKENS = 4000  # a held request's answer: 8 s at 2 ms a token, ended by its client first

Steps = Callable[[EmulatedServer, aiohttp.ClientSession], Coroutine[Any, Any, None]]


def lora(*modules: str, **kw: Any) -> EmulatorConfig:
    return EmulatorConfig(
        BASE,
        prefill_s_per_token=0.0,
        decode_s_per_token=0.002,
        slots=4,
        lora_modules=modules,
        lora_load_s=kw.pop("lora_load_s", LOAD_S),
        **kw,
    )


def run(config: EmulatorConfig, steps: Steps) -> None:
    async def body() -> None:
        server = EmulatedServer(config, "127.0.0.1", 0)
        await server.start()
        try:
            async with aiohttp.ClientSession() as s:
                await steps(server, s)
        finally:
            await server.stop()

    asyncio.run(body())


async def complete(
    s: aiohttp.ClientSession, server: EmulatedServer, model: str, max_tokens: int = 3
) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "prompt": "tell me about adapters", "max_tokens": max_tokens}
    async with s.post(server.url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


def hold(s: aiohttp.ClientSession, server: EmulatedServer, model: str) -> asyncio.Task[Any]:
    """A long request of `model`, running (or waiting) until the task is cancelled: its client
    goes away and the server frees its slot at once, as vLLM aborts it."""
    return asyncio.get_running_loop().create_task(complete(s, server, model, HOLD_TOKENS))


async def release(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def lora_stats(server: EmulatedServer) -> dict[str, Any]:
    stats = server.lora_stats()
    assert stats is not None
    return stats


async def page(s: aiohttp.ClientSession, server: EmulatedServer) -> dict[str, Any]:
    async with s.get(server.url + "/metrics") as r:
        assert r.status == 200
        return {f.name: f for f in text_string_to_metric_families(await r.text())}


def histogram_sum(families: dict[str, Any], name: str) -> float:
    [value] = [x.value for x in families[name].samples if x.name == f"{name}_sum"]
    return float(value)


# --- serving ---------------------------------------------------------------------------


def test_a_resident_adapter_is_served_without_a_load() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        assert lora_stats(server)["resident"] == ["sql"]  # --lora-modules load at start-up
        status, body = await complete(s, server, "sql")
        assert status == 200 and body["model"] == "sql"
        stats = lora_stats(server)
        assert stats["loads"] == {} and stats["evictions"] == {} and stats["requests"] == {"sql": 1}
        assert histogram_sum(await page(s, server), "vllm:request_prefill_time_seconds") == 0.0

    run(lora("sql=/adapters/sql"), steps)


def test_a_second_adapter_waits_while_the_first_runs_then_loads_before_its_prefill() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        assert lora_stats(server)["resident"] == ["a"]  # the last of --lora-modules b a
        a = hold(s, server, "a")
        await until(lambda: server.running == 1, "a runs")
        b = asyncio.get_running_loop().create_task(complete(s, server, "b"))
        await until(lambda: server.waiting == 1, "b waits for the one slot")
        families = await page(s, server)
        assert families["vllm:num_requests_waiting"].samples[0].value == 1
        stats = lora_stats(server)
        assert (stats["running"], stats["waiting"], stats["loads"]) == (["a"], ["b"], {})
        await release(a)
        status, body = await b
        assert status == 200 and body["model"] == "b"
        stats = lora_stats(server)
        assert (stats["loads"], stats["evictions"], stats["resident"]) == ({"b": 1}, {"a": 1}, ["b"])
        # Its load came before its prefill: in its prefill time, and in its time to first token.
        families = await page(s, server)
        assert histogram_sum(families, "vllm:request_prefill_time_seconds") == pytest.approx(LOAD_S)
        assert histogram_sum(families, "vllm:time_to_first_token_seconds") >= LOAD_S

    run(lora("b", "a", max_loras=1), steps)


def test_the_least_recently_used_idle_adapter_is_evicted() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        assert lora_stats(server)["resident"] == ["a", "b"]  # c was loaded first and evicted
        assert (await complete(s, server, "a"))[0] == 200  # b is now the least recently used
        assert lora_stats(server)["resident"] == ["b", "a"]
        assert (await complete(s, server, "c"))[0] == 200
        stats = lora_stats(server)
        assert stats["resident"] == ["a", "c"]
        assert (stats["loads"], stats["evictions"]) == ({"c": 1}, {"b": 1})  # start-up not counted

    run(lora("c", "a", "b", max_loras=2), steps)


def test_an_adapter_with_running_requests_is_never_evicted() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        a = hold(s, server, "a")
        await until(lambda: server.running == 1, "a runs")
        assert (await complete(s, server, "b"))[0] == 200  # now a, running, is the least recent
        assert lora_stats(server)["resident"] == ["a", "b"]
        assert (await complete(s, server, "c"))[0] == 200
        stats = lora_stats(server)
        assert stats["evictions"] == {"b": 1} and stats["resident"] == ["a", "c"]
        assert server.running == 1 and not a.done()  # a ran on throughout
        # Both slots running: b waits, evicting neither, until one of them is idle.
        c = hold(s, server, "c")
        await until(lambda: server.running == 2, "a and c run")
        b = hold(s, server, "b")
        await until(lambda: server.waiting == 1, "b waits")
        assert lora_stats(server)["evictions"] == {"b": 1}
        await release(c)
        await until(lambda: server.running == 2 and server.waiting == 0, "b takes c's slot")
        stats = lora_stats(server)
        assert stats["evictions"] == {"b": 1, "c": 1} and stats["running"] == ["a", "b"]
        for task in (a, b):
            await release(task)

    run(lora("c", "a", "b", max_loras=2), steps)


def test_requests_blocked_on_a_slot_hold_back_neither_base_nor_resident_requests() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        a = hold(s, server, "a")
        await until(lambda: server.running == 1, "a runs")
        b = hold(s, server, "b")
        await until(lambda: server.waiting == 1, "b waits")
        # Behind b in the queue, yet served while it waits, without a load.
        for model in (BASE, "a", BASE):
            status, body = await complete(s, server, model)
            assert status == 200 and body["model"] == model
        assert server.waiting == 1 and lora_stats(server)["loads"] == {}
        assert histogram_sum(await page(s, server), "vllm:request_prefill_time_seconds") == 0.0
        for task in (a, b):
            await release(task)

    run(lora("b", "a", max_loras=1), steps)


def test_base_model_requests_need_no_slot() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        held = [hold(s, server, "a"), hold(s, server, BASE), hold(s, server, BASE)]
        await until(lambda: server.running == 3, "a and two base requests run")
        assert (await complete(s, server, BASE))[0] == 200  # the fourth batch slot
        assert lora_stats(server)["running"] == ["a"]
        for task in held:
            await release(task)

    run(lora("a", max_loras=1), steps)


# --- names and the API -----------------------------------------------------------------


def test_a_model_neither_served_nor_registered_is_404() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        status, body = await complete(s, server, "nope")
        assert status == 404
        error = body["error"]
        assert (error["param"], error["code"], error["type"]) == (
            "model",
            "model_not_found",
            "invalid_request_error",
        )
        assert "'nope' does not exist" in error["message"]
        assert server.lora_stats() is None  # LoRA disabled: no adapter is known
        async with s.get(server.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [BASE]

    run(EmulatorConfig(BASE), steps)


def test_the_load_and_unload_api() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        async def post(path: str, body: object) -> tuple[int, str]:
            async with s.post(server.url + path, json=body) as r:
                return r.status, await r.text()

        load = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        assert await post("/v1/load_lora_adapter", load) == (
            200,
            "Success: LoRA adapter 'sql' added successfully.",
        )
        assert lora_stats(server)["loads"] == {"sql": 1}  # loaded at once, as vLLM's add_lora
        async with s.get(server.url + "/v1/models") as r:
            models = (await r.json())["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models] == [
            (BASE, None, BASE),
            ("sql", BASE, "/adapters/sql"),
        ]
        assert (await complete(s, server, "sql"))[0] == 200
        assert lora_stats(server)["loads"] == {"sql": 1}  # resident: no second load
        status, text = await post("/v1/load_lora_adapter", load)
        assert status == 400 and "has already been loaded" in text and '"InvalidUserInput"' in text
        for bad in ({"lora_name": "x"}, {"lora_path": "/x"}, {"lora_name": "x,y", "lora_path": "/x"}, [1]):
            status, text = await post("/v1/load_lora_adapter", bad)
            assert status == 400, (bad, text)
        status, text = await post("/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "/x"})
        assert status == 400 and "must differ from the served model" in text
        assert await post("/v1/unload_lora_adapter", {"lora_name": "sql"}) == (
            200,
            "Success: LoRA adapter 'sql' removed successfully.",
        )
        assert (await complete(s, server, "sql"))[0] == 404
        status, text = await post("/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert status == 404 and "cannot be found" in text and '"NotFoundError"' in text
        assert (await post("/v1/unload_lora_adapter", {}))[0] == 400
        assert lora_stats(server)["resident"] == []  # an idle adapter's slot is freed at once

    run(lora(max_loras=1), steps)


@pytest.mark.parametrize(
    ("config", "status"),
    [(lora(max_loras=1, allow_runtime_lora=False), 404), (EmulatorConfig(BASE), 400)],
    ids=["runtime-updates-not-allowed", "lora-disabled"],
)
def test_the_load_api_without_runtime_updates_or_without_lora(config: EmulatorConfig, status: int) -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        async with s.post(server.url + "/v1/load_lora_adapter", json=body) as r:
            assert r.status == status
        assert (await complete(s, server, "sql"))[0] == 404

    run(config, steps)


def test_an_adapter_that_fails_to_load() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        async with s.post(server.url + "/emulator/faults", json={"lora_load_fail": ["bad", "late"]}) as r:
            assert r.status == 200 and (await r.json())["lora_load_fail"] == ["bad", "late"]
        body = {"lora_name": "late", "lora_path": "/adapters/late"}
        async with s.post(server.url + "/v1/load_lora_adapter", json=body) as r:
            assert r.status == 400 and "Loading lora late failed" in await r.text()
        status, answer = await complete(s, server, "bad")  # registered at start, not resident
        assert status == 500 and answer["error"]["code"] == "lora_load_failed"
        assert (await complete(s, server, "ok"))[0] == 200  # the resident adapter
        assert (await complete(s, server, BASE))[0] == 200
        stats = lora_stats(server)
        assert stats["load_failures"] == {"bad": 1, "late": 1} and stats["resident"] == ["ok"]
        assert server.responses_by_status[500] == 1 and server.responses_by_status[200] == 2
        await server.set_faults(lora_load_fail=[])
        assert (await complete(s, server, "bad"))[0] == 200
        with pytest.raises(FaultsInvalid) as e:
            await server.set_faults(lora_load_fail=[""])
        assert e.value.field == "lora_load_fail"

    run(lora("bad", "ok", max_loras=1), steps)


def test_a_restart_keeps_the_counts_and_only_the_start_up_adapters() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        body = {"lora_name": "runtime", "lora_path": "/adapters/runtime"}
        async with s.post(server.url + "/v1/load_lora_adapter", json=body) as r:
            assert r.status == 200
        assert lora_stats(server)["registered"] == ["static", "runtime"]
        await server.crash()
        await server.restart()
        stats = lora_stats(server)
        assert stats["registered"] == ["static"] and stats["resident"] == ["static"]
        assert stats["loads"] == {"runtime": 1} and stats["evictions"] == {"static": 1}
        assert (await complete(s, server, "runtime"))[0] == 404

    run(lora("static", max_loras=1), steps)


# --- the page --------------------------------------------------------------------------


def lora_series(families: dict[str, Any]) -> list[tuple[dict[str, str], float]]:
    return [(dict(x.labels), x.value) for x in families["vllm:lora_requests_info"].samples]


@pytest.mark.parametrize(
    ("labels", "busy"),
    [("in_flight", ("a,b", "a,b")), ("split", ("a", "b"))],
)
def test_the_page_keeps_a_series_per_label_set_the_newest_the_greatest(
    labels: str, busy: tuple[str, str]
) -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        started = time.time()
        families = await page(s, server)
        assert families["vllm:lora_requests_info"].type == "gauge"
        assert lora_series(families) == []  # as vLLM: nothing set before the first step
        assert (await complete(s, server, BASE))[0] == 200
        a = hold(s, server, "a")
        await until(lambda: server.running == 1, "a runs")
        b = hold(s, server, "b")
        await until(lambda: server.waiting == 1, "b waits")
        series = lora_series(await page(s, server))
        assert len(series) >= 3
        for got, when in series:
            assert set(got) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
            assert got["max_lora"] == "1"
            assert started - 1 <= when <= time.time() + 1  # the Unix time it was last set
        newest, _ = max(series, key=lambda x: x[1])
        assert (newest["running_lora_adapters"], newest["waiting_lora_adapters"]) == busy
        assert {"running_lora_adapters": "", "waiting_lora_adapters": ""}.items() <= series[0][0].items()
        for task in (a, b):
            await release(task)
        await until(lambda: server.running == server.waiting == 0, "the server is idle")
        newest, _ = max(lora_series(await page(s, server)), key=lambda x: x[1])
        assert (newest["running_lora_adapters"], newest["waiting_lora_adapters"]) == ("", "")

    run(lora("b", "a", max_loras=1, lora_info_labels=labels), steps)


def test_the_page_has_no_lora_family_when_lora_is_disabled() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        assert (await complete(s, server, BASE))[0] == 200
        assert "vllm:lora_requests_info" not in await page(s, server)

    run(EmulatorConfig(BASE), steps)


def test_the_lora_series_are_bounded_and_times_only_grow() -> None:
    metrics = VllmMetrics(BASE, page="compact", max_loras=2)
    metrics.observe_lora(["a"], [], at=100.0)
    metrics.observe_lora(["b"], [], at=100.0)  # the same instant: still the newer
    metrics.observe_lora(["a"], [], at=50.0)  # a clock step back: still the newest
    values = {x.labels["running_lora_adapters"]: x.value for x in lora_series_of(metrics)}
    assert values["b"] > 100.0 and values["a"] > values["b"]
    for i in range(2000):
        metrics.observe_lora([f"x{i}"], [], at=200.0 + i)
    series = lora_series_of(metrics)
    assert len(series) == 1024 and series[-1].labels["running_lora_adapters"] == "x1999"
    assert VllmMetrics(BASE).render(0, 0, 0.0).find(b"lora") == -1


def lora_series_of(metrics: VllmMetrics) -> list[Any]:
    [family] = [f for f in metrics.collect() if f.name == "vllm:lora_requests_info"]
    return list(family.samples)


# --- the pure parts ----------------------------------------------------------------------


def test_adapter_slots_evict_the_least_recently_used_idle_adapter_only() -> None:
    slots = AdapterSlots(2, 1.5, fails=lambda name: name == "bad")
    assert slots.take("a", 0.0) == 1.5  # loaded: ready after the load
    assert slots.take("b", 1.0) == 2.5
    assert slots.take("a", 2.0) == 1.5  # resident: ready already
    assert not slots.can_take("c")  # both run requests
    slots.release("b")
    assert slots.can_take("c") and slots.take("c", 3.0) == 4.5
    assert slots.resident == ["a", "c"] and dict(slots.counts.evictions) == {"b": 1}
    with pytest.raises(AdapterLoadFailed):
        slots.take("bad", 4.0)
    assert dict(slots.counts.load_failures) == {"bad": 1} and slots.resident == ["a", "c"]
    slots.drop("c")  # unregistered while it runs: freed when it ends, not evicted
    assert slots.resident == ["a", "c"]
    slots.release("c")
    assert slots.resident == ["a"] and dict(slots.counts.evictions) == {"b": 1}
    assert dict(slots.counts.loads) == {"a": 1, "b": 1, "c": 1}


def test_an_adapters_prompt_is_cached_apart_and_its_kv_events_name_it() -> None:
    events: list[dict[str, Any]] = []

    class Listener:
        def stored(
            self,
            hashes: Sequence[int],
            parent: int | None,
            token_ids: Sequence[int],
            block_size: int,
            **kw: Any,
        ) -> None:
            events.append(wire.stored(hashes, parent, token_ids, block_size, **kw))

        def removed(self, hashes: Sequence[int]) -> None:
            events.append(wire.removed(hashes))

    prompt = [str(i) for i in range(2 * BLOCK_TOKENS)]
    cache = PrefixCache(100, Listener())
    assert cache.admit(prompt) == 0
    assert cache.admit(prompt, "a") == 0  # vLLM keys a block by its adapter too
    assert cache.admit(prompt, "a") == 2 * BLOCK_TOKENS
    assert cache.admit(prompt) == 2 * BLOCK_TOKENS
    base, adapter = (wire.read(list(wire.frames(0, 1.0, [e]))).events[0] for e in events)
    assert isinstance(base, wire.Stored) and isinstance(adapter, wire.Stored)
    assert (base.lora, adapter.lora) == (None, "a") and base.token_ids == adapter.token_ids
    assert set(base.hashes).isdisjoint(adapter.hashes)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"lora_modules": "a"}, "lora_modules"),
        ({"lora_modules": ("a", "a=/x")}, r"lora_modules\[1\]: adapter 'a' is listed twice"),
        ({"lora_modules": ("a,b",)}, r"lora_modules\[0\]: the adapter name must have no comma"),
        ({"lora_modules": (BASE,)}, r"lora_modules\[0\]: the adapter name must differ"),
        ({"lora_modules": ("a=",)}, r"lora_modules\[0\]: the path"),
        ({"lora_modules": ("a",), "max_loras": 0}, "max_loras: 0 disables LoRA"),
        ({"max_loras": -1}, "max_loras"),
        ({"max_loras": 1.5}, "max_loras"),
        ({"lora_load_s": -0.1}, "lora_load_s"),
        ({"lora_load_s": math.inf}, "lora_load_s"),
        ({"allow_runtime_lora": "yes"}, "allow_runtime_lora"),
        ({"lora_info_labels": "both"}, "lora_info_labels"),
    ],
)
def test_the_lora_config_is_validated_naming_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EmulatorConfig(BASE, **bad)


def test_the_lora_defaults() -> None:
    assert EmulatorConfig(BASE).lora_slots == 0  # no adapters: LoRA disabled
    config = EmulatorConfig(BASE, lora_modules=["a=/x", "b"])  # type: ignore[arg-type]
    assert config.lora_modules == ("a=/x", "b") and config.lora_slots == 1  # vLLM's --max-loras
    assert (config.lora_load_s, config.allow_runtime_lora, config.lora_info_labels) == (
        0.5,
        True,
        "in_flight",
    )
    assert EmulatorConfig(BASE, max_loras=4).lora_slots == 4  # adapters loaded at runtime only
