"""The rollout controller over a real SQLite store and reconciler (no network)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from controlplane import limits
from controlplane.fleet.loader import parse_fleet
from controlplane.obs.metrics import Metrics
from controlplane.rollout import machine
from controlplane.rollout.controller import LRS_RECONNECT_S, CommandRejected, RolloutController
from controlplane.rollout.machine import RolloutSpec
from controlplane.rollout.store import RolloutStore
from controlplane.signals.parse import ServerSample
from controlplane.signals.store import EndpointCounters, ScrapeResult, SignalStore
from controlplane.xds.cache import SnapshotCache
from controlplane.xds.reconciler import Reconciler
from controlplane.xds.server import ProxyRegistry

FLEET = """
listener: {port: 10000}
tiers: {small: {}}
models:
  m:
    params_b: 8
    stable: v1
    versions:
      v1: {endpoints: [{address: "127.0.0.1:8001"}]}
      v2: {endpoints: [{address: "127.0.0.1:8002"}]}
"""
V1, V2 = "127.0.0.1:8001", "127.0.0.1:8002"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0
        self.canary: float | None = None  # blind_steps: the canary's successes so far

    def __call__(self) -> float:
        return self.t


def run_async(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop (pytest sees the same signature)."""

    @functools.wraps(fn)
    def run(*args: object, **kwargs: object) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


async def controller(state: Path, clock: Clock, signals: SignalStore | None = None) -> RolloutController:
    metrics = Metrics()
    c = RolloutController(
        RolloutStore(state),
        Reconciler(SnapshotCache(), metrics),
        signals or SignalStore(),
        ProxyRegistry(),
        metrics,
        clock=clock,
    )
    await c.restore()
    c.set_file_fleet(parse_fleet(FLEET))
    clock.t += limits.FILE_SETTLE_S
    await c.reconcile_file()
    return c


def served_versions(c: RolloutController) -> list[str]:
    assert c.reconciler.fleet is not None
    return [v.name for v in c.reconciler.fleet.models[0].versions]


@pytest.mark.parametrize(
    ("req", "code", "text"),
    [
        (RolloutSpec("nope", "", "v2"), "NOT_FOUND", "unknown model 'nope'"),
        (RolloutSpec("m", "", "v9"), "NOT_FOUND", "has no version 'v9' (it has: v1, v2)"),
        (RolloutSpec("m", "", "v1"), "INVALID_ARGUMENT", "already the stable version"),
        (RolloutSpec("m", "", "v2", steps=(50, 25, 100)), "INVALID_ARGUMENT", "must increase"),
        (RolloutSpec("m", "", "v2", steps=(5, 150)), "INVALID_ARGUMENT", "each 1-100"),
    ],
)
@run_async
async def test_bad_starts_are_refused_with_the_reason(
    tmp_path: Path, req: RolloutSpec, code: str, text: str
) -> None:
    c = await controller(tmp_path, Clock())
    with pytest.raises(CommandRejected) as e:
        await c.start(req, "t")
    assert e.value.code == code
    assert text in str(e.value)
    assert c.rollouts == {}


@run_async
async def test_second_rollout_and_promoting_an_aborted_one_are_preconditions(tmp_path: Path) -> None:
    c = await controller(tmp_path, Clock())
    await c.start(RolloutSpec("m", "", "v2", interval_s=None), "t")
    with pytest.raises(CommandRejected, match="already has a rollout to v2") as e:
        await c.start(RolloutSpec("m", "", "v2"), "t")
    assert e.value.code == "FAILED_PRECONDITION"
    await c.command("m", machine.Abort(), "t")
    with pytest.raises(CommandRejected, match="Aborted; start a new one") as e:
        await c.command("m", machine.Promote(), "t")
    assert e.value.code == "FAILED_PRECONDITION"


