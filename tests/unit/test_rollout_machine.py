from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.rollout.machine import (
    HOLDING,
    INCONCLUSIVE,
    INCONCLUSIVE_AFTER_S,
    Abort,
    Analysis,
    Drain,
    Leave,
    Pause,
    Promote,
    Resume,
    Return,
    Rollout,
    RolloutRejected,
    RolloutSpec,
    SetStable,
    SetWeights,
    Tick,
    Transition,
    apply,
    duration_text,
    inconclusive,
    run,
    start,
)

SPEC = RolloutSpec(model="chat", stable="v1", canary="v2", interval_s=10.0, min_requests=10)
GOOD = Analysis(canary_requests=100, canary_error_rate=0.0, canary_p99_s=1.0, stable_p99_s=1.0)


def weights(effects: list[object]) -> list[dict[str, int]]:
    return [dict(e.weights) for e in effects if isinstance(e, SetWeights)]


def test_no_weight_before_every_proxy_has_the_canary() -> None:
    r, eff = start(SPEC, now=0.0)
    assert weights(eff) == [{"v1": 100, "v2": 0}]
    r, eff = apply(r, Tick(1.0, unacked_proxies=("envoy-2",)))
    assert (r.step, r.weight, eff) == (-1, 0, [])
    r, eff = apply(r, Tick(2.0))
    assert (r.step, r.weight) == (0, 5) and weights(eff) == [{"v1": 95, "v2": 5}]


def test_a_proxy_that_never_acks_pauses_the_rollout_naming_it() -> None:
    r, _ = start(SPEC, now=0.0)
    r, _ = apply(r, Tick(29.0, unacked_proxies=("envoy-9",)))
    assert r.phase == "Progressing"
    r, _ = apply(r, Tick(30.0, unacked_proxies=("envoy-9", "envoy-3")))
    assert r.phase == "Paused" and "envoy-3, envoy-9" in r.reason and r.weight == 0
    r, _ = apply(r, Resume())
    r, _ = apply(r, Tick(31.0))
    assert (r.phase, r.weight) == ("Progressing", 5)


def test_steps_advance_on_interval_with_enough_evidence_then_complete() -> None:
    r, _ = start(SPEC, now=0.0)
    r, _ = apply(r, Tick(0.0))
    seen = [r.weight]
    t = 0.0
    while r.phase == "Progressing":
        t += 5.0
        r, eff = apply(r, Tick(t, analysis=GOOD))
        seen += [w["v2"] for w in weights(eff)]
    assert seen == [5, 25, 50, 100, 100]
    assert r.phase == "Completed"
    assert any(isinstance(e, SetStable) and e.version == "v2" for e in eff)
    assert any(isinstance(e, Drain) and e.version == "v1" for e in eff)


def test_a_step_waits_for_min_requests_before_advancing() -> None:
    r, _ = run(SPEC, [Tick(0.0), Tick(20.0, analysis=Analysis(canary_requests=3, canary_error_rate=0.0))])
    assert r.weight == 5


def test_a_failing_canary_aborts_at_once_and_drains() -> None:
    r, _ = run(SPEC, [Tick(0.0), Tick(1.0, analysis=GOOD)])
    bad = Analysis(canary_requests=40, canary_error_rate=0.2, stable_error_rate=0.0)
    r, eff = apply(r, Tick(2.0, analysis=bad))
    assert r.phase == "Aborted" and r.weight == 0
    assert weights(eff) == [{"v1": 100, "v2": 0}]
    assert Drain("chat", "v2") in eff
    assert "20.00%" in r.reason
    slow = Analysis(canary_requests=40, canary_error_rate=0.0, canary_p99_s=3.0, stable_p99_s=1.0)
    r2, _ = run(SPEC, [Tick(0.0), Tick(1.0, analysis=slow)])
    assert r2.phase == "Aborted" and "3.00x" in r2.reason


def test_manual_gates_advance_only_by_promote() -> None:
    manual = RolloutSpec(model="chat", stable="v1", canary="v2", interval_s=None)
    r, _ = run(manual, [Tick(0.0), Tick(1000.0, analysis=GOOD)])
    assert r.weight == 5
    r, _ = apply(r, Promote())
    assert r.weight == 25
    r, eff = apply(r, Promote(full=True))
    # 100%: the old stable leaves first; complete once no proxy routes to it.
    assert (r.phase, r.weight, r.finishing) == ("Progressing", 100, True) and Leave("chat", "v1") in eff
    r, eff = apply(r, Tick(1001.0))
    assert r.phase == "Completed" and SetStable("chat", "v2") in eff and Drain("chat", "v1") in eff


