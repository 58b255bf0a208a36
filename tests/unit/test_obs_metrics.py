"""The control plane's own vital signs (obs/): loop liveness, build info, process metrics,
event-loop lag, per-endpoint ages read between rounds, and the sweep of removed models."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import generate_latest

from controlplane import __version__
from controlplane.obs.endpoint_metrics import EndpointRow, EndpointRows
from controlplane.obs.metrics import LOOPS, Metrics
from controlplane.obs.runtime import LagWindow, watch_event_loop


def test_every_loop_counts_from_zero_and_a_failure_leaves_the_last_success() -> None:
    m = Metrics()
    m.loops.clock = lambda: 1000.0
    value = m.registry.get_sample_value
    for loop in LOOPS:
        assert value("controlplane_loop_rounds_total", {"loop": loop, "result": "error"}) == 0
        assert value("controlplane_loop_last_success_timestamp_seconds", {"loop": loop}) is None
    m.loops.succeeded("weights", 1.0)
    m.loops.clock = lambda: 1005.0
    m.loops.failed("weights", 1.0)
    assert value("controlplane_loop_last_success_timestamp_seconds", {"loop": "weights"}) == 1000.0
    assert value("controlplane_loop_rounds_total", {"loop": "weights", "result": "error"}) == 1
    m.loops.idle("weights")
    assert value("controlplane_loop_last_success_timestamp_seconds", {"loop": "weights"}) is None
    assert value("controlplane_loop_interval_seconds", {"loop": "weights"}) is None
    m.loops.idle("weights")  # idle twice: nothing to remove, no error


def test_build_info_and_the_process_metrics_are_on_our_registry() -> None:
    m = Metrics()
    value = m.registry.get_sample_value
    assert value("controlplane_build_info", {"version": __version__}) == 1
    assert (value("process_resident_memory_bytes") or 0) > 0
    assert (value("process_open_fds") or 0) > 0
    assert (value("process_start_time_seconds") or 0) > 0
    assert value("process_cpu_seconds_total") is not None
    assert "python_info{" in generate_latest(m.registry).decode()


def test_the_lag_shown_is_the_worst_of_the_window() -> None:
    w = LagWindow(window_s=10.0)
    assert w.add(0.0, 0.001) == 0.001
    assert w.add(1.0, 0.8) == 0.8  # a stall
    assert w.add(5.0, 0.002) == 0.8  # still within the window: a scrape now sees it
    assert w.add(11.0, 0.003) == 0.003  # gone after the window


def test_a_blocked_event_loop_shows_as_lag() -> None:
    m = Metrics()

    async def body() -> None:
        watcher = asyncio.create_task(watch_event_loop(m.event_loop_lag, probe_s=0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # a callback holding the loop
        await asyncio.sleep(0.05)
        watcher.cancel()

    asyncio.run(body())
    lag = m.registry.get_sample_value("controlplane_event_loop_lag_seconds")
    assert lag is not None and 0.1 < lag < 1.0


def test_signal_ages_grow_between_rounds() -> None:
    now = [100.0]
    rows = EndpointRows(clock=lambda: now[0])
    row = EndpointRow("m", "v1", "127.0.0.1:8000", 10, True, 1.0, 1, 0, 0.1, 0.2, 0.0, 0.5, 0.0, 0)
    rows.publish((row,), at=100.0)
    now[0] = 107.0  # no round since (a stalled loop): the page read is 7 s older
    ages = {
        s.labels["endpoint"]: s.value
        for f in rows.collect()
        if f.name == "controlplane_endpoint_signal_age_seconds"
        for s in f.samples
    }
    weights = [s.value for f in rows.collect() if f.name == "controlplane_endpoint_weight" for s in f.samples]
    assert ages == {"127.0.0.1:8000": 7.5} and weights == [10]


def test_the_sweep_removes_only_models_the_fleet_no_longer_has() -> None:
    m = Metrics()
    m.balancing.saturation.labels("gone").set(3)
    m.balancing.shed.labels("gone", "batch").set(1)
    m.balancing.saturation.labels("kept").set(1)
    m.autoscaling.version_desired.labels("gone", "v1").set(2)
    m.model_build_errors.labels("(gateway)").inc()  # not a model
    m.rollouts.transitions.labels("", "Drained").inc()  # a drain of an endpoint in no model
    m.retain_models({"kept"})
    page = generate_latest(m.registry).decode()
    assert 'model="gone"' not in page
    assert 'model="kept"' in page and 'model="(gateway)"' in page and 'model=""' in page


def test_version_endpoints_count_each_state_and_every_state_is_present() -> None:
    def row(version: str, n: int, ready: bool, was_ready: bool) -> EndpointRow:
        return EndpointRow(
            "m",
            version,
            f"127.0.0.{n}:8000",
            10 if ready else 0,
            ready,
            1.0,
            0,
            0,
            0.0,
            0.1,
            0.0,
            0.5,
            0.0,
            0,
            was_ready=was_ready or ready,
        )

    rows = EndpointRows(clock=lambda: 0.0)
    rows.publish(
        (
            row("v1", 1, True, True),
            row("v1", 2, False, True),  # was ready, is not now: held out
            row("v1", 3, False, False),  # never ready since it joined: warming
            row("v2", 4, False, False),
        ),
        at=0.0,
    )
    families = {f.name: f for f in rows.collect()}
    got = {
        (s.labels["version"], s.labels["state"]): s.value
        for s in families["controlplane_version_endpoints"].samples
    }
    assert got == {
        ("v1", "ready"): 1,
        ("v1", "held_out"): 1,
        ("v1", "warming"): 1,
        ("v2", "ready"): 0,  # present at 0: "no ready endpoint" is a sample, not an absence
        ("v2", "held_out"): 0,
        ("v2", "warming"): 1,
    }