@run_async
async def test_full_rollout_promotes_then_drains_and_retires_the_old_version(tmp_path: Path) -> None:
    clock, signals = Clock(), SignalStore()
    c = await controller(tmp_path, clock, signals)
    await c.start(RolloutSpec("m", "", "v2", interval_s=10, min_requests=10), "t")
    await c.tick()  # no proxies connected: step 1 at once
    assert c.rollouts["m"].weights == {"v1": 95, "v2": 5}
    assert c.reconciler.overlay.splits == {"m": (("v1", 95), ("v2", 5))}
    for step, weight in ((2, 25), (3, 50), (4, 100)):
        await c.tick()  # baseline for the step's analysis
        clock.t += 11
        signals.record_lrs(("m", V2), "envoy", in_progress=0, issued=20, succeeded=20, failed=0, now=0)
        await c.tick()
        assert c.rollouts["m"].step + 1 == step, c.rollouts["m"].reason
        assert c.rollouts["m"].weights["v2"] == weight
    await c.tick()
    clock.t += 11
    signals.record_lrs(("m", V2), "envoy", in_progress=0, issued=20, succeeded=20, failed=0, now=0)
    await c.tick()
    # 100% passed: the old version leaves (no route names it, not even x-model-version) ...
    assert (c.rollouts["m"].phase, c.rollouts["m"].finishing) == ("Progressing", True)
    assert c.layers["m"].versions["v1"][0] == "leaving"
    assert c.reconciler.overlay.unrouted == {"m@v1"}
    await c.tick()  # ... and no proxy routes to it: completed
    assert c.rollouts["m"].phase == "Completed"
    assert c.reconciler.fleet is not None and c.reconciler.fleet.models[0].stable == "v2"
    # The old version leaves: no route sends to it, its endpoints untouched until every
    # proxy has the new routes (a second at least) ...
    assert c.reconciler.overlay.draining == frozenset()
    assert c.layers["m"].versions["v1"][0] == "leaving"
    clock.t += 1.5
    await c.tick()
    assert c.reconciler.overlay.draining == {V1}  # ... then drains ...
    clock.t += 5
    await c.tick()  # ... nothing in flight: retired, its cluster removed
    assert served_versions(c) == ["v2"]
    assert c.reconciler.overlay.draining == frozenset()
    phases = [a.phase for a in await c.history("m")]
    assert phases[0] == "Progressing" and phases[-3:] == ["Completed", "Draining", "Retired"]


@run_async
async def test_failed_analysis_aborts_and_the_canary_drains(tmp_path: Path) -> None:
    clock, signals = Clock(), SignalStore()
    c = await controller(tmp_path, clock, signals)
    await c.start(RolloutSpec("m", "", "v2", interval_s=30, min_requests=20, max_error_rate=0.05), "t")
    await c.tick()
    await c.tick()
    signals.record_lrs(("m", V2), "envoy", in_progress=0, issued=10, succeeded=9, failed=1, now=0)
    await c.tick()  # 10 requests: too few to judge, but the figures are exported
    assert c.rollouts["m"].phase == "Progressing"
    assert (
        'controlplane_rollout_analysis_error_ratio{model="m",role="canary",version="v2"} 0.1'
        in generate_latest(c.metrics.registry).decode()
    )
    signals.record_lrs(("m", V2), "envoy", in_progress=0, issued=15, succeeded=11, failed=4, now=0)
    clock.t += 1
    await c.tick()  # within the step's interval: judged as soon as there are enough requests
    r = c.rollouts["m"]
    assert r.phase == "Aborted"
    assert "error rate 20.00% over 25 requests" in r.reason
    # The finished rollout's error-rate series are gone, not frozen at their last value.
    text = generate_latest(c.metrics.registry).decode()
    assert "controlplane_rollout_analysis_error_ratio{" not in text
    assert "controlplane_rollout_analysis_requests{" not in text
    assert 'controlplane_rollout_phase{model="m",phase="Aborted"} 1.0' in text
    assert c.reconciler.overlay.splits == {}
    assert c.reconciler.overlay.draining == frozenset()  # routes first ...
    clock.t += 1.5
    await c.tick()
    assert c.reconciler.overlay.draining == {V2}  # ... then the canary drains


