from __future__ import annotations

import math

import pytest

from controlplane.balancing.weigher import (
    LoadOf,
    Weigher,
    load_balance_degree,
    policy_config,
    relative_capacity,
)
from controlplane.fleet import parse_fleet
from controlplane.fleet.model import Endpoint, Model
from controlplane.signals.load import EndpointLoad
from tests.fleets import fleet_yaml

FLEET = parse_fleet(
    fleet_yaml(
        {
            "chat": {"v1": ["127.10.0.1:80", "127.10.0.2:80"], "v2": ["127.10.0.3:80"]},
            "embed": {"v1": ["127.10.1.1:80"]},
        },
        extra_model_keys={"embed": "balancing: round_robin"},
    )
    + "signals: {slow_start: 10s, stale_after: 2s, stale_full: 4s}\n"
)


def loads(table: dict[str, EndpointLoad]) -> LoadOf:
    def load_of(model: Model, ep: Endpoint) -> EndpointLoad:
        return table.get(ep.address, EndpointLoad(ep.address))

    return load_of


def test_only_changed_clusters_come_back() -> None:
    w = Weigher()
    first = w.update(FLEET, loads({}))
    assert set(first) == {"chat@v1", "chat@v2", "embed@v1"}
    assert first["chat@v1"] == {"127.10.0.1:80": 100, "127.10.0.2:80": 100}
    assert w.update(FLEET, loads({})) == {}
    busy = {"127.10.0.2:80": EndpointLoad("127.10.0.2:80", kv_use=0.97)}
    changed = w.update(FLEET, loads(busy))
    assert set(changed) == {"chat@v1"}
    assert changed["chat@v1"]["127.10.0.2:80"] < 100
    assert w.views["chat@v1"].policy == "adaptive"
    assert w.views["embed@v1"].policy == "round_robin"


def test_not_ready_is_held_out_at_once() -> None:
    w = Weigher()
    w.update(FLEET, loads({}))
    cold = {"127.10.0.1:80": EndpointLoad("127.10.0.1:80", ready=False)}
    assert w.update(FLEET, loads(cold))["chat@v1"]["127.10.0.1:80"] == 0


def test_removed_clusters_are_forgotten() -> None:
    w = Weigher()
    w.update(FLEET, loads({}))
    smaller = parse_fleet(fleet_yaml({"chat": {"v1": ["127.10.0.1:80"]}}))
    w.update(smaller, loads({}))
    assert set(w.current) == {"chat@v1"} and set(w.views) == {"chat@v1"}


def test_policy_config_takes_the_signals_section() -> None:
    cfg = policy_config(FLEET)
    assert (cfg.slow_start_s, cfg.stale_after_s, cfg.stale_full_s) == (10.0, 2.0, 4.0)


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ([(2, 0, 1.0), (2, 0, 1.0)], 0.0),
        ([(4, 0, 1.0), (0, 0, 1.0)], 2.0),
        ([(4, 0, 2.0), (2, 0, 1.0)], 0.0),  # utilisation is per unit of capacity
        ([(1, 3, 1.0), (0, 0, 1.0), (0, 0, 1.0), (0, 0, 1.0)], math.sqrt(3.0)),
        ([(5, 0, 1.0)], 0.0),
    ],
)
def test_load_balance_degree(table: list[tuple[float, float, float]], expected: float) -> None:
    ls = [EndpointLoad(f"e{i}", running=r, waiting=q, capacity=c) for i, (r, q, c) in enumerate(table)]
    assert load_balance_degree(ls) == pytest.approx(expected)


def test_load_balance_degree_ignores_held_out_endpoints() -> None:
    ls = [
        EndpointLoad("a", running=2),
        EndpointLoad("b", running=2),
        EndpointLoad("c", ready=False, running=9),
    ]
    assert load_balance_degree(ls) == 0.0


def test_relative_capacity_prefers_declared_then_learnt_then_one() -> None:
    got = relative_capacity(
        {"a": None, "b": None, "c": None, "d": 2.0, "e": None},
        {"a": 10.0, "b": 3.0, "c": 10.0, "d": 1.0, "e": None},
    )
    assert got == {"a": 1.0, "b": 0.3, "c": 1.0, "d": 2.0, "e": 1.0}


