from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.balancing.policies import (
    POLICIES,
    EndpointLoad,
    PolicyConfig,
    SmoothingConfig,
    adaptive,
    smooth,
)

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


def test_adaptive_backlog_and_kv_reduce_weight() -> None:
    w = adaptive(
        [EndpointLoad("idle"), EndpointLoad("queued", waiting=10), EndpointLoad("kv", kv_use=0.8)],
        CFG,
    )
    assert w["idle"] == 100
    assert w["queued"] == 33  # saturation 2 -> 1/3
    assert w["kv"] == 50  # saturation 1 -> 1/2


def test_adaptive_penalises_errors() -> None:
    w = adaptive([EndpointLoad("ok"), EndpointLoad("bad", error_rate=0.1)], CFG)
    assert w["bad"] < w["ok"] / 4


def test_stale_signals_fade_to_capacity_only() -> None:
    busy = {"waiting": 50.0}
    fresh = adaptive([EndpointLoad("a"), EndpointLoad("b", **busy)], CFG)["b"]
    halfway = adaptive([EndpointLoad("a"), EndpointLoad("b", age_s=17.5, **busy)], CFG)["b"]
    gone = adaptive([EndpointLoad("a"), EndpointLoad("b", age_s=60, **busy)], CFG)["b"]
    assert fresh < halfway < gone == 100


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
    w = {"a": 100}
    for _ in range(20):
        w = smooth(w, {"a": 10}, cfg)
    assert 10 <= w["a"] <= 12
