"""The rollout state machine (pure: commands and ticks in, new state and effects out).

A rollout moves a model's traffic from its stable version to a canary in steps of percent.
Time and the outside world come in as values: `Tick(now, proxies, analysis)` says which
connected proxies have ACKed the canary's cluster and endpoints, and how canary and stable
compare. The caller applies the returned effects (weights, drains, the new stable) and
stores the new state; nothing here does I/O, so every rule is unit-tested.

Rules (groundwork for the operator API; docs/rollouts.md will carry them):
- Make-before-break: no weight above 0 goes to the canary until every connected proxy has
  ACKed its cluster and endpoints. If some proxy has not within `ack_deadline_s`, the
  rollout pauses with a reason naming the proxies; it neither waits forever nor proceeds.
- Each step holds for `interval_s` (None: manual gates, advanced by Promote). A failed
  analysis at any tick aborts at once: all traffic back to stable, the canary drained.
  An analysis without `min_requests` canary requests is not judged yet.
- A step whose analysis is inconclusive (`inconclusive`: no error signal covers the canary,
  or it served far less than its share) pauses when its interval has elapsed, with a reason
  naming what is missing. Resume starts the step over (a fresh interval and analysis);
  Promote goes on without the evidence. Manual gates never pause for it.
- After the last step (100%) passes, the old stable *leaves*: no route names it any more.
  The rollout completes (the canary becomes stable, the old stable drains) only once no
  proxy's ACKed routes name the old stable. If some still do after `ack_deadline_s`, the
  rollout pauses naming them; Resume waits again, Promote completes it anyway, Abort goes
  back to the old stable.
- While a running rollout waits at a tick, its reason says what for (`holding: 12/50 canary
  requests, 18s left in the step`): the proxies that have not ACKed (how many, naming a few),
  the canary requests so far against `min_requests`, the time left before the step may pass
  or the wait pauses. Only the reason changes, so the caller may show it without storing it.

The machine is one table, TRANSITIONS: for every phase and every kind of command, the
function that applies it or the Refusal (FAILED_PRECONDITION) that rejects it. A running
rollout takes every command but Resume; a paused one holds at ticks (only a failing
analysis moves it, to Aborted) and ignores a second Pause; a finished one (Completed,
Aborted) ignores ticks and refuses every command. Promote is refused before the first step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Literal, NoReturn, TypeVar


class Phase(StrEnum):
    """Where a rollout is. The values are what the store, the API and the audit trail hold,
    and a Phase equals its plain string."""

    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    COMPLETED = "Completed"
    ABORTED = "Aborted"


DEFAULT_STEPS = (5, 25, 50, 100)
INCONCLUSIVE = "inconclusive: "  # how an inconclusive pause's reason begins
# An analysis window shorter than this cannot show that something is missing: Envoy sends
# load reports every second and servers are scraped every second or two.
INCONCLUSIVE_AFTER_S = 5.0
# The canary is short of its share when it served less than this fraction of the requests
# its weight should have brought (stable's requests x w / (100 - w)), once at least
# max(min_requests, SHARE_MIN_EXPECTED) were expected: fewer are too noisy to tell.
SHARE_FLOOR = 0.25
SHARE_MIN_EXPECTED = 20
UNSCRAPED = "unscraped"  # in Analysis.canary_uncounted: a server with no metrics read yet
_RESTART_STEP = -1.0  # waiting_since after a resume or a promote: the step's clock starts next tick
HOLDING = "holding: "  # how the reason of a running rollout that waits at a tick begins
NAMED_PROXIES = 3  # a holding reason names this many proxies, then says how many more


class RolloutRejected(ValueError):
    """A command that cannot apply in the rollout's state (FAILED_PRECONDITION), or a spec
    that is invalid (INVALID_ARGUMENT); `code` says which."""

    def __init__(self, code: Literal["FAILED_PRECONDITION", "INVALID_ARGUMENT"], message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RolloutSpec:
    model: str
    stable: str
    canary: str
    steps: tuple[int, ...] = DEFAULT_STEPS
    interval_s: float | None = 30.0  # None: manual gates
    max_error_rate: float = 0.01
    max_latency_ratio: float = 1.5  # canary p99 / stable p99
    min_requests: int = 50
    ack_deadline_s: float = 30.0
    shadow_percent: int = 0  # requests also mirrored to the canary while the rollout runs

    def check(self) -> None:
        """Raise RolloutRejected(INVALID_ARGUMENT) naming what is wrong."""
        if self.canary == self.stable:
            raise RolloutRejected(
                "INVALID_ARGUMENT", f"--to {self.canary}: that is already the stable version"
            )
        s = self.steps
        if not s or any(not 0 < x <= 100 for x in s) or any(b <= a for a, b in itertools.pairwise(s)):
            raise RolloutRejected(
                "INVALID_ARGUMENT", f"--steps {','.join(map(str, s))}: must increase, each 1-100"
            )
        if s[-1] != 100:
            raise RolloutRejected("INVALID_ARGUMENT", f"--steps: the last step must be 100, got {s[-1]}")
        for name, value in (
            ("--interval", self.interval_s),
            ("--max-error-rate", self.max_error_rate),
            ("--max-latency-ratio", self.max_latency_ratio),
            ("--ack-deadline", self.ack_deadline_s),
        ):
            if value is not None and not math.isfinite(value):
                raise RolloutRejected("INVALID_ARGUMENT", f"{name}: expected a finite number, got {value}")
        if not self.ack_deadline_s > 0:
            raise RolloutRejected(
                "INVALID_ARGUMENT", f"--ack-deadline: must be greater than 0, got {self.ack_deadline_s:g}"
            )
        if self.min_requests < 0:
            raise RolloutRejected(
                "INVALID_ARGUMENT", f"--min-requests: must be 0 or more, got {self.min_requests}"
            )
        if self.interval_s is not None and self.interval_s <= 0:
            raise RolloutRejected("INVALID_ARGUMENT", "--interval: must be greater than 0 (or --manual)")
        if not 0 <= self.max_error_rate <= 1:
            raise RolloutRejected("INVALID_ARGUMENT", "--max-error-rate: must be between 0 and 1")
        if not 0 <= self.shadow_percent <= 100:
            raise RolloutRejected("INVALID_ARGUMENT", "--shadow: must be a percent, 0-100")
        if self.max_latency_ratio < 1:
            raise RolloutRejected("INVALID_ARGUMENT", "--max-latency-ratio: must be at least 1")


@dataclass(frozen=True)
class Analysis:
    """Canary against stable since the current step began (from server metrics and LRS).

    The defaults of the coverage fields say "covered", so a test can leave them out;
    analysis.analysis always fills them in."""

    canary_requests: int
    canary_error_rate: float
    stable_error_rate: float = 0.0
    canary_p99_s: float | None = None
    stable_p99_s: float | None = None
    stable_requests: int = 0
    # Whether some proxy's load report for the canary's or stable's endpoints arrived in the
    # window: then the proxies count the canary's 5xx too.
    load_reports: bool = True
    # The dialects of the canary's servers whose metrics count no failures (UNSCRAPED for a
    # server with no metrics read); empty: every one counts its failures.
    canary_uncounted: tuple[str, ...] = ()
    # How long the figures have been watched: since the step's baseline, and not before the
    # proxies could have reported to this replica (RolloutController._analyse).
    window_s: float = math.inf


@dataclass(frozen=True)
class Tick:
    now: float
    unacked_proxies: tuple[str, ...] = ()  # connected proxies without the canary's cluster + endpoints
    analysis: Analysis | None = None
    still_routed: tuple[str, ...] = ()  # proxies whose ACKed routes still name the old stable


@dataclass(frozen=True)
class Pause:
    reason: str = "paused by operator"


@dataclass(frozen=True)
class Resume:
    pass


@dataclass(frozen=True)
class Promote:
    full: bool = False  # to the end at once, rather than one step


@dataclass(frozen=True)
class Abort:
    reason: str = "aborted by operator"


Command = Tick | Pause | Resume | Promote | Abort


@dataclass(frozen=True)
class SetWeights:
    """Route `weights` (version -> percent, summing to 100) for the model."""

    model: str
    weights: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Drain:
    model: str
    version: str


@dataclass(frozen=True)
class Leave:
    """No route may name the version any more (its endpoints stay as they are)."""

    model: str
    version: str


@dataclass(frozen=True)
class Return:
    """The version serves again: it no longer leaves."""

    model: str
    version: str


@dataclass(frozen=True)
class SetStable:
    model: str
    version: str


@dataclass(frozen=True)
class Transition:
    """An audit record: what changed and why (the caller adds who and when)."""

    model: str
    phase: str  # a Phase, or a drain's: Draining, Drained, Undrained, Retired
    step: int
    weight: int
    reason: str


Effect = SetWeights | Drain | Leave | Return | SetStable | Transition


@dataclass(frozen=True)
class Rollout:
    spec: RolloutSpec
    phase: Phase = Phase.PROGRESSING
    step: int = -1  # index into spec.steps; -1: waiting for the proxies before the first step
    weight: int = 0  # the canary's percent in force
    step_started_at: float = 0.0
    waiting_since: float = 0.0
    # Why it is where it is: the last transition's reason, or, while it waits at a tick, what
    # it waits for (HOLDING; a tick that changes only this returns no effects).
    reason: str = "waiting for every proxy to have the canary's cluster and endpoints"
    finishing: bool = False  # at 100%, waiting for every proxy's routes to leave the old stable

    def __post_init__(self) -> None:
        # A stored rollout reads back with the plain string: make it the Phase it names.
        object.__setattr__(self, "phase", Phase(self.phase))

    @property
    def weights(self) -> dict[str, int]:
        return {self.spec.stable: 100 - self.weight, self.spec.canary: self.weight}


Outcome = tuple[Rollout, list[Effect]]  # the rollout after a command, and what the caller must do
_C = TypeVar("_C", bound=Command)
Handler = Callable[[Rollout, _C], Outcome]  # how a phase takes a command of kind _C


@dataclass(frozen=True)
class Refusal:
    """A TRANSITIONS entry for a command the phase does not take: FAILED_PRECONDITION with
    `message`, which may name {model}, {canary} and {phase}."""

    message: str

    def rejected(self, r: Rollout) -> RolloutRejected:
        return RolloutRejected(
            "FAILED_PRECONDITION",
            self.message.format(model=r.spec.model, canary=r.spec.canary, phase=r.phase),
        )

    def __call__(self, r: Rollout, cmd: Command) -> NoReturn:
        raise self.rejected(r)


FINISHED = Refusal("the rollout of {model} to {canary} is {phase}; start a new one")
NOT_PAUSED = Refusal("the rollout of {model} is not paused")
NOT_LIVE = Refusal("not every proxy has the canary's cluster yet; promote once the first step is live")


def start(spec: RolloutSpec, now: float) -> Outcome:
    """A new rollout: canary at 0% until every proxy has its cluster."""
    spec.check()
    r = Rollout(spec=spec, waiting_since=now, step_started_at=now)
    return r, [_set_weights(r), _audit(r)]


def apply(r: Rollout, cmd: Command) -> Outcome:
    """The rollout after `cmd`, and what the caller must do: what TRANSITIONS says for the
    rollout's phase and the command's kind. Raise RolloutRejected if `cmd` cannot apply now
    (a finished rollout takes no commands; ticks are ignored)."""
    return TRANSITIONS[(r.phase, type(cmd))](r, cmd)


def _ignore(r: Rollout, cmd: Command) -> Outcome:
    """Nothing to do: a second Pause, a tick of a finished rollout."""
    return r, []


def _pause(r: Rollout, cmd: Pause) -> Outcome:
    p = replace(r, phase=Phase.PAUSED, reason=cmd.reason)
    return p, [_audit(p)]


def _resume(r: Rollout, cmd: Resume) -> Outcome:
    if r.step >= 0 and not r.finishing and r.reason.startswith(INCONCLUSIVE):
        # The step starts over at the next tick (commands carry no time): its old window
        # lacked the evidence, and a fixed signal deserves a whole interval of its own.
        p = replace(
            r,
            phase=Phase.PROGRESSING,
            reason="resumed; the step starts over (its analysis was inconclusive)",
            waiting_since=_RESTART_STEP,
        )
        return p, [_audit(p)]
    # Finishing: the wait for the proxies starts again at the next tick.
    since = 0.0 if r.finishing else _last_time(r)
    p = replace(r, phase=Phase.PROGRESSING, reason="resumed", waiting_since=since)
    return p, [_audit(p)]


def _promote(r: Rollout, cmd: Promote) -> Outcome:
    running = replace(r, phase=Phase.PROGRESSING)
    if r.finishing:
        return _complete(
            running, f"promoted by operator while waiting for proxies; {r.spec.stable} drains now"
        )
    if r.step < 0:
        raise NOT_LIVE.rejected(r)
    # As Argo Rollouts: `promote` moves one step, whose clock starts afresh at the next
    # tick (commands carry no time); `promote --full` completes now, through the same
    # make-before-break wait for every proxy's routes to leave the old stable.
    if cmd.full:
        return _goto(running, len(r.spec.steps), 0.0, "promoted to completion by operator")
    n, effects = _goto(running, r.step + 1, 0.0, "promoted by operator")
    return (n if n.finishing else replace(n, waiting_since=_RESTART_STEP)), effects


def _abort_by(r: Rollout, cmd: Abort) -> Outcome:
    return _abort(r, cmd.reason)


def _last_time(r: Rollout) -> float:
    return max(r.step_started_at, r.waiting_since)


def _tick(r: Rollout, t: Tick) -> Outcome:
    """A running rollout at a tick: it waits for the proxies, judges the step, moves on."""
    if r.finishing:
        return _tick_finishing(r, t)
    if r.step < 0:
        if not t.unacked_proxies:
            return _goto(r, 0, t.now, "every proxy has the canary's cluster and endpoints")
        if t.now - r.waiting_since >= r.spec.ack_deadline_s:
            names = ", ".join(sorted(t.unacked_proxies))
            p = replace(
                r,
                phase=Phase.PAUSED,
                reason=(
                    f"proxies have not ACKed the canary's cluster within {r.spec.ack_deadline_s:g}s: {names}"
                ),
            )
            return p, [_audit(p)]
        left = r.spec.ack_deadline_s - (t.now - r.waiting_since)
        waiting = _proxies(t.unacked_proxies, "has", "have")
        return _hold(
            r,
            f"{waiting} not ACKed {r.spec.canary}'s cluster and endpoints, "
            f"{duration_text(left)} left before the rollout pauses",
        )
    verdict = _judge(r.spec, t.analysis)
    if verdict is not None:
        return _abort(r, verdict)
    if r.waiting_since == _RESTART_STEP:
        r = replace(r, step_started_at=t.now, waiting_since=t.now)
        return _hold(r, step_holds_for(r, t))
    if r.spec.interval_s is None:
        return _hold(r, step_holds_for(r, t))
    if t.now - r.step_started_at < r.spec.interval_s or t.analysis is None:
        return _hold(r, step_holds_for(r, t))
    why = inconclusive(r.spec, r.weight, t.analysis)
    if why is not None:
        p = replace(r, phase=Phase.PAUSED, reason=why)
        return p, [_audit(p)]
    if _unseen(t.analysis) or t.analysis.canary_requests < r.spec.min_requests:
        return _hold(r, step_holds_for(r, t))  # not enough evidence yet
    return _goto(r, r.step + 1, t.now, f"step {r.step + 1} passed analysis")


def _tick_paused(r: Rollout, t: Tick) -> Outcome:
    """A paused rollout holds at a tick; only a failing analysis of a live step moves it (it
    aborts). While it waits for the proxies (before the first step, or finishing) nothing is
    judged."""
    if r.finishing or r.step < 0:
        return r, []
    verdict = _judge(r.spec, t.analysis)
    return (r, []) if verdict is None else _abort(r, verdict)


def _row(
    phase: Phase,
    *,
    tick: Handler[Tick],
    pause: Handler[Pause],
    resume: Handler[Resume],
    promote: Handler[Promote],
    abort: Handler[Abort],
) -> dict[tuple[Phase, type[Command]], Handler[Any]]:
    """One phase's row of TRANSITIONS: an entry for every kind of command, each typed by it."""
    return {
        (phase, Tick): tick,
        (phase, Pause): pause,
        (phase, Resume): resume,
        (phase, Promote): promote,
        (phase, Abort): abort,
    }