def test_relative_capacity_is_bounded_and_needs_peers() -> None:
    assert relative_capacity({"a": None, "b": None}, {"a": 100.0, "b": 1.0}) == {"a": 1.0, "b": 0.1}
    assert relative_capacity({"a": None, "b": None}, {"a": 3.0, "b": None}) == {"a": 1.0, "b": 1.0}


def test_model_aware_gets_memory_fit_and_preferred_class_from_the_fleet() -> None:
    fleet = parse_fleet(
        "listener: {port: 10000}\n"
        "tiers: {small: {max_params_b: 80, balancing: model_aware}}\n"
        "gpu_classes: {H100: {memory_gb: 80}, L4: {memory_gb: 24}, A100: {memory_gb: 80}}\n"
        "models:\n"
        "  chat:\n"
        "    params_b: 30\n"  # 30 x 2 bytes x 1.2 = 72 GB: not on an L4
        "    preferred_gpus: [H100]\n"
        "    stable: v1\n"
        "    versions: {v1: {endpoints: [{address: '127.10.0.1:80', gpu: H100}, "
        "{address: '127.10.0.2:80', gpu: L4}, {address: '127.10.0.3:80', gpu: A100}]}}\n"
    )
    w = Weigher().update(fleet, loads({}))["chat@v1"]
    assert w == {"127.10.0.1:80": 100, "127.10.0.2:80": 0, "127.10.0.3:80": 50}


def test_one_clusters_bad_data_never_stops_the_others() -> None:
    """Issue 16, F1: an exception while weighing one cluster (bad data, a policy bug) keeps
    that cluster's weights in force and lets every other cluster update."""
    w = Weigher()
    w.update(FLEET, loads({}))
    busy = {"127.10.1.1:80": EndpointLoad("127.10.1.1:80", ready=False)}

    def load_of(model: Model, ep: Endpoint) -> EndpointLoad:
        if model.name == "chat":
            raise ValueError("cannot convert float NaN to integer")
        return loads(busy)(model, ep)

    changed = w.update(FLEET, load_of)
    assert changed == {"embed@v1": {"127.10.1.1:80": 0}}
    assert set(w.errors) == {"chat@v1", "chat@v2"} and "NaN" in w.errors["chat@v1"]
    assert w.current["chat@v1"] == {"127.10.0.1:80": 100, "127.10.0.2:80": 100}  # in force still
    assert "chat@v1" in w.views
    w.update(FLEET, loads({}))
    assert w.errors == {}


HASHED = parse_fleet(
    """\
listener: {port: 10000}
tiers:
  small: {max_params_b: 15, timeout: 30s}
gpu_classes:
  a100: {capacity: 1.0}
  l4: {capacity: 0.35}
models:
  chat:
    params_b: 8
    stable: v1
    affinity: {header: x-session-id}
    versions:
      v1:
        endpoints:
          - {address: 127.10.0.1:80, gpu: a100}
          - {address: 127.10.0.2:80, gpu: l4}
          - {address: 127.10.0.3:80}
"""
)


def test_a_hashed_model_weighs_declared_capacity_and_nothing_that_moves_with_load() -> None:
    """Consistent hashing places keys by weight: a slow GPU gets a smaller share (and a
    smaller bound), yet a queue or a learnt capacity must not move sessions."""
    w = Weigher()
    first = w.update(HASHED, loads({}))["chat@v1"]
    assert first == {"127.10.0.1:80": 100, "127.10.0.2:80": 35, "127.10.0.3:80": 100}
    assert w.views["chat@v1"].policy == "capacity"
    busy = {
        "127.10.0.1:80": EndpointLoad("127.10.0.1:80", waiting=50.0, capacity=3.0),  # learnt: ignored
        "127.10.0.2:80": EndpointLoad("127.10.0.2:80", latency_s=30.0, capacity=0.1),
    }
    assert w.update(HASHED, loads(busy)) == {}
    cold = {"127.10.0.3:80": EndpointLoad("127.10.0.3:80", ready=False)}
    assert w.update(HASHED, loads(cold))["chat@v1"]["127.10.0.3:80"] == 0  # still held out