def test_promote_full_on_a_timed_rollout_completes_without_waiting_out_the_interval() -> None:
    r, _ = run(SPEC, [Tick(0.0), Tick(10.0, analysis=GOOD)])
    assert r.step == 1 and not r.finishing
    r, eff = apply(r, Promote(full=True))
    assert (r.finishing, r.weight) == (True, 100) and Leave("chat", "v1") in eff
    r, eff = apply(r, Tick(11.0, analysis=GOOD, still_routed=("envoy-2",)))
    assert r.phase == "Progressing"  # the same make-before-break wait as any completion
    r, eff = apply(r, Tick(12.0, analysis=GOOD))
    assert r.phase == "Completed" and SetStable("chat", "v2") in eff


def test_a_promoted_step_starts_its_own_clock() -> None:
    assert SPEC.interval_s is not None
    r, _ = run(SPEC, [Tick(0.0), Tick(10.0, analysis=GOOD)])
    step = r.step
    r, _ = apply(r, Tick(15.0, analysis=GOOD))  # halfway through the step's interval
    r, _ = apply(r, Promote())
    assert r.step == step + 1
    r, _ = apply(r, Tick(16.0, analysis=GOOD))  # the clock starts here, not at 10 s
    r, _ = apply(r, Tick(16.0 + SPEC.interval_s - 0.5, analysis=GOOD))
    assert r.step == step + 1  # not auto-advanced on the previous step's clock
    r, _ = apply(r, Tick(16.0 + SPEC.interval_s, analysis=GOOD))
    assert r.step == step + 2


def test_the_old_stable_drains_only_once_no_proxy_routes_to_it() -> None:
    r, _ = run(SPEC, [Tick(0.0), *(Tick(t, analysis=GOOD) for t in (10.0, 20.0, 30.0, 40.0))])
    assert (r.finishing, r.weight) == (True, 100)
    r, eff = apply(r, Tick(41.0, analysis=GOOD, still_routed=("envoy-2",)))
    assert (r.phase, eff) == ("Progressing", [])  # envoy-2's ACKed routes still name v1
    r, eff = apply(r, Tick(42.0, analysis=GOOD))
    assert r.phase == "Completed"
    assert [type(e) for e in eff] == [SetStable, Drain, type(eff[-1])]


def test_a_proxy_still_routing_to_the_old_stable_pauses_the_rollout_naming_it() -> None:
    r, _ = run(SPEC, [Tick(0.0), *(Tick(t, analysis=GOOD) for t in (10.0, 20.0, 30.0, 40.0))])
    r, _ = apply(r, Tick(41.0, still_routed=("stuck-proxy",)))  # the wait starts
    r, _ = apply(r, Tick(70.0, still_routed=("stuck-proxy",)))
    assert r.phase == "Progressing"
    r, _ = apply(r, Tick(71.0, still_routed=("stuck-proxy",)))
    assert r.phase == "Paused" and "stuck-proxy" in r.reason and "v1" in r.reason
    assert r.weight == 100  # the canary keeps every request meanwhile
    # Resume waits again, from the next tick.
    r, _ = apply(r, Resume())
    r, _ = apply(r, Tick(200.0, still_routed=("stuck-proxy",)))
    r, _ = apply(r, Tick(229.0, still_routed=("stuck-proxy",)))
    assert r.phase == "Progressing"
    # Promote completes it anyway; abort would have gone back to v1.
    done, eff = apply(r, Promote())
    assert done.phase == "Completed" and Drain("chat", "v1") in eff
    back, eff = apply(r, Abort())
    assert back.phase == "Aborted" and Return("chat", "v1") in eff and weights(eff) == [{"v1": 100, "v2": 0}]


