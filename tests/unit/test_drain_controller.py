"""Endpoint drains (drain/controller.py) over the rollout controller's stored state."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.drain.controller import EndpointDrains
from controlplane.rollout.controller import CommandRejected
from controlplane.signals.store import SignalStore
from tests.unit.test_rollout_controller import V1, Clock, controller, run_async


@run_async
async def test_an_unknown_endpoint_is_not_found(tmp_path: Path) -> None:
    c = await controller(tmp_path, Clock())
    with pytest.raises(CommandRejected) as e:
        await EndpointDrains(c).drain("10.9.9.9:1", None, "", "t")
    assert e.value.code == "NOT_FOUND"
    assert c.drains == {}


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan"), float("inf")])
@run_async
async def test_a_drain_timeout_must_be_finite_and_positive(tmp_path: Path, timeout: float) -> None:
    c = await controller(tmp_path, Clock())
    with pytest.raises(CommandRejected) as e:
        await EndpointDrains(c).drain(V1, timeout, "", "t")
    assert e.value.code == "INVALID_ARGUMENT" and "timeout" in str(e.value)


@run_async
async def test_drain_marks_then_removes_and_undrain_restores(tmp_path: Path) -> None:
    clock, signals = Clock(), SignalStore()
    c = await controller(tmp_path, clock, signals)
    d = EndpointDrains(c)
    await d.drain(V1, 60, "maintenance", "t")
    assert c.reconciler.overlay.draining == {V1}
    signals.record_lrs(("m", V1), "envoy", in_progress=2, issued=0, succeeded=0, failed=0, now=10**9)
    clock.t += 5
    await c.tick()
    assert d.drains[V1].state == "draining"  # two requests still in flight
    signals.forget_node("envoy")
    await c.tick()
    assert d.drains[V1].state == "drained"
    assert c.reconciler.fleet is not None
    assert c.reconciler.fleet.models[0].versions[0].endpoints == ()
    await d.undrain(V1, "", "t")
    assert len(c.reconciler.fleet.models[0].versions[0].endpoints) == 1
    with pytest.raises(CommandRejected) as e:
        await d.undrain(V1, "", "t")
    assert e.value.code == "FAILED_PRECONDITION"


@run_async
async def test_a_drain_is_stored_audited_and_restored_after_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    c = await controller(tmp_path, clock)
    d = EndpointDrains(c)
    first = await d.drain(V1, 60, "maintenance", "t")
    assert await d.drain(V1, 30, "again", "u") == first  # idempotent: the first drain stands
    assert [(h.phase, h.who) for h in await c.history("m")][-1] == ("Draining", "t")
    again = await controller(tmp_path, clock)
    assert again.drains[V1] == first and again.reconciler.overlay.draining == {V1}
    await EndpointDrains(again).forget(V1, "stopped", "autoscaler")
    assert again.drains == {} and (await again.history("m"))[-1].phase == "Removed"


@run_async
async def test_whoever_acts_on_a_drained_endpoint_hears_of_it_once_when_it_is_drained(tmp_path: Path) -> None:
    clock, signals = Clock(), SignalStore()
    c = await controller(tmp_path, clock, signals)
    d = EndpointDrains(c)
    heard: list[tuple[str, str]] = []

    async def drained(address: str) -> None:
        heard.append((address, d.drains[address].state))  # stored as drained before the call

    d.on_drained.append(drained)
    await d.drain(V1, 60, "scale down", "autoscaler")
    signals.record_lrs(("m", V1), "envoy", in_progress=1, issued=0, succeeded=0, failed=0, now=10**9)
    clock.t += 5
    await c.tick()
    assert heard == []  # a request still in flight
    signals.forget_node("envoy")
    await c.tick()
    await c.tick()
    assert heard == [(V1, "drained")]