# The machine: (phase, kind of command) -> how the rollout takes it, or a Refusal.
# fmt: off
TRANSITIONS: Mapping[tuple[Phase, type[Command]], Handler[Any]] = MappingProxyType({
    **_row(Phase.PROGRESSING, tick=_tick, pause=_pause, resume=NOT_PAUSED, promote=_promote, abort=_abort_by),
    **_row(Phase.PAUSED, tick=_tick_paused, pause=_ignore, resume=_resume, promote=_promote, abort=_abort_by),
    **_row(Phase.COMPLETED, tick=_ignore, pause=FINISHED, resume=FINISHED, promote=FINISHED, abort=FINISHED),
    **_row(Phase.ABORTED, tick=_ignore, pause=FINISHED, resume=FINISHED, promote=FINISHED, abort=FINISHED),
})
# fmt: on


def _hold(r: Rollout, waits_for: str) -> Outcome:
    """The rollout as it is, its reason saying what it waits for (no effects: not audited)."""
    return replace(r, reason=HOLDING + waits_for), []


def step_holds_for(r: Rollout, t: Tick) -> str:
    """What a running step waits for at this tick, after "holding: " (the step has not
    passed: too few canary requests, no signal that counts canary failures yet, time left,
    or a manual gate), with what the analysis has seen so far."""
    spec, a = r.spec, t.analysis
    n = a.canary_requests if a is not None else 0  # no analysis yet: the step just began
    waits = []
    if n < spec.min_requests:
        # Said only of a window long enough that a request would show (reports and scrapes
        # come every second or so).
        idle = (
            a is not None
            and a.canary_requests + a.stable_requests == 0
            and a.window_s >= INCONCLUSIVE_AFTER_S
        )
        waits.append(
            f"{n}/{spec.min_requests} canary requests"
            + (f" (no requests to {spec.model} in this step)" if idle else "")
        )
    judged = ""
    if a is not None and _unseen(a):  # then nothing says the canary is within its limits
        waits.append("a signal that counts the canary's failures (no load reports yet)")
    elif a is not None and n >= spec.min_requests:
        judged = f"; {n} canary requests, within the limits so far"
    if spec.interval_s is None:  # the analysis can still abort, but only promote moves on
        return "`cpctl rollout promote` (manual gates)" + (f"; {waits[0]}" if waits else judged)
    left = spec.interval_s - (t.now - r.step_started_at)
    if left > 0:
        waits.append(f"{duration_text(left)} left in the step")
    elif not waits:
        waits.append("the step's next analysis")  # its first tick, with the interval already over
    over = f"; the step's {duration_text(spec.interval_s)} interval is over" if left <= 0 else ""
    return ", ".join(waits) + over + judged


