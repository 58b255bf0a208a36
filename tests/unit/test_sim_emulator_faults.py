"""The emulator logs its faults: each change (from Python or POST /emulator/faults) with the
values set and every fault then in force, a crash before the port closes, a restart after it.
One emulated server on a free loopback port; structlog's capture_logs reads the lines."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from controlplane.sim.emulator import EmulatedServer, EmulatorConfig

Logs = list[dict[str, Any]]


def scenario(steps: Callable[[EmulatedServer, aiohttp.ClientSession], Coroutine[Any, Any, None]]) -> Logs:
    """Run `steps` against a fresh server; the emulator's log lines they caused."""

    async def body() -> Logs:
        server = EmulatedServer(EmulatorConfig(model="m", seed=1), "127.0.0.1", 0)
        await server.start()
        try:
            async with aiohttp.ClientSession() as s:
                with capture_logs() as logs:
                    await steps(server, s)
                return [dict(e) for e in logs if "emulated server" in e["event"]]
        finally:
            await server.stop()

    return asyncio.run(body())


def without_address(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "address"}


def test_setting_faults_logs_the_values_set_and_those_in_force() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        await server.set_faults(error_rate=0.5, slow=2.0)
        await server.set_faults(oom_rate=0.1)

    first, second = scenario(steps)
    assert without_address(first) == {
        "event": "emulated server faults set",
        "log_level": "warning",
        "model": "m",
        "via": "python",
        "error_rate": 0.5,
        "slow": 2.0,
        "in_force": {"slow": 2.0, "error_rate": 0.5},
    }
    assert first["address"].startswith("127.0.0.1:")
    assert second["oom_rate"] == 0.1 and "error_rate" not in second
    assert second["in_force"] == {"slow": 2.0, "error_rate": 0.5, "oom_rate": 0.1}


def test_clearing_faults_logs_a_recovery_at_info() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        await server.set_faults(garbage_metrics=True)
        await server.set_faults(garbage_metrics=False)

    _, cleared = scenario(steps)
    assert cleared["event"] == "emulated server faults cleared" and cleared["log_level"] == "info"
    assert cleared["garbage_metrics"] is False and cleared["in_force"] == {}


@pytest.mark.parametrize(
    ("body", "logged"),
    [
        ({"backlog": 3}, {"backlog": 3}),
        ({"probes_hang": True, "slow": 1.5}, {"probes_hang": True, "slow": 1.5}),
        ({"error_rate": 0.0}, {"error_rate": 0.0}),
    ],
)
def test_faults_set_over_http_are_logged_too(body: dict[str, Any], logged: dict[str, Any]) -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        async with s.post(server.url + "/emulator/faults", json=body) as r:
            assert r.status == 200
        await server.set_faults(backlog=0, probes_hang=False, slow=1.0)  # leave it healthy

    entry = scenario(steps)[0]
    assert entry["via"] == "http"
    assert {k: entry[k] for k in logged} == logged
    assert entry["in_force"] == {k: v for k, v in logged.items() if k != "error_rate"}


def test_a_refused_fault_logs_nothing() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        async with s.post(server.url + "/emulator/faults", json={"error_rate": 2}) as r:
            assert r.status == 400

    assert scenario(steps) == []


@pytest.mark.parametrize("via", ["python", "http"])
def test_a_crash_logs_that_the_server_goes_down_and_a_restart_that_it_recovered(via: str) -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        if via == "python":
            await server.set_faults(crash=True)
        else:
            async with s.post(server.url + "/emulator/faults", json={"crash": True}) as r:
                assert r.status == 200
            for _ in range(100):  # the HTTP path answers first, then crashes
                if not server.is_up:
                    break
                await asyncio.sleep(0.01)
        assert not server.is_up
        await server.restart()

    set_, down, up = scenario(steps)
    assert set_["event"] == "emulated server faults set" and set_["crash"] is True
    assert set_["in_force"] == {"crash": True} and set_["via"] == via
    assert down["event"] == "emulated server going down: port closes, requests in flight are lost"
    assert down["log_level"] == "warning" and down["reason"] == "crash fault"
    assert (down["running"], down["waiting"], down["crashes"]) == (0, 0, 1)
    assert down["address"] == set_["address"] == up["address"]
    assert up["event"] == "emulated server restarted: recovered from its crash"
    assert up["log_level"] == "info" and up["faults"] == {}


def test_a_crash_from_code_names_its_reason() -> None:
    async def steps(server: EmulatedServer, s: aiohttp.ClientSession) -> None:
        await server.crash(reason="--crash-after")
        await server.crash(reason="twice")  # already down: nothing more happens, nothing logged

    [down] = scenario(steps)
    assert down["reason"] == "--crash-after" and down["crashes"] == 1
