"""The rollout machine as a transition table (machine.TRANSITIONS): total over every phase and
every kind of command, each entry doing what docs/rollouts.md says, and `apply` agreeing with
a plain reference written here over random command sequences."""

from __future__ import annotations

import ast
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.rollout import machine
from controlplane.rollout.machine import (
    FINISHED,
    NOT_PAUSED,
    TRANSITIONS,
    Abort,
    Analysis,
    Command,
    Drain,
    Leave,
    Pause,
    Phase,
    Promote,
    Refusal,
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
    run,
    start,
)

PHASE_NAMES = ("Progressing", "Paused", "Completed", "Aborted")  # as stored in SQLite and etcd
KINDS = (Tick, Pause, Resume, Promote, Abort)
SPEC = RolloutSpec(model="chat", stable="v1", canary="v2", interval_s=10.0, min_requests=10)
GOOD = Analysis(canary_requests=100, canary_error_rate=0.0, canary_p99_s=1.0, stable_p99_s=1.0)
BAD = Analysis(canary_requests=100, canary_error_rate=0.5)
UNSEEN = Analysis(
    canary_requests=100,
    canary_error_rate=0.0,
    stable_requests=100,
    load_reports=False,
    canary_uncounted=("vllm",),
    window_s=30.0,
)
SHORT = Analysis(canary_requests=2, canary_error_rate=0.0, stable_requests=900, window_s=30.0)
SLOW = Analysis(canary_requests=100, canary_error_rate=0.0, canary_p99_s=3.0, stable_p99_s=1.0)
# What the docs promise: a finished rollout refuses every command, a running one refuses Resume.
REFUSED = {
    **{(p, k): FINISHED for p in (Phase.COMPLETED, Phase.ABORTED) for k in (Pause, Resume, Promote, Abort)},
    (Phase.PROGRESSING, Resume): NOT_PAUSED,
}


def weights(effects: list[object]) -> list[dict[str, int]]:
    return [dict(e.weights) for e in effects if isinstance(e, SetWeights)]


def at(phase: str, where: str = "step") -> Rollout:
    """A rollout of SPEC in `phase`: `waiting` for the proxies before the first step, at the
    first `step` (5%), or `finishing` at 100%."""
    r = {
        "waiting": start(SPEC, 0.0)[0],
        "step": run(SPEC, [Tick(0.0)])[0],
        "finishing": run(SPEC, [Tick(0.0), Promote(full=True)])[0],
    }[where]
    if phase == "Paused":
        r = apply(r, Pause())[0]
    elif phase == "Completed":
        r = run(SPEC, [Tick(0.0), Promote(full=True), Tick(1.0)])[0]
    elif phase == "Aborted":
        r = apply(r, Abort())[0]
    assert r.phase == phase and (phase in ("Completed", "Aborted") or r.finishing == (where == "finishing"))
    return r


def test_phases_are_one_type_whose_values_are_the_stored_strings() -> None:
    assert [p.value for p in Phase] == list(PHASE_NAMES)
    assert all(Phase(name) == name and hash(Phase(name)) == hash(name) for name in PHASE_NAMES)
    # A rollout read back from the store (plain strings in JSON) has its Phase; one written
    # out has the plain string, and so has its audit record.
    r, effects = run(SPEC, [Tick(0.0), Pause()])
    state = json.loads(json.dumps({k: v for k, v in asdict(r).items() if k != "spec"}))
    assert state["phase"] == "Paused"
    back = Rollout(spec=SPEC, **state)
    assert back == r and back.phase is Phase.PAUSED
    audit = [e for e in effects if isinstance(e, Transition)]
    assert [e.phase for e in audit] == ["Progressing", "Progressing", "Paused"]
    assert all(type(e.phase) is str for e in audit)


def test_the_table_is_total_over_phases_and_kinds_of_command() -> None:
    assert set(get_args(Command)) == set(KINDS)
    assert set(TRANSITIONS) == {(p, k) for p in Phase for k in KINDS}
    assert len(TRANSITIONS) == len(Phase) * len(KINDS) == 20
    assert all(callable(entry) for entry in TRANSITIONS.values())


def test_the_table_refuses_exactly_what_the_docs_say() -> None:
    for key in ((p, k) for p in Phase for k in KINDS):
        entry = TRANSITIONS[key]
        if key in REFUSED:
            assert entry is REFUSED[key], key
        else:
            assert not isinstance(entry, Refusal), key