def duration_text(seconds: float) -> str:
    """Whole seconds, rounded up: 18s, 4m31s, 5m, 1h2m."""
    s = max(0, math.ceil(seconds - 1e-9))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s}s" if s else f"{m}m"
    h, m = divmod(m, 60)
    return f"{h}h{m}m" if m else f"{h}h"


def _proxies(names: Sequence[str], singular: str, plural: str) -> str:
    """`2 proxies (gw-1, gw-2) have`: a few named, then how many more."""
    ordered = sorted(names)
    shown = ", ".join(ordered[:NAMED_PROXIES])
    if len(ordered) > NAMED_PROXIES:
        shown += f" and {len(ordered) - NAMED_PROXIES} more"
    if len(ordered) == 1:
        return f"1 proxy ({shown}) {singular}"
    return f"{len(ordered)} proxies ({shown}) {plural}"


def _unseen(a: Analysis) -> bool:
    """Traffic flowed but nothing could have counted a canary failure (so far)."""
    return a.canary_requests + a.stable_requests > 0 and not a.load_reports and bool(a.canary_uncounted)


def inconclusive(spec: RolloutSpec, weight: int, a: Analysis) -> str | None:
    """Why the analysis cannot tell whether the canary is good, or None. Judged only over a
    window of at least INCONCLUSIVE_AFTER_S; a step with no traffic at all just holds."""
    if a.window_s < INCONCLUSIVE_AFTER_S:
        return None
    if _unseen(a):
        dialects = [d for d in a.canary_uncounted if d != UNSCRAPED]
        servers = (
            f"its servers ({', '.join(dialects)}) do not count every failed request"
            if dialects
            else "its servers' failure counts are not read (no metrics scraped)"
        )
        return (
            f"{INCONCLUSIVE}no load reports from proxies for {spec.model}/{spec.canary} and {servers}, "
            "so a failing canary would go unseen; enable load_stats_config in the Envoy bootstrap "
            "or use `controlplane bootstrap`"
        )
    if weight < 100:
        expected = a.stable_requests * weight / (100 - weight)
        floor = max(spec.min_requests, SHARE_MIN_EXPECTED)
        if expected >= floor and a.canary_requests < SHARE_FLOOR * expected:
            return (
                f"{INCONCLUSIVE}the canary {spec.canary} served {a.canary_requests} requests "
                f"where its {weight}% share means about {expected:.0f} ({spec.stable} served "
                f"{a.stable_requests}); requests to it may fail before any counter sees them"
            )
    return None


