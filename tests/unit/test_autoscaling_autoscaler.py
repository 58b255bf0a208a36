"""Demand and ready replicas per model and version, from the weigher's view of each cluster."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.autoscaling.autoscaler import MODEL, Autoscaler
from controlplane.fleet import parse_fleet
from controlplane.signals.load import EndpointLoad


@dataclass(frozen=True)
class ClusterLoads:
    """One cluster's round as the weigher hands it on (autoscaler.ClusterLoads)."""

    model: str
    version: str
    loads: tuple[EndpointLoad, ...]
    weights: Mapping[str, int]


FLEET = parse_fleet(
    """\
listener: {port: 10000}
tiers: {small: {autoscaling: {target_per_replica: 10}}}
models:
  m:
    params_b: 1
    stable: v1
    versions:
      v1: {endpoints: ["127.0.0.1:8001", "127.0.0.1:8002"]}
      v2: {endpoints: ["127.0.0.1:8003"]}
  idle:
    params_b: 1
    stable: v1
    autoscaling: {min: 0}
    versions: {v1: {endpoints: ["127.0.0.1:8004"]}}
"""
)


def loads(*rows: tuple[str, float, float, bool]) -> tuple[EndpointLoad, ...]:
    return tuple(EndpointLoad(address=a, running=r, waiting=w, ready=ok) for a, r, w, ok in rows)


def test_demand_sums_running_waiting_and_held_and_ready_needs_weight() -> None:
    a = Autoscaler()
    v1 = ClusterLoads(
        "m",
        "v1",
        loads(("127.0.0.1:8001", 8, 20, True), ("127.0.0.1:8002", 0, 0, True)),
        {"127.0.0.1:8001": 50},
    )
    v2 = ClusterLoads("m", "v2", loads(("127.0.0.1:8003", 4, 0, False)), {"127.0.0.1:8003": 0})
    out = a.update(FLEET, [v1, v2], now=0.0, held={"m": 3.0})
    model = out[("m", MODEL)]
    assert model.demand == 8 + 20 + 4 + 3 and model.ready == 1  # 8002 has no weight; 8003 not ready
    assert out[("m", "v1")].demand == 28 and out[("m", "v2")].demand == 4
    assert model.desired == 4  # 35 / 10, rounded up (the first sample fills both windows)
    assert out[("idle", MODEL)].desired == 0  # min 0, never busy
    assert set(a.decisions) == {("m", MODEL), ("m", "v1"), ("m", "v2"), ("idle", MODEL)}


def test_slots_learnt_from_the_servers_set_the_target_by_their_median() -> None:
    learnt = parse_fleet(
        "listener: {port: 10000}\ntiers: {small: {}}\n"
        "models: {m: {params_b: 1, stable: v1, versions: {v1: {endpoints: "
        '["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]}}}}\n'
    )
    slots = {"127.0.0.1:8001": 10.0, "127.0.0.1:8002": 20.0, "127.0.0.1:8003": 10000.0}  # one liar
    c = ClusterLoads("m", "v1", loads(*((addr, 0, 0, True) for addr in slots)), dict.fromkeys(slots, 1))
    d = Autoscaler().update(learnt, [c], now=0.0, slots=lambda m, addr: slots[addr])[("m", MODEL)]
    assert d.target == 20 * 0.7
