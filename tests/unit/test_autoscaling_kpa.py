"""Desired replicas from demand (controlplane/autoscaling/kpa.py): Knative-style stable and
panic windows, rate limits, min and max, and scale to zero after an idle grace."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.autoscaling.kpa import Decision, Scaler, target_of
from controlplane.fleet.model import DEFAULT_TARGET_PER_REPLICA, ScalingPolicy

P = ScalingPolicy(min_replicas=1, max_replicas=50, target_per_replica=10.0)


def run(
    scaler: Scaler, policy: ScalingPolicy, demands: list[float], *, start: float = 0.0, step: float = 1.0,
    follow: bool = True, ready: int = 1,
) -> list[Decision]:  # fmt: skip
    """Feed one sample per `step`; with `follow`, the ready replicas follow the last decision
    (servers that start at once)."""
    out = []
    for i, demand in enumerate(demands):
        d = scaler.decide(policy, start + i * step, demand, ready)
        if follow:
            ready = d.desired
        out.append(d)
    return out


def test_steady_demand_settles_at_demand_over_target() -> None:
    decisions = run(Scaler(), P, [45.0] * 120)
    assert decisions[-1].desired == 5 and not decisions[-1].panicking


def test_a_short_burst_does_not_move_the_stable_window() -> None:
    s = Scaler()
    assert run(s, P, [35.0] * 70)[-1].desired == 4
    d = run(s, P, [45.0] * 3, start=70, ready=4)[-1]
    assert d.desired == 4  # 3 s at 45 in a 60 s window: still 4 (45 alone would want 5)
    assert not d.panicking


def test_a_burst_past_twice_the_ready_capacity_panics_and_scales_at_once() -> None:
    s = Scaler()
    run(s, P, [10.0] * 70)
    d = run(s, P, [50.0] * 6, start=70, ready=1)[-1]
    assert d.panicking and d.desired >= 4  # the 6 s window wants 5; the 60 s one about 1


def test_panic_never_scales_down_until_a_stable_window_passes() -> None:
    s = Scaler()
    run(s, P, [10.0] * 70)
    peak = run(s, P, [80.0] * 6, start=70, ready=1)[-1].desired
    after = run(s, P, [10.0] * 59, start=76, ready=peak, follow=False)
    assert all(d.desired >= peak for d in after if d.panicking)
    later = run(s, P, [10.0] * 90, start=135, ready=peak)
    assert not later[-1].panicking and later[-1].desired == 1


def test_scale_down_is_rate_limited_per_decision() -> None:
    s = Scaler()
    run(s, P, [200.0] * 70)
    d = s.decide(P, 200.0, 0.0, ready=20)  # demand gone at once, window long past
    assert d.desired >= 10  # at most halves (scale_down_rate 2)


def test_min_and_max_bound_the_result() -> None:
    p = dataclasses.replace(P, min_replicas=3, max_replicas=4)
    assert run(Scaler(), p, [0.0] * 5)[-1].desired == 3
    assert run(Scaler(), p, [1000.0] * 100)[-1].desired == 4


def test_scale_to_zero_only_after_the_idle_grace_and_one_request_wakes_it() -> None:
    p = dataclasses.replace(P, min_replicas=0, idle_grace_s=30.0, stable_window_s=10.0, panic_window_s=2.0)
    s = Scaler()
    run(s, p, [5.0] * 20)
    quiet = run(s, p, [0.0] * 40, start=20)
    first_zero = next(i for i, d in enumerate(quiet) if d.desired == 0)
    assert first_zero >= 29  # not before 30 s without any demand
    woken = s.decide(p, 100.0, 1.0, ready=0)
    assert woken.desired == 1 and "woken" in woken.reason


def test_scaled_to_zero_it_stays_at_zero_while_its_servers_drain_away() -> None:
    # The demo's surge: 3 replicas ready when the idle grace ends. They drain one by one while
    # nothing asks; desired must stay 0 all along (it flipped 0, 2, 0, 1, 0: the scale-down
    # rate limit raised the next round's answer back over the replicas still ready).
    p = dataclasses.replace(P, min_replicas=0, idle_grace_s=5.0, stable_window_s=10.0, panic_window_s=2.0,
                            target_per_replica=2.0)  # fmt: skip
    s = Scaler()
    run(s, p, [6.0] * 10, follow=False, ready=3)
    after = [
        s.decide(p, 10.0 + t, 0.0, ready).desired
        for t, ready in enumerate([3] * 8 + [2] * 3 + [1] * 3 + [0] * 3)
    ]
    zero = after.index(0)
    assert zero == 4 and after[zero:] == [0] * (len(after) - zero), after
    assert s.decide(p, 40.0, 1.0, ready=0).desired == 1  # one request still wakes it


def test_a_model_never_busy_starts_at_zero_with_min_zero() -> None:
    p = dataclasses.replace(P, min_replicas=0)
    assert Scaler().decide(p, 0.0, 0.0, ready=0).desired == 0


def test_target_comes_from_config_then_slots_then_the_default() -> None:
    assert target_of(P, slots=64) == 10.0
    learnt = dataclasses.replace(P, target_per_replica=None)
    assert target_of(learnt, slots=16) == 16 * 0.7
    assert target_of(learnt, slots=None) == DEFAULT_TARGET_PER_REPLICA


policies = st.builds(
    ScalingPolicy,
    min_replicas=st.integers(0, 5),
    max_replicas=st.integers(5, 40),
    target_per_replica=st.sampled_from([None, 1.0, 4.0, 16.0]),
    stable_window_s=st.sampled_from([10.0, 60.0]),
    panic_window_s=st.sampled_from([2.0, 6.0]),
    scale_down_rate=st.sampled_from([1.0, 2.0, 10.0]),
    scale_up_rate=st.sampled_from([2.0, 1000.0]),
    idle_grace_s=st.sampled_from([1.0, 30.0]),
)


@settings(max_examples=300, deadline=None)
@given(
    policies,
    st.lists(
        st.tuples(
            st.one_of(st.floats(0, 1e6), st.just(float("nan"))), st.integers(0, 60), st.floats(0.05, 30)
        ),
        max_size=60,
    ),
)
def test_any_sequence_stays_within_min_max_and_demand_always_gets_a_replica(
    policy: ScalingPolicy, steps: list[tuple[float, int, float]]
) -> None:
    s = Scaler()
    now = 0.0
    for demand, ready, dt in steps:
        now += dt
        d = s.decide(policy, now, demand, ready)
        assert policy.min_replicas <= d.desired <= policy.max_replicas
        if demand > 0:
            assert d.desired >= 1
        if "scaled to zero" in d.reason:  # idle for the grace: the rate limits do not apply
            assert d.desired == 0 and policy.min_replicas == 0 and not demand > 0
        elif (
            not d.panicking
            and policy.min_replicas <= max(ready, 1) // policy.scale_down_rate <= policy.max_replicas
        ):
            assert (
                d.desired >= int(max(ready, 1) // policy.scale_down_rate) or d.desired == policy.max_replicas
            )


@settings(max_examples=150, deadline=None)
@given(policies, st.floats(0.5, 500))
def test_constant_demand_converges_to_its_share_of_the_target(policy: ScalingPolicy, demand: float) -> None:
    s = Scaler()
    ready, now, d = 1, 0.0, None
    for _ in range(int(3 * policy.stable_window_s) + 50):
        d = s.decide(policy, now, demand, ready)
        ready, now = d.desired, now + 1.0
    assert d is not None
    want = -(-demand // d.target) if demand % d.target else demand // d.target
    assert d.desired == min(max(int(want), policy.min_replicas, 1), policy.max_replicas)
