from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.balancing.policies import (
    POLICIES,
    PolicyConfig,
    SmoothingConfig,
    adaptive,
    smooth,
)
from controlplane.signals.load import EndpointLoad

CFG = PolicyConfig()

loads_strategy = st.lists(
    st.builds(
        EndpointLoad,
        address=st.uuids().map(str),
        ready=st.booleans(),
        running=st.floats(0, 500),
        waiting=st.floats(0, 500),
        kv_use=st.floats(0, 1),
        latency_s=st.one_of(st.none(), st.floats(0.001, 600)),
        error_rate=st.floats(0, 1),
        age_s=st.floats(0, 100),
        capacity=st.floats(0.05, 10),
        ready_for_s=st.floats(0, 1000),
        token_latency_s=st.one_of(st.none(), st.floats(0.0001, 10)),
    ),
    min_size=1,
    max_size=20,
    unique_by=lambda e: e.address,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(loads=loads_strategy)
def test_every_policy_keeps_the_invariants(name: str, loads: list[EndpointLoad]) -> None:
    weights = POLICIES[name](loads, CFG)
    assert set(weights) == {e.address for e in loads}
    for e in loads:
        if e.ready:
            assert CFG.floor <= weights[e.address] <= CFG.max_weight
        else:
            assert weights[e.address] == 0  # held out until warm
    if any(e.ready for e in loads):
        assert max(weights.values()) == CFG.max_weight  # never all zeros, full scale used


def test_adaptive_gives_a_3x_slower_gpu_a_third() -> None:
    w = adaptive([EndpointLoad("fast", capacity=3.0), EndpointLoad("slow", capacity=1.0)], CFG)
    assert w == {"fast": 100, "slow": 33}


def test_adaptive_backlog_counts_the_queue_against_the_running_batch() -> None:
    w = adaptive(
        [
            EndpointLoad("idle"),
            EndpointLoad("half", capacity=0.5),  # unlike GPUs: the queues count
            EndpointLoad("small_batch", running=6, waiting=2),  # a third of the batch waits
            EndpointLoad("big_batch", running=200, waiting=2),  # 1% waits: hardly matters
            EndpointLoad("stuck", running=0, waiting=3),
        ],
        CFG,
    )
    assert w["idle"] == 100
    assert w["small_batch"] == pytest.approx(50, abs=1)
    assert w["big_batch"] >= 95
    assert w["stuck"] == pytest.approx(10, abs=1)


def test_adaptive_leaves_the_queues_of_like_servers_to_envoy() -> None:
    """Like GPUs keep equal weights whatever their queues: Envoy's full scan of its own
    requests in flight sees a queue at once; unequal weights would switch it to EDF."""
    like = [
        EndpointLoad("a"),
        EndpointLoad("b", running=4, waiting=6),
        EndpointLoad("c", running=0, waiting=3),
    ]
    assert adaptive(like, CFG) == {"a": 100, "b": 100, "c": 100}
    # ...but not what requests in flight cannot show: errors, KV pressure, a ramp, a cold server
    assert adaptive([*like, EndpointLoad("d", error_rate=0.1)], CFG)["b"] < 100
    assert adaptive([*like, EndpointLoad("d", kv_use=0.95)], CFG)["d"] < 100
    assert adaptive([*like, EndpointLoad("d", ready=False)], CFG) == {"a": 100, "b": 100, "c": 100, "d": 0}


def test_adaptive_kv_use_counts_only_above_its_saturation() -> None:
    w = adaptive(
        [EndpointLoad("a", kv_use=0.0), EndpointLoad("b", kv_use=0.7), EndpointLoad("c", kv_use=0.9)], CFG
    )
    assert w == {"a": 100, "b": 100, "c": 67}  # 0.9: halfway from 0.8 to full -> 1 / 1.5


def test_adaptive_prefers_fast_gpus_beyond_their_capacity_share() -> None:
    fast = EndpointLoad("fast", capacity=1.0, token_latency_s=0.02)
    slow = EndpointLoad("slow", capacity=0.5, token_latency_s=0.04)  # half as fast per request
    w = adaptive([fast, slow], CFG)
    assert w["fast"] == 100
    assert w["slow"] < 50 * 0.5  # capacity share x (1.1 / 2) ** 1.5
    assert w["slow"] == round(100 * 0.5 * (1.1 / 2) ** CFG.speed_exponent)


def test_adaptive_ignores_small_speed_differences() -> None:
    # measurement noise on identical GPUs must not make weights differ (EDF instead of P2C)
    loads = [EndpointLoad(str(i), token_latency_s=0.020 + 0.0005 * i) for i in range(5)]
    assert set(adaptive(loads, CFG).values()) == {100}


def test_adaptive_uses_end_to_end_latency_where_time_per_token_is_not_reported() -> None:
    w = adaptive([EndpointLoad("a", latency_s=5.0), EndpointLoad("b", latency_s=10.0)], CFG)
    assert w == {"a": 100, "b": round(100 * (1.1 * 0.5) ** CFG.latency_speed_exponent)}
    # ...but time per token wins when reported: it does not depend on the request mix
    same_speed = {"token_latency_s": 0.02}
    w = adaptive(
        [EndpointLoad("a", latency_s=5.0, **same_speed), EndpointLoad("b", latency_s=10.0, **same_speed)], CFG
    )
    assert w == {"a": 100, "b": 100}


def test_adaptive_stale_speed_fades_to_capacity() -> None:
    slow = {"token_latency_s": 0.06, "capacity": 1.0}
    fresh = adaptive([EndpointLoad("a", token_latency_s=0.02), EndpointLoad("b", **slow)], CFG)["b"]
    gone = adaptive([EndpointLoad("a", token_latency_s=0.02), EndpointLoad("b", age_s=60, **slow)], CFG)["b"]
    assert fresh < 25 and gone == 100


def test_adaptive_penalises_errors() -> None:
    w = adaptive([EndpointLoad("ok"), EndpointLoad("bad", error_rate=0.1)], CFG)
    assert w["bad"] < w["ok"] / 4


def test_stale_signals_fade_to_capacity_only() -> None:
    busy = {"waiting": 50.0}
    big = EndpointLoad("a", capacity=2.0)
    fresh = adaptive([big, EndpointLoad("b", **busy)], CFG)["b"]
    halfway = adaptive([big, EndpointLoad("b", age_s=17.5, **busy)], CFG)["b"]
    gone = adaptive([big, EndpointLoad("b", age_s=60, **busy)], CFG)["b"]
    assert fresh < halfway < gone == 50


def test_slow_start_ramps_a_newly_ready_endpoint() -> None:
    ramp = [
        adaptive([EndpointLoad("old"), EndpointLoad("new", ready_for_s=t)], CFG)["new"] for t in (0, 15, 30)
    ]
    assert ramp == [5, 50, 100]


@given(
    previous=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 100)),
    target=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 100)),
)
def test_smoothing_bounds_every_step(previous: dict[str, int], target: dict[str, int]) -> None:
    cfg = SmoothingConfig()
    out = smooth(previous, target, cfg)
    assert set(out) == set(target)
    for addr, w in out.items():
        old = previous.get(addr)
        if old and target[addr]:
            assert old / cfg.max_step - 1 <= w <= old * cfg.max_step + 1
        else:
            assert w == target[addr]