def test_commands_on_a_finished_rollout_are_rejected() -> None:
    r, _ = run(SPEC, [Tick(0.0), Abort()])
    with pytest.raises(RolloutRejected) as e:
        apply(r, Promote())
    assert e.value.code == "FAILED_PRECONDITION"
    assert apply(r, Tick(5.0)) == (r, [])


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ((25, 5, 100), "must increase"),
        ((5, 150), "each 1-100"),
        ((5, 50), "last step must be 100"),
        ((), "must"),
    ],
)
def test_bad_steps_are_invalid_arguments(steps: tuple[int, ...], message: str) -> None:
    with pytest.raises(RolloutRejected, match=message) as e:
        start(RolloutSpec(model="m", stable="v1", canary="v2", steps=steps), 0.0)
    assert e.value.code == "INVALID_ARGUMENT"


def test_pause_holds_the_step_but_a_failure_still_aborts() -> None:
    r, _ = run(SPEC, [Tick(0.0), Pause()])
    r, _ = apply(r, Tick(100.0, analysis=GOOD))
    assert (r.phase, r.weight) == ("Paused", 5)
    r, _ = apply(r, Tick(101.0, analysis=Analysis(canary_requests=50, canary_error_rate=0.5)))
    assert r.phase == "Aborted"


commands = st.lists(
    st.one_of(
        st.builds(
            Tick,
            st.floats(0, 1000),
            st.sampled_from([(), ("envoy-1",)]),
            st.sampled_from([None, GOOD]),
            st.sampled_from([(), ("envoy-2",)]),
        ),
        st.just(Pause()),
        st.just(Resume()),
        st.builds(Promote, st.booleans()),
        st.just(Abort()),
        st.just(Tick(0.0, (), Analysis(canary_requests=100, canary_error_rate=0.5))),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(commands)
def test_invariants_hold_for_any_command_sequence(cmds: list[object]) -> None:
    r, eff = run(SPEC, sorted_ticks(cmds))  # type: ignore[arg-type]
    for w in weights(eff):
        assert sum(w.values()) == 100 and all(0 <= v <= 100 for v in w.values())
    assert r.weight in (0, *SPEC.steps)
    if r.phase == "Aborted":
        assert r.weight == 0 and weights(eff)[-1] == {"v1": 100, "v2": 0}
    if r.phase == "Completed":
        assert r.weight == 100 and SetStable("chat", "v2") in eff
        # The old stable drains only after it left, and only once no proxy routed to it
        # (or the operator promoted it through).
        drain_at = eff.index(Drain("chat", "v1"))
        assert Leave("chat", "v1") in eff[:drain_at]
    # Make-before-break: a weight above 0 is only ever pushed after a tick with every proxy ACKed.
    first_live = next(
        (i for i, e in enumerate(eff) if isinstance(e, SetWeights) and dict(e.weights)["v2"] > 0), None
    )
    if first_live is not None:
        assert any(isinstance(c, Tick) and not c.unacked_proxies for c in cmds)


def sorted_ticks(cmds: list[object]) -> list[object]:
    """Time only moves forward: give ticks increasing times in their order."""
    out: list[object] = []
    t = 0.0
    for c in cmds:
        if isinstance(c, Tick):
            t += c.now / 100
            c = Tick(t, c.unacked_proxies, c.analysis, c.still_routed)
        out.append(c)
    return out


def test_shadow_must_be_a_percent() -> None:
    with pytest.raises(RolloutRejected, match="--shadow"):
        RolloutSpec("m", "v1", "v2", shadow_percent=101).check()


# ---- inconclusive analysis -------------------------------------------------------------------

# vLLM canary behind proxies without load reports: stable's successes show traffic flows, the
# canary's failures (if any) would show nowhere.
BLIND = Analysis(
    canary_requests=0,
    canary_error_rate=0.0,
    stable_requests=400,
    load_reports=False,
    canary_uncounted=("vllm",),
    window_s=9.0,
)


def test_a_step_no_error_signal_covers_pauses_when_its_interval_has_elapsed() -> None:
    r, _ = run(SPEC, [Tick(0.0)])
    r, eff = apply(r, Tick(9.0, analysis=BLIND))
    assert (r.phase, eff) == ("Progressing", [])  # within the interval: nothing yet
    r, eff = apply(r, Tick(10.0, analysis=BLIND))
    assert (r.phase, r.weight) == ("Paused", 5)
    assert r.reason.startswith("inconclusive: no load reports from proxies for chat/v2")
    assert "(vllm) do not count every failed request" in r.reason and "load_stats_config" in r.reason
    assert [e.reason for e in eff if isinstance(e, Transition)] == [r.reason]


def test_success_counts_without_an_error_signal_do_not_pass_either() -> None:
    # The server says 500 successes; nothing could have counted a failure.
    claimed = replace(BLIND, canary_requests=500, stable_requests=9500)
    r, _ = run(SPEC, [Tick(0.0), Tick(10.0, analysis=claimed)])
    assert r.phase == "Paused" and r.reason.startswith(INCONCLUSIVE)


@pytest.mark.parametrize(
    "covered",
    [
        replace(BLIND, canary_requests=100, load_reports=True),  # proxies count 5xx
        replace(BLIND, canary_requests=100, canary_uncounted=()),  # TGI / Triton count failures
    ],
)
def test_a_canary_with_an_error_signal_and_enough_requests_passes(covered: Analysis) -> None:
    r, _ = run(SPEC, [Tick(0.0), Tick(10.0, analysis=covered)])
    assert (r.phase, r.weight) == ("Progressing", 25)


def test_a_failing_canary_still_aborts_at_once_even_while_inconclusive() -> None:
    r, _ = run(SPEC, [Tick(0.0), Tick(10.0, analysis=BLIND)])
    assert r.phase == "Paused"
    bad = replace(BLIND, canary_requests=40, canary_error_rate=0.5, canary_uncounted=())
    r, _ = apply(r, Tick(11.0, analysis=bad))
    assert r.phase == "Aborted" and "50.00%" in r.reason


def test_a_short_window_holds_the_step_rather_than_pass_or_pause() -> None:
    # Right after a start or a failover, a window without load reports proves nothing yet;
    # nor may the step pass on it.
    short = replace(BLIND, canary_requests=100, window_s=INCONCLUSIVE_AFTER_S - 0.5)
    r, eff = apply(run(SPEC, [Tick(0.0)])[0], Tick(30.0, analysis=short))
    assert (r.phase, r.weight, eff) == ("Progressing", 5, [])
    r, _ = apply(r, Tick(31.0, analysis=replace(short, window_s=INCONCLUSIVE_AFTER_S)))
    assert r.phase == "Paused"


def test_no_traffic_at_all_is_not_inconclusive() -> None:
    idle = replace(BLIND, stable_requests=0)
    r, _ = run(SPEC, [Tick(0.0), Tick(100.0, analysis=idle)])
    assert (r.phase, r.weight) == ("Progressing", 5)  # holds for min_requests, as before
    r, _ = run(replace(SPEC, min_requests=0), [Tick(0.0), Tick(10.0, analysis=idle)])
    assert r.weight == 25  # --min-requests 0: nothing asked, nothing at risk


@pytest.mark.parametrize(
    ("weight_step", "stable", "canary", "paused"),
    [
        (0, 1900, 24, True),  # 5%: ~100 expected, 24 < 25
        (0, 1900, 25, False),  # a quarter of the share is enough
        (1, 300, 20, True),  # 25%: ~100 expected
        (0, 300, 0, False),  # 5%: ~16 expected, under SHARE_MIN_EXPECTED: too few to tell
    ],
)
def test_a_canary_far_below_its_share_is_inconclusive(
    weight_step: int, stable: int, canary: int, paused: bool
) -> None:
    covered = Analysis(canary_requests=canary, canary_error_rate=0.0, stable_requests=stable, window_s=10.0)
    spec = replace(SPEC, steps=(5, 25, 100) if weight_step == 0 else (25, 50, 100))
    r, _ = run(spec, [Tick(0.0), Tick(10.0, analysis=covered)])
    assert (r.phase == "Paused") is paused, r.reason
    if paused:
        assert r.reason.startswith(INCONCLUSIVE) and f"served {canary} requests" in r.reason
        assert "about 100" in r.reason and f"v1 served {stable}" in r.reason


def test_the_share_rule_waits_for_min_requests_worth_of_expectation() -> None:
    covered = Analysis(canary_requests=0, canary_error_rate=0.0, stable_requests=1900, window_s=10.0)
    assert inconclusive(replace(SPEC, min_requests=150), 5, covered) is None  # ~100 expected
    assert inconclusive(replace(SPEC, min_requests=50), 5, covered) is not None
    assert inconclusive(SPEC, 100, replace(covered, stable_requests=0, canary_requests=0)) is None


def test_manual_gates_never_pause_for_it_but_say_so() -> None:
    manual = replace(SPEC, interval_s=None)
    r, _ = run(manual, [Tick(0.0), Tick(1000.0, analysis=BLIND)])
    assert (r.phase, r.weight) == ("Progressing", 5)
    assert (inconclusive(manual, r.weight, BLIND) or "").startswith(INCONCLUSIVE)


def test_resume_starts_an_inconclusive_step_over_and_promote_goes_on() -> None:
    r, _ = run(SPEC, [Tick(0.0), Tick(10.0, analysis=BLIND)])
    assert r.phase == "Paused"
    on, _ = apply(r, Promote())
    assert (on.phase, on.weight) == ("Progressing", 25)
    r, _ = apply(r, Resume())
    assert r.phase == "Progressing" and "starts over" in r.reason
    r, _ = apply(r, Tick(50.0, analysis=BLIND))  # the step restarts here ...
    assert (r.phase, r.step_started_at) == ("Progressing", 50.0)
    r, _ = apply(r, Tick(59.0, analysis=BLIND))  # ... and gets a whole interval again
    assert r.phase == "Progressing"
    fixed = replace(BLIND, canary_requests=100, load_reports=True)
    r, _ = apply(r, Tick(60.0, analysis=fixed))
    assert (r.phase, r.weight) == ("Progressing", 25)


def test_resume_after_an_operator_pause_keeps_the_step_start() -> None:
    r, _ = run(SPEC, [Tick(0.0), Pause(), Resume()])
    r, _ = apply(r, Tick(10.0, analysis=GOOD))
    assert r.weight == 25  # the interval counted from the step's start, as before


analyses = st.builds(
    Analysis,
    canary_requests=st.integers(0, 500),
    canary_error_rate=st.sampled_from([0.0, 0.005]),
    stable_requests=st.integers(0, 5000),
    load_reports=st.booleans(),
    canary_uncounted=st.sampled_from([(), ("vllm",), ("unscraped",)]),
    window_s=st.sampled_from([1.0, 10.0]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.floats(0.5, 8.0), analyses), st.just(Resume())), max_size=25))