@run_async
async def test_restart_resumes_at_the_same_step_and_keeps_api_state_over_file_reloads(tmp_path: Path) -> None:
    clock = Clock()
    c = await controller(tmp_path, clock)
    await c.start(RolloutSpec("m", "", "v2", interval_s=None), "t")
    await c.tick()
    await c.command("m", machine.Promote(), "t")
    await c.store.close()
    again = await controller(tmp_path, clock)  # as after kill -9: only the store survives
    r = again.rollouts["m"]
    assert (r.phase, r.step, r.weights) == ("Progressing", 1, {"v1": 75, "v2": 25})
    assert again.reconciler.overlay.splits == {"m": (("v1", 75), ("v2", 25))}
    await again.command("m", machine.Promote(full=True), "t")
    await again.tick()  # no proxy routes to v1: completed
    again.set_file_fleet(parse_fleet(FLEET))  # a reload of the unchanged file
    assert again.reconciler.fleet is not None and again.reconciler.fleet.models[0].stable == "v2"
    # The operator writes the new stable into the file: the file wins, the layer is dropped.
    again.set_file_fleet(parse_fleet(FLEET.replace("stable: v1", "stable: v2")))
    clock.t += limits.FILE_SETTLE_S
    await again.reconcile_file()
    assert again.layers == {}
    assert served_versions(again) == ["v1", "v2"]


@run_async
async def test_a_file_that_drops_the_canary_aborts_the_rollout(tmp_path: Path) -> None:
    clock = Clock()
    c = await controller(tmp_path, clock)
    await c.start(RolloutSpec("m", "", "v2"), "t")
    c.set_file_fleet(parse_fleet(FLEET.replace('      v2: {endpoints: [{address: "127.0.0.1:8002"}]}\n', "")))
    assert c.reconciler.overlay.splits == {}  # served without the split at once ...
    await c.reconcile_file()
    assert c.rollouts["m"].phase == "Progressing"  # ... but not stored from one reading
    clock.t += limits.FILE_SETTLE_S
    await c.reconcile_file()  # ... and recorded as aborted once the file held still
    assert c.rollouts["m"].phase == "Aborted"
    assert "no longer has version v2" in c.rollouts["m"].reason


@run_async
async def test_a_file_caught_half_written_does_not_abort_a_rollout(tmp_path: Path) -> None:
    """Issue 16, F7: the file read mid-write lacks the canary for a moment, then is whole
    again: the rollout carries on, and nothing destructive was stored."""
    clock = Clock()
    c = await controller(tmp_path, clock)
    await c.start(RolloutSpec("m", "", "v2"), "t")
    whole = parse_fleet(FLEET)
    c.set_file_fleet(parse_fleet(FLEET.replace('      v2: {endpoints: [{address: "127.0.0.1:8002"}]}\n', "")))
    clock.t += 0.6
    await c.reconcile_file()
    c.set_file_fleet(whole)
    clock.t += limits.FILE_SETTLE_S
    await c.reconcile_file()
    assert c.rollouts["m"].phase == "Progressing"
    assert [h.phase for h in await c.history("m")] == ["Progressing"]


@run_async
async def test_undo_rolls_back_to_the_replaced_version(tmp_path: Path) -> None:
    clock = Clock()
    c = await controller(tmp_path, clock)
    await c.start(RolloutSpec("m", "", "v2", interval_s=None), "t")
    await c.tick()
    await c.command("m", machine.Promote(full=True), "t")
    for _ in range(3):  # leaving (completed), then draining, then retired
        clock.t += 5
        await c.tick()
    assert served_versions(c) == ["v2"]
    r = await c.undo("m", "t")
    assert (r.spec.stable, r.spec.canary) == ("v2", "v1")
    assert served_versions(c) == ["v1", "v2"]  # v1 is back in service for the rollout


def vllm(successes: float) -> ScrapeResult:
    return ScrapeResult(sample=ServerSample("vllm", successes=successes))