@pytest.mark.parametrize(
    ("phase", "where", "cmd", "message"),
    [
        ("Completed", "step", Pause(), "the rollout of chat to v2 is Completed; start a new one"),
        ("Completed", "step", Resume(), "the rollout of chat to v2 is Completed; start a new one"),
        ("Completed", "step", Promote(full=True), "the rollout of chat to v2 is Completed; start a new one"),
        ("Completed", "step", Abort(), "the rollout of chat to v2 is Completed; start a new one"),
        ("Aborted", "step", Pause(), "the rollout of chat to v2 is Aborted; start a new one"),
        ("Aborted", "waiting", Resume(), "the rollout of chat to v2 is Aborted; start a new one"),
        ("Aborted", "finishing", Promote(), "the rollout of chat to v2 is Aborted; start a new one"),
        ("Aborted", "step", Abort(), "the rollout of chat to v2 is Aborted; start a new one"),
        ("Progressing", "step", Resume(), "the rollout of chat is not paused"),
        ("Progressing", "finishing", Resume(), "the rollout of chat is not paused"),
        (
            "Progressing",
            "waiting",
            Promote(),
            "not every proxy has the canary's cluster yet; promote once the first step is live",
        ),
        (
            "Paused",
            "waiting",
            Promote(full=True),
            "not every proxy has the canary's cluster yet; promote once the first step is live",
        ),
    ],
)
def test_a_refused_command_fails_with_its_message(phase: str, where: str, cmd: Command, message: str) -> None:
    r = at(phase, where)
    with pytest.raises(RolloutRejected) as e:
        apply(r, cmd)
    assert (e.value.code, str(e.value)) == ("FAILED_PRECONDITION", message)
    with pytest.raises(RolloutRejected) as direct:
        TRANSITIONS[(r.phase, type(cmd))](r, cmd)
    assert str(direct.value) == message


@pytest.mark.parametrize("phase", ["Completed", "Aborted"])
@pytest.mark.parametrize("where", ["waiting", "step", "finishing"])
def test_a_finished_rollout_ignores_ticks_and_refuses_every_command(phase: str, where: str) -> None:
    r = at(phase, where)
    for t in (Tick(99.0), Tick(99.0, ("envoy-1",), BAD, ("envoy-2",)), Tick(99.0, analysis=GOOD)):
        new, effects = apply(r, t)
        assert new is r and effects == []
    for cmd in (Pause(), Resume(), Promote(), Promote(full=True), Abort()):
        with pytest.raises(RolloutRejected, match="start a new one"):
            apply(r, cmd)


@pytest.mark.parametrize("where", ["waiting", "step", "finishing"])
def test_pause_holds_the_split_and_a_second_pause_changes_nothing(where: str) -> None:
    r = at("Progressing", where)
    paused, effects = apply(r, Pause("maintenance"))
    assert paused == replace(r, phase="Paused", reason="maintenance")
    assert effects == [Transition("chat", "Paused", r.step, r.weight, "maintenance")]
    assert apply(paused, Pause("again")) == (paused, [])


def test_a_failing_analysis_aborts_a_live_step_paused_or_not_and_a_paused_step_never_passes() -> None:
    # docs: "A failing analysis still aborts at once, paused or not."
    for phase in ("Progressing", "Paused"):
        assert apply(at(phase, "step"), Tick(100.0, analysis=BAD))[0].phase == "Aborted"
        assert apply(at(phase, "step"), Tick(100.0, analysis=SLOW))[0].phase == "Aborted"
    paused = at("Paused", "step")
    assert apply(paused, Tick(100.0, analysis=GOOD)) == (paused, [])
    running, _ = apply(at("Progressing", "step"), Tick(100.0, analysis=GOOD))
    assert (running.phase, running.weight) == ("Progressing", 25)


@pytest.mark.parametrize("where", ["waiting", "finishing"])
def test_a_paused_rollout_waiting_for_the_proxies_judges_nothing_and_stays_paused(where: str) -> None:
    r = at("Paused", where)
    for t in (Tick(100.0), Tick(100.0, ("envoy-1",), BAD, ("envoy-2",)), Tick(100.0, analysis=GOOD)):
        assert apply(r, t) == (r, [])
    # Running, the same ticks move it on: at 100% there is no step left to judge.
    assert apply(at("Progressing", where), Tick(100.0, analysis=BAD))[0].phase != "Aborted"


@pytest.mark.parametrize("where", ["waiting", "step", "finishing"])
def test_resume_goes_on_from_where_it_paused(where: str) -> None:
    r = at("Paused", where)
    new, effects = apply(r, Resume())
    assert (new.phase, new.step, new.weight, new.finishing) == ("Progressing", r.step, r.weight, r.finishing)
    assert effects == [Transition("chat", "Progressing", r.step, r.weight, "resumed")]