def _judge(spec: RolloutSpec, a: Analysis | None) -> str | None:
    """Why the canary fails, or None (passing, or too few requests to judge)."""
    if a is None or a.canary_requests < spec.min_requests:
        return None
    if a.canary_error_rate > spec.max_error_rate:
        return (
            f"canary error rate {a.canary_error_rate:.2%} over {a.canary_requests} requests "
            f"exceeds {spec.max_error_rate:.2%} (stable {a.stable_error_rate:.2%})"
        )
    if a.canary_p99_s and a.stable_p99_s and a.canary_p99_s > spec.max_latency_ratio * a.stable_p99_s:
        return (
            f"canary p99 {a.canary_p99_s:.3f}s is {a.canary_p99_s / a.stable_p99_s:.2f}x stable's "
            f"{a.stable_p99_s:.3f}s (limit {spec.max_latency_ratio:g}x)"
        )
    return None


def _tick_finishing(r: Rollout, t: Tick) -> Outcome:
    if not t.still_routed:
        return _complete(r, f"no proxy routes to {r.spec.stable} any more")
    if r.waiting_since <= 0:
        r = replace(r, waiting_since=t.now)  # the wait for the proxies starts now
    if t.now - r.waiting_since >= r.spec.ack_deadline_s:
        names = ", ".join(sorted(t.still_routed))
        p = replace(
            r,
            phase=Phase.PAUSED,
            reason=(
                f"proxies still route to {r.spec.stable} {r.spec.ack_deadline_s:g}s after it left: {names} "
                "(resume to wait again, promote to drain it anyway, abort to go back)"
            ),
        )
        return p, [_audit(p)]
    left = r.spec.ack_deadline_s - (t.now - r.waiting_since)
    routing = _proxies(t.still_routed, "still routes", "still route")
    return _hold(r, f"{routing} to {r.spec.stable}, {duration_text(left)} left before the rollout pauses")