def test_no_step_passes_on_an_analysis_that_could_not_see_a_failure(
    moves: list[tuple[float, Analysis] | Resume],
) -> None:
    r, _ = run(SPEC, [Tick(0.0)])
    t = 0.0
    for m in moves:
        if isinstance(m, Resume):
            r = apply(r, m)[0] if r.phase == "Paused" else r
            continue
        t += m[0]
        before = r
        r, _ = apply(r, Tick(t, analysis=m[1]))
        if r.weight > before.weight:  # a step passed on this analysis
            assert inconclusive(SPEC, before.weight, m[1]) is None
            blind = not m[1].load_reports and m[1].canary_uncounted
            assert not blind or m[1].canary_requests + m[1].stable_requests == 0
        if r.phase == "Paused" and before.phase != "Paused":
            assert r.reason.startswith(INCONCLUSIVE)
            assert t - before.step_started_at >= SPEC.interval_s  # type: ignore[operator]


# ---- what a holding rollout waits for ---------------------------------------------------------

WAIT = RolloutSpec(model="chat", stable="v1", canary="v2", interval_s=30.0, min_requests=50)


def covered(canary: int, stable: int = 100, window_s: float = 10.0) -> Analysis:
    return Analysis(canary_requests=canary, canary_error_rate=0.0, stable_requests=stable, window_s=window_s)