@pytest.mark.parametrize("phase", ["Progressing", "Paused"])
def test_promote_moves_one_step_or_to_the_end_and_completes_while_finishing(phase: str) -> None:
    one, _ = apply(at(phase, "step"), Promote())
    assert (one.phase, one.step, one.weight, one.finishing) == ("Progressing", 1, 25, False)
    full, effects = apply(at(phase, "step"), Promote(full=True))
    assert (full.phase, full.weight, full.finishing) == ("Progressing", 100, True)
    assert Leave("chat", "v1") in effects
    done, effects = apply(at(phase, "finishing"), Promote())
    assert done.phase == "Completed" and effects[:2] == [SetStable("chat", "v2"), Drain("chat", "v1")]


@pytest.mark.parametrize("phase", ["Progressing", "Paused"])
@pytest.mark.parametrize("where", ["waiting", "step", "finishing"])
def test_abort_sends_all_traffic_back_to_stable_and_drains_the_canary(phase: str, where: str) -> None:
    r = at(phase, where)
    new, effects = apply(r, Abort("bad canary"))
    assert new == replace(r, phase="Aborted", weight=0, finishing=False, reason="bad canary")
    back = [Return("chat", "v1")] if where == "finishing" else []
    assert effects == [
        SetWeights("chat", (("v1", 100), ("v2", 0))),
        *back,
        Drain("chat", "v2"),
        Transition("chat", "Aborted", r.step, 0, "bad canary"),
    ]


def test_apply_is_a_lookup_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    r = at("Progressing")
    marker = (replace(r, reason="from the table"), [])
    table = dict(TRANSITIONS)
    table[(Phase.PROGRESSING, Pause)] = lambda rollout, cmd: marker
    table[(Phase.PROGRESSING, Tick)] = Refusal("no ticks for {model} in {phase}")
    monkeypatch.setattr(machine, "TRANSITIONS", table)
    assert apply(r, Pause()) is marker
    with pytest.raises(RolloutRejected, match=r"^no ticks for chat in Progressing$"):
        apply(r, Tick(1.0))


def test_the_machine_names_no_phase_by_a_bare_string() -> None:
    tree = ast.parse(Path(machine.__file__).read_text())
    phase_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Phase")
    inside = {id(n) for n in ast.walk(phase_class)}
    bare = [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value in PHASE_NAMES and id(n) not in inside
    ]
    assert bare == []


# A plain reference: what the docs say each command does, written as a ladder over the
# stored phase strings, independent of the table.


def reference_refusal(r: Rollout, cmd: Command) -> str | None:
    """The FAILED_PRECONDITION message `cmd` must get in `r`'s state, or None."""
    if r.phase in ("Completed", "Aborted"):
        if isinstance(cmd, Tick):
            return None
        return f"the rollout of {r.spec.model} to {r.spec.canary} is {r.phase}; start a new one"
    if isinstance(cmd, Resume) and r.phase != "Paused":
        return f"the rollout of {r.spec.model} is not paused"
    if isinstance(cmd, Promote) and r.step < 0:
        return "not every proxy has the canary's cluster yet; promote once the first step is live"
    return None


def fails(spec: RolloutSpec, a: Analysis | None) -> bool:
    if a is None or a.canary_requests < spec.min_requests:
        return False
    slow = bool(
        a.canary_p99_s and a.stable_p99_s and a.canary_p99_s > spec.max_latency_ratio * a.stable_p99_s
    )
    return a.canary_error_rate > spec.max_error_rate or slow