async def blind_steps(
    c: RolloutController, clock: Clock, signals: SignalStore, seconds: int, canary_per_s: float = 5.0
) -> None:
    """Traffic as vLLM servers count it (successes only) for `seconds`, one tick a second:
    100 requests a second to the stable version, `canary_per_s` to the canary."""
    for _ in range(seconds):
        clock.t += 1
        clock.canary = (5.0 * (clock.t - 1) if clock.canary is None else clock.canary) + canary_per_s
        signals.record_scrape(("m", V1), vllm(100.0 * clock.t), clock.t)
        signals.record_scrape(("m", V2), vllm(clock.canary), clock.t)
        await c.tick()


@run_async
async def test_without_load_reports_a_vllm_canary_pauses_as_inconclusive_at_its_interval(
    tmp_path: Path,
) -> None:
    clock, signals = Clock(), SignalStore()
    c = await controller(tmp_path, clock, signals)
    await c.tick()  # this replica drives from now on ...
    clock.t += LRS_RECONNECT_S  # ... long enough for every proxy to have reported, if it does
    await c.start(RolloutSpec("m", "", "v2", interval_s=10, min_requests=10), "t")
    await c.tick()
    started = c.rollouts["m"].step_started_at
    await blind_steps(c, clock, signals, 9)
    assert c.rollouts["m"].phase == "Progressing"
    assert "no load reports" in c.inconclusive["m"]  # shown meanwhile, not stored
    await blind_steps(c, clock, signals, 1)
    r = c.rollouts["m"]
    assert (r.phase, clock.t - started) == ("Paused", 10)
    assert r.reason.startswith("inconclusive: no load reports from proxies for m/v2")
    assert "(vllm) do not count every failed request" in r.reason
    assert [a.reason for a in await c.history("m")][-1] == r.reason
    # The same traffic with one proxy's load report (zero counts even) is covered.
    await c.command("m", machine.Promote(), "t")
    await c.tick()
    await blind_steps(c, clock, signals, 2, canary_per_s=34.0)  # 25% now
    signals.record_lrs(("m", V1), "envoy", in_progress=0, issued=0, succeeded=0, failed=0, now=clock.t)
    await blind_steps(c, clock, signals, 9, canary_per_s=34.0)
    r = c.rollouts["m"]
    assert (r.phase, r.weights["v2"]) == ("Progressing", 50), r.reason


@run_async
async def test_right_after_taking_the_lead_missing_reports_prove_nothing(tmp_path: Path) -> None:
    # Envoy reopens a load-report stream 5 s after it broke: a new leader waits before it
    # concludes that none come, and holds the step meanwhile rather than pass it.
    clock, signals = Clock(), SignalStore()
    c = await controller(tmp_path, clock, signals)
    await c.start(RolloutSpec("m", "", "v2", interval_s=5, min_requests=10), "t")
    await c.tick()
    await blind_steps(c, clock, signals, int(LRS_RECONNECT_S) + 4)
    assert (c.rollouts["m"].phase, c.rollouts["m"].weights["v2"]) == ("Progressing", 5)
    await blind_steps(c, clock, signals, 2)
    assert c.rollouts["m"].phase == "Paused"


@run_async
async def test_load_reports_received_by_another_replica_cover_the_canary(tmp_path: Path) -> None:
    clock, signals = Clock(), SignalStore()
    peer = {"at": None}

    def peer_reports(key: tuple[str, str]) -> EndpointCounters:
        return (
            EndpointCounters(lrs_ok=1.0, lrs_reported_at=peer["at"]) if key[1] == V1 else EndpointCounters()
        )

    c = await controller(tmp_path, clock, signals)
    c.peer_reports = peer_reports
    await c.tick()
    clock.t += LRS_RECONNECT_S
    await c.start(RolloutSpec("m", "", "v2", interval_s=10, min_requests=10), "t")
    await c.tick()
    for _ in range(11):
        peer["at"] = clock.t  # another replica keeps receiving envoy's reports
        await blind_steps(c, clock, signals, 1)
    assert (c.rollouts["m"].phase, c.rollouts["m"].weights["v2"]) == ("Progressing", 25)