def at_step(spec: RolloutSpec = WAIT, now: float = 0.0) -> Rollout:
    """The rollout at its first step, begun at `now`."""
    r, _ = run(spec, [Tick(now)], now=now)
    assert r.step == 0
    return r


@pytest.mark.parametrize(
    ("unacked", "now", "reason"),
    [
        (("gw-1",), 10.0, "holding: 1 proxy (gw-1) has not ACKed v2's cluster and endpoints, 20s left"),
        (
            ("gw-2", "gw-1"),
            0.0,
            "holding: 2 proxies (gw-1, gw-2) have not ACKed v2's cluster and endpoints, 30s",
        ),
        (
            ("a", "b", "c"),
            29.5,
            "holding: 3 proxies (a, b, c) have not ACKed v2's cluster and endpoints, 1s left",
        ),
        (("e", "d", "c", "b", "a"), 1.0, "holding: 5 proxies (a, b, c and 2 more) have not ACKed"),
    ],
)
def test_waiting_for_proxies_names_how_many_a_few_of_them_and_the_time_left(
    unacked: tuple[str, ...], now: float, reason: str
) -> None:
    r, _ = start(WAIT, now=0.0)
    r, eff = apply(r, Tick(now, unacked_proxies=unacked))
    assert (r.phase, r.step, eff) == ("Progressing", -1, [])
    assert r.reason.startswith(reason), r.reason
    assert r.reason.endswith("left before the rollout pauses")