def check_against_reference(r: Rollout, cmd: Command, new: Rollout, eff: list[object]) -> None:
    """`(new, eff)` is what the docs say `cmd` does to `r` (which the machine accepted)."""
    m, s, c, steps = r.spec.model, r.spec.stable, r.spec.canary, r.spec.steps
    for w in weights(eff):
        assert sum(w.values()) == 100 and all(0 <= v <= 100 for v in w.values())
    assert new.weights == {s: 100 - new.weight, c: new.weight} and new.spec == r.spec
    if r.phase in ("Completed", "Aborted"):  # a tick: a finished rollout never changes
        assert new is r and eff == []
    elif isinstance(cmd, Abort):
        assert new == replace(r, phase="Aborted", weight=0, finishing=False, reason=cmd.reason)
        back = [Return(m, s)] if r.finishing else []
        assert eff == [
            SetWeights(m, ((s, 100), (c, 0))),
            *back,
            Drain(m, c),
            Transition(m, "Aborted", r.step, 0, cmd.reason),
        ]
    elif isinstance(cmd, Pause):
        if r.phase == "Paused":
            assert new is r and eff == []
        else:
            assert new == replace(r, phase="Paused", reason=cmd.reason)
            assert eff == [Transition(m, "Paused", r.step, r.weight, cmd.reason)]
    elif isinstance(cmd, Resume):
        assert (new.phase, new.step, new.weight, new.finishing) == (
            "Progressing",
            r.step,
            r.weight,
            r.finishing,
        )
        assert new.reason.startswith("resumed") and eff == [
            Transition(m, "Progressing", r.step, r.weight, new.reason)
        ]
    elif isinstance(cmd, Promote):
        if r.finishing:
            assert (new.phase, new.weight, new.finishing) == ("Completed", 100, False)
            assert eff[:2] == [SetStable(m, c), Drain(m, s)] and len(eff) == 3
            return
        to = len(steps) if cmd.full else r.step + 1
        if to < len(steps) and steps[to] == 100 and r.spec.interval_s is None:
            to = len(steps)  # manual gates: promoting to 100% finishes
        if to >= len(steps):
            assert (new.phase, new.step, new.weight, new.finishing) == (
                "Progressing",
                len(steps) - 1,
                100,
                True,
            )
            assert Leave(m, s) in eff
        else:
            assert (new.phase, new.step, new.weight, new.finishing) == ("Progressing", to, steps[to], False)
        assert weights(eff) == [{s: 100 - new.weight, c: new.weight}]
    else:
        assert isinstance(cmd, Tick)
        judged = r.step >= 0 and not r.finishing and fails(r.spec, cmd.analysis)
        if judged:
            assert (new.phase, new.weight) == ("Aborted", 0) and Drain(m, c) in eff
        elif r.phase == "Paused":
            assert new is r and eff == []
        else:
            # The detailed rules of a running tick have their own tests (test_rollout_machine.py);
            # here what holds for any of them.
            assert new.phase != "Aborted" and new.weight >= r.weight and new.step <= r.step + 1
            if new.phase == "Completed":
                assert r.finishing and not cmd.still_routed and Drain(m, s) in eff
            if r.weight == 0 and new.weight > 0:
                assert not cmd.unacked_proxies  # make-before-break
            if new.phase == "Paused" or new.step != r.step or new.finishing != r.finishing:
                assert any(isinstance(e, Transition) for e in eff)


specs = st.builds(
    RolloutSpec,
    model=st.just("chat"),
    stable=st.just("v1"),
    canary=st.just("v2"),
    steps=st.sampled_from([(5, 25, 50, 100), (100,), (50, 100), (10, 100)]),
    interval_s=st.sampled_from([None, 10.0]),
    min_requests=st.sampled_from([0, 10]),
    ack_deadline_s=st.sampled_from([5.0, 30.0]),
)
ticks = st.builds(
    Tick,
    st.floats(0, 20),  # how long after the last tick
    st.sampled_from([(), (), (), ("envoy-1",)]),
    st.sampled_from([None, GOOD, GOOD, BAD, SLOW, UNSEEN, SHORT]),
    st.sampled_from([(), (), ("envoy-2",)]),
)
# Weighted so that sequences get past the first step and reach every phase before an abort.
commands = st.lists(
    st.one_of(
        *[ticks] * 6,
        st.builds(Pause, st.sampled_from(["paused by operator", "maintenance"])),
        *[st.just(Resume())] * 2,
        *[st.builds(Promote, st.booleans())] * 2,
        st.builds(Abort, st.sampled_from(["aborted by operator", "bad canary"])),
    ),
    max_size=40,
)


@settings(max_examples=500, deadline=None)
@given(specs, st.booleans(), commands)
def test_random_commands_do_what_the_reference_says(
    spec: RolloutSpec, live: bool, cmds: list[Command]
) -> None:
    r, _ = start(spec, 0.0)
    if live:  # half the sequences start at the first step, to reach the later phases more often
        r, _ = apply(r, Tick(0.0))
    now = 0.0
    for cmd in cmds:
        if isinstance(cmd, Tick):
            now += cmd.now
            cmd = replace(cmd, now=now)
        refusal = reference_refusal(r, cmd)
        if refusal is not None:
            with pytest.raises(RolloutRejected) as e:
                apply(r, cmd)
            assert (e.value.code, str(e.value)) == ("FAILED_PRECONDITION", refusal)
            continue
        new, eff = apply(r, cmd)
        check_against_reference(r, cmd, new, list(eff))
        assert isinstance(new.phase, Phase) and new.phase in PHASE_NAMES
        r = new