@run_async
async def test_a_manual_step_shows_it_is_inconclusive_and_never_pauses(tmp_path: Path) -> None:
    from controlplane.admin.service import rollout_message

    clock, signals = Clock(), SignalStore()
    c = await controller(tmp_path, clock, signals)
    await c.tick()
    clock.t += LRS_RECONNECT_S
    await c.start(RolloutSpec("m", "", "v2", interval_s=None), "t")
    await c.tick()
    await blind_steps(c, clock, signals, 30)
    r = c.rollouts["m"]
    assert r.phase == "Progressing"
    shown = rollout_message(c, r).reason
    assert shown.startswith(r.reason) and "; analysis so far inconclusive: no load reports" in shown
    await c.command("m", machine.Promote(), "t")  # a new step: its own analysis
    assert rollout_message(c, c.rollouts["m"]).reason == c.rollouts["m"].reason


def loop_value(c: RolloutController, name: str, **labels: str) -> float | None:
    return c.metrics.registry.get_sample_value(name, {"loop": "rollout", **labels})


@run_async
async def test_the_leaders_ticks_are_counted_and_a_follower_has_no_rollout_loop(tmp_path: Path) -> None:
    c = await controller(tmp_path, Clock())
    c.tick_s = 0.5
    await c.one_round()
    assert loop_value(c, "controlplane_loop_rounds_total", result="ok") == 1
    last = loop_value(c, "controlplane_loop_last_success_timestamp_seconds")
    assert last is not None and loop_value(c, "controlplane_loop_interval_seconds") == 0.5

    async def broken() -> None:
        raise RuntimeError("store answered nonsense")

    c.tick = broken  # type: ignore[method-assign]
    await c.one_round()
    assert loop_value(c, "controlplane_loop_rounds_total", result="error") == 1
    assert loop_value(c, "controlplane_loop_last_success_timestamp_seconds") == last
    # Another replica leads: this one does not tick, and has no last success to age.
    c.leader = False
    await c.one_round()
    assert loop_value(c, "controlplane_loop_last_success_timestamp_seconds") is None
    assert loop_value(c, "controlplane_loop_interval_seconds") is None
    assert loop_value(c, "controlplane_loop_rounds_total", result="error") == 1


@run_async
async def test_rollout_series_follow_the_latest_rollout_and_the_models_in_the_file(tmp_path: Path) -> None:
    clock = Clock()
    c = await controller(tmp_path, clock)
    await c.start(RolloutSpec("m", "", "v2", interval_s=None), "t")
    await c.tick()
    text = generate_latest(c.metrics.registry).decode()
    assert 'controlplane_rollout_version_weight_ratio{model="m",version="v1"} 0.95' in text
    # The next rollout names other versions: the earlier one's weights do not linger.
    await c.command("m", machine.Abort(), "t")
    c.set_file_fleet(parse_fleet(FLEET.replace("v2: {endpoints", "v3: {endpoints")))
    clock.t += limits.FILE_SETTLE_S
    await c.reconcile_file()
    await c.start(RolloutSpec("m", "", "v3", interval_s=None), "t")
    await c.tick()
    text = generate_latest(c.metrics.registry).decode()
    assert 'version="v2"' not in text
    assert 'controlplane_rollout_version_weight_ratio{model="m",version="v3"}' in text
    # The model leaves the file: its rollout record stays, its series go.
    c.set_file_fleet(parse_fleet(FLEET.replace("  m:\n", "  n:\n")))
    assert c.metrics.registry.get_sample_value("controlplane_rollout_step", {"model": "m"}) is None
    c.metrics.retain_models({"n"})  # the weight loop's sweep, every round
    c.publish()
    text = generate_latest(c.metrics.registry).decode()
    assert 'model="m"' not in text
    assert "m" in c.rollouts