def test_smoothing_ignores_small_changes_and_converges() -> None:
    cfg = SmoothingConfig()
    assert smooth({"a": 100}, {"a": 95}, cfg) == {"a": 100}  # within hysteresis: no push
    assert smooth({"a": 100, "b": 60}, {"a": 100, "b": 55}, cfg) == {"a": 100, "b": 60}
    w = {"a": 100}
    for _ in range(20):
        w = smooth(w, {"a": 10}, cfg)
    assert 10 <= w["a"] <= 12


def test_smoothing_brings_weights_back_to_equal() -> None:
    # Unequal weights switch Envoy from power-of-two-choices to EDF: once the targets are
    # equal again, a weight stuck inside the hysteresis band must not keep it there.
    cfg = SmoothingConfig()
    w = {"a": 100, "b": 50}
    for _ in range(10):
        w = smooth(w, {"a": 100, "b": 100}, cfg)
    assert w == {"a": 100, "b": 100}
    assert smooth({"a": 100, "b": 100}, {"a": 97, "b": 97}, cfg) == {"a": 100, "b": 100}  # already equal


@given(
    previous=st.lists(st.integers(1, 100), min_size=2, max_size=6),
    level=st.integers(1, 100),
)
def test_smoothing_reaches_equal_targets(previous: list[int], level: int) -> None:
    cfg = SmoothingConfig()
    names = [str(i) for i in range(len(previous))]
    w = dict(zip(names, previous, strict=True))
    target = dict.fromkeys(names, level)
    for _ in range(30):
        w = smooth(w, target, cfg)
    assert len(set(w.values())) == 1


def test_least_request_is_equal_weights() -> None:
    from controlplane.balancing.policies import least_request

    loads = [EndpointLoad("a", waiting=9.0), EndpointLoad("b"), EndpointLoad("c", ready=False)]
    assert least_request(loads, PolicyConfig()) == {"a": 100, "b": 100, "c": 0}


def test_capacity_weighs_capacity_and_nothing_else() -> None:
    from controlplane.balancing.policies import capacity

    loads = [
        EndpointLoad("fast", capacity=1.0, waiting=50.0, latency_s=9.0, error_rate=0.5),
        EndpointLoad("slow", capacity=0.35),
        EndpointLoad("cold", capacity=1.0, ready=False),
    ]
    assert capacity(loads, PolicyConfig()) == {"fast": 100, "slow": 35, "cold": 0}


def test_model_aware_holds_out_what_does_not_fit_and_prefers_the_preferred_class() -> None:
    from controlplane.balancing.policies import model_aware

    cfg = PolicyConfig()
    loads = [
        EndpointLoad("small-gpu", fits=False),
        EndpointLoad("preferred", preferred=True),
        EndpointLoad("other"),
        EndpointLoad("other-busy", waiting=4.0, running=4.0),
        EndpointLoad("other-kv-full", kv_use=0.9),
    ]
    w = model_aware(loads, cfg)
    assert w["small-gpu"] == 0
    assert w["preferred"] == 100 and w["other"] == 50  # the bonus doubles it
    assert w["other-busy"] < w["other"] and w["other-kv-full"] < w["other"]  # less headroom


def test_model_aware_fades_stale_signals_to_capacity() -> None:
    from controlplane.balancing.policies import model_aware

    cfg = PolicyConfig()
    stale = [EndpointLoad("a", waiting=20.0, running=1.0, age_s=1e9), EndpointLoad("b")]
    assert model_aware(stale, cfg) == {"a": 100, "b": 100}


def test_every_policy_a_fleet_may_name_is_implemented() -> None:
    from controlplane.fleet.model import POLICY_NAMES

    assert tuple(POLICIES) == POLICY_NAMES