@pytest.mark.parametrize(
    ("now", "analysis", "reason"),
    [
        # The step's first tick: the analysis has only taken its baseline.
        (0.0, None, "holding: 0/50 canary requests, 30s left in the step"),
        (12.0, covered(12), "holding: 12/50 canary requests, 18s left in the step"),
        (12.4, covered(12), "holding: 12/50 canary requests, 18s left in the step"),  # rounded up
        (29.0, covered(49), "holding: 49/50 canary requests, 1s left in the step"),
        # The quick start's symptom: nobody sends requests at all (said once the window is
        # long enough to tell).
        (3.0, covered(0, 0, window_s=3.0), "holding: 0/50 canary requests, 27s left in the step"),
        (5.0, covered(0, 0), "holding: 0/50 canary requests (no requests to chat in this step), 25s left"),
        (40.0, covered(12), "holding: 12/50 canary requests; the step's 30s interval is over"),
        (
            95.0,
            covered(0, 0),
            "holding: 0/50 canary requests (no requests to chat in this step); "
            "the step's 30s interval is over",
        ),
        (20.0, covered(62), "holding: 10s left in the step; 62 canary requests, within the limits so far"),
        (20.0, covered(50), "holding: 10s left in the step; 50 canary requests, within the limits so far"),
    ],
)
def test_a_timed_step_says_what_it_waits_for(now: float, analysis: Analysis | None, reason: str) -> None:
    r, eff = apply(at_step(), Tick(now, analysis=analysis))
    assert (r.phase, r.step, eff) == ("Progressing", 0, [])
    assert r.reason.startswith(reason), r.reason


def test_the_reason_follows_the_counts_and_the_clock_tick_by_tick() -> None:
    r = at_step()
    seen = []
    for now, n in ((1.0, 0), (2.0, 3), (10.0, 12), (20.0, 30), (31.0, 49)):
        before = r
        r, eff = apply(r, Tick(now, analysis=covered(n)))
        assert eff == [] and replace(r, reason=before.reason) == before  # only the reason changed
        seen.append(r.reason)
    assert seen == [
        "holding: 0/50 canary requests, 29s left in the step",
        "holding: 3/50 canary requests, 28s left in the step",
        "holding: 12/50 canary requests, 20s left in the step",
        "holding: 30/50 canary requests, 10s left in the step",
        "holding: 49/50 canary requests; the step's 30s interval is over",
    ]
    r, eff = apply(r, Tick(32.0, analysis=covered(50)))
    assert (r.step, r.reason) == (1, "step 1 passed analysis") and eff  # a transition, audited


def test_a_step_with_no_signal_for_canary_failures_says_so_while_it_holds() -> None:
    short = replace(BLIND, canary_requests=60, window_s=INCONCLUSIVE_AFTER_S - 1)
    r, _ = apply(at_step(), Tick(31.0, analysis=short))
    assert r.reason == (
        "holding: a signal that counts the canary's failures (no load reports yet); "
        "the step's 30s interval is over"
    )
    r, _ = apply(at_step(), Tick(3.0, analysis=replace(short, canary_requests=7)))
    assert r.reason == (
        "holding: 7/50 canary requests, a signal that counts the canary's failures (no load reports yet), "
        "27s left in the step"
    )