@run_async
async def test_only_the_leader_exports_rollout_series_and_a_former_leaders_go(tmp_path: Path) -> None:
    clock, signals = Clock(), SignalStore()
    c = await controller(tmp_path, clock, signals)
    await c.start(RolloutSpec("m", "", "v2", interval_s=30, min_requests=20, max_error_rate=0.05), "t")
    await c.tick()
    await c.tick()
    signals.record_lrs(("m", V2), "envoy", in_progress=0, issued=10, succeeded=9, failed=1, now=0)
    await c.tick()
    get = c.metrics.registry.get_sample_value
    canary = {"model": "m", "version": "v2", "role": "canary"}
    assert get("controlplane_rollout_analysis_requests", canary) == 10
    assert get("controlplane_rollout_analysis_error_ratio", canary) == 0.1
    assert get("controlplane_rollout_step", {"model": "m"}) is not None
    # Leadership lost: the rollout goes on elsewhere; nothing of it stays here, frozen.
    c.set_leader(False)
    text = generate_latest(c.metrics.registry).decode()
    for family in ("phase", "step", "version_weight_ratio", "analysis_error_ratio", "analysis_requests"):
        assert f"controlplane_rollout_{family}{{" not in text, family
    assert "controlplane_endpoints_draining{" not in text
    # A follower that hears of a change (restore -> publish) still exports nothing.
    c.publish()
    assert "controlplane_rollout_phase{" not in generate_latest(c.metrics.registry).decode()
    # Leading again: the series come back from the state it holds.
    c.set_leader(True)
    assert get("controlplane_rollout_phase", {"model": "m", "phase": "Progressing"}) == 1
    assert get("controlplane_endpoints_draining", {"state": "draining"}) is not None


@run_async
async def test_a_holding_step_says_what_it_waits_for_as_counts_change_without_storing_it(
    tmp_path: Path,
) -> None:
    from controlplane.admin.service import rollout_message

    clock, signals = Clock(), SignalStore()
    c = await controller(tmp_path, clock, signals)
    await c.start(RolloutSpec("m", "", "v2", interval_s=30, min_requests=50), "t")
    await c.tick()  # no proxies connected: step 1 at once
    stored = c.rollouts["m"].reason
    assert stored == "every proxy has the canary's cluster and endpoints"
    await c.tick()  # the step's analysis takes its baseline
    assert rollout_message(c, c.rollouts["m"]).reason == "holding: 0/50 canary requests, 30s left in the step"
    shown = []
    for canary in (12, 20):
        clock.t += 6
        signals.record_lrs(
            ("m", V2), "envoy", in_progress=0, issued=canary, succeeded=canary, failed=0, now=0
        )
        signals.record_lrs(("m", V1), "envoy", in_progress=0, issued=200, succeeded=200, failed=0, now=0)
        await c.tick()
        shown.append(rollout_message(c, c.rollouts["m"]).reason)
    assert shown == [
        "holding: 12/50 canary requests, 24s left in the step",
        "holding: 32/50 canary requests, 18s left in the step",
    ]
    # Shown, not stored: the store and the audit trail keep the step's transition.
    assert (await RolloutStore(tmp_path).load()).rollouts["m"].reason == stored
    assert not any(a.reason.startswith(machine.HOLDING) for a in await c.history("m"))
    clock.t += 30
    await c.tick()
    assert c.rollouts["m"].reason == "holding: 32/50 canary requests; the step's 30s interval is over"
    signals.record_lrs(("m", V2), "envoy", in_progress=0, issued=18, succeeded=18, failed=0, now=0)
    signals.record_lrs(("m", V1), "envoy", in_progress=0, issued=100, succeeded=100, failed=0, now=0)
    await c.tick()
    assert (c.rollouts["m"].step, c.rollouts["m"].reason) == (1, "step 1 passed analysis")


@run_async
async def test_a_new_leader_reloads_the_stored_state_before_it_drives(tmp_path: Path) -> None:
    """A follower whose view missed a change (it lost its etcd member when another replica
    started a rollout) must not lead from that view: it would drive nothing, and the rollout
    would sit half-way with nobody to move it. At its first tick as leader it reloads."""
    clock = Clock()
    follower = await controller(tmp_path, clock)
    follower.set_leader(False)
    other = await controller(tmp_path, clock)  # the same store: another replica
    await other.start(RolloutSpec("m", "", "v2", interval_s=None), "t")
    assert follower.rollouts == {}  # it never heard of it
    follower.set_leader(True)
    await follower.one_round()
    assert follower.rollouts["m"].spec.canary == "v2"
    assert "v2" in served_versions(follower)