def _complete(r: Rollout, reason: str) -> Outcome:
    done = replace(r, phase=Phase.COMPLETED, finishing=False, reason=reason)
    return done, [
        SetStable(r.spec.model, r.spec.canary),
        Drain(r.spec.model, r.spec.stable),
        _audit(replace(done, reason=f"{reason}; {r.spec.canary} is stable, {r.spec.stable} drains")),
    ]


def _goto(r: Rollout, index: int, now: float, reason: str) -> Outcome:
    steps = r.spec.steps
    if index >= len(steps):
        n = replace(
            r,
            step=len(steps) - 1,
            weight=100,
            finishing=True,
            waiting_since=0.0,  # set by the next tick (commands carry no time)
            reason=f"{reason}; waiting for every proxy's routes to leave {r.spec.stable}",
        )
        return n, [_set_weights(n), Leave(r.spec.model, r.spec.stable), _audit(n)]
    n = replace(r, step=index, weight=steps[index], step_started_at=now, reason=reason)
    if steps[index] == 100 and r.spec.interval_s is None:
        return _goto(n, index + 1, now, reason)  # manual: promoting to 100% completes it
    return n, [_set_weights(n), _audit(n)]


def _abort(r: Rollout, reason: str) -> Outcome:
    a = replace(r, phase=Phase.ABORTED, weight=0, finishing=False, reason=reason)
    back = [Return(r.spec.model, r.spec.stable)] if r.finishing else []
    return a, [_set_weights(a), *back, Drain(r.spec.model, r.spec.canary), _audit(a)]


def _set_weights(r: Rollout) -> SetWeights:
    return SetWeights(r.spec.model, tuple(r.weights.items()))


def _audit(r: Rollout) -> Transition:
    # The plain string, as a drain's phases are: it goes to the store, the log and metrics.
    return Transition(r.spec.model, r.phase.value, r.step, r.weight, r.reason)


def run(spec: RolloutSpec, commands: Sequence[Command], now: float = 0.0) -> Outcome:
    """Start and apply `commands` in order, skipping rejected ones (for tests and replays)."""
    r, effects = start(spec, now)
    for c in commands:
        try:
            r, e = apply(r, c)
        except RolloutRejected:
            continue
        effects += e
    return r, effects