@pytest.mark.parametrize(
    ("analysis", "reason"),
    [
        (None, "holding: `cpctl rollout promote` (manual gates); 0/50 canary requests"),
        (covered(12), "holding: `cpctl rollout promote` (manual gates); 12/50 canary requests"),
        (
            covered(0, 0),
            "holding: `cpctl rollout promote` (manual gates); "
            "0/50 canary requests (no requests to chat in this step)",
        ),
        (
            covered(80),
            "holding: `cpctl rollout promote` (manual gates); 80 canary requests, within the limits so far",
        ),
    ],
)
def test_a_manual_step_waits_for_promote_and_shows_its_requests(
    analysis: Analysis | None, reason: str
) -> None:
    r, eff = apply(at_step(replace(WAIT, interval_s=None)), Tick(5000.0, analysis=analysis))
    assert (r.phase, r.step, eff, r.reason) == ("Progressing", 0, [], reason)


def test_a_promoted_step_counts_its_time_left_from_the_promote() -> None:
    r, _ = apply(at_step(), Tick(20.0, analysis=covered(10)))
    r, _ = apply(r, Promote())
    assert r.reason == "promoted by operator"
    r, eff = apply(r, Tick(25.0, analysis=None))  # the step's clock starts here
    assert (r.step, r.step_started_at) == (1, 25.0) and eff == []
    assert r.reason == "holding: 0/50 canary requests, 30s left in the step"
    r, _ = apply(r, Tick(40.0, analysis=covered(20)))
    assert r.reason == "holding: 20/50 canary requests, 15s left in the step"


def test_finishing_names_the_proxies_that_still_route_to_the_old_stable() -> None:
    r, _ = run(SPEC, [Tick(0.0), *(Tick(t, analysis=GOOD) for t in (10.0, 20.0, 30.0, 40.0))])
    assert r.finishing
    r, eff = apply(r, Tick(41.0, still_routed=("stuck",)))
    assert (
        eff == []
        and r.reason == "holding: 1 proxy (stuck) still routes to v1, 30s left before the rollout pauses"
    )
    r, eff = apply(r, Tick(61.0, still_routed=("b", "a", "c", "d")))
    assert eff == [] and r.reason == (
        "holding: 4 proxies (a, b, c and 1 more) still route to v1, 10s left before the rollout pauses"
    )
    r, eff = apply(r, Tick(71.0, still_routed=("stuck",)))
    assert r.phase == "Paused" and not r.reason.startswith(HOLDING)


def test_a_paused_or_finished_rollout_keeps_its_reason() -> None:
    r, _ = apply(at_step(), Tick(5.0, analysis=covered(3)))
    assert r.reason.startswith(HOLDING)
    p, _ = apply(r, Pause("look at the dashboards"))
    assert apply(p, Tick(6.0, analysis=covered(4))) == (p, [])
    r, _ = apply(p, Resume())
    assert r.reason == "resumed"
    r, _ = apply(r, Tick(7.0, analysis=covered(5)))
    assert r.reason == "holding: 5/50 canary requests, 23s left in the step"
    done, _ = apply(r, Abort())
    assert apply(done, Tick(8.0, analysis=covered(9))) == (done, [])


def test_min_requests_zero_waits_only_for_time() -> None:
    spec = replace(WAIT, min_requests=0)
    r, _ = apply(at_step(spec), Tick(10.0, analysis=covered(0, 0)))
    assert r.reason == "holding: 20s left in the step; 0 canary requests, within the limits so far"
    r, _ = apply(at_step(spec), Tick(10.0))
    assert r.reason == "holding: 20s left in the step"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-3.0, "0s"),
        (0.0, "0s"),
        (0.2, "1s"),
        (18.0, "18s"),
        (59.5, "1m"),
        (90.0, "1m30s"),
        (300.0, "5m"),
        (271.0, "4m31s"),
        (3600.0, "1h"),
        (3720.0, "1h2m"),
    ],
)
def test_duration_text(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


@settings(max_examples=300, deadline=None)
@given(commands)
def test_holding_is_shown_never_audited_and_only_while_progressing(cmds: list[object]) -> None:
    r, _ = start(SPEC, 0.0)
    for c in sorted_ticks(cmds):
        try:
            new, eff = apply(r, c)  # type: ignore[arg-type]
        except RolloutRejected:
            continue
        assert all(not e.reason.startswith(HOLDING) for e in eff if isinstance(e, Transition))
        if new.reason.startswith(HOLDING):
            assert new.phase == "Progressing"
        if replace(new, reason=r.reason) == r:
            assert eff == []  # a change of what it waits for alone is nothing to apply or audit
        r = new
