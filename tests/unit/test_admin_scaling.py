"""What the operator API shows of autoscaling: each decision, the endpoints a scale-down
would drain next (scale_down's order over the weigher's view) and those draining now."""

from __future__ import annotations

import math

from controlplane.admin.auth import READ_ONLY_METHODS
from controlplane.admin.scaling import next_to_remove, scaling_messages
from controlplane.admin.service import SERVICE_NAMES
from controlplane.autoscaling.autoscaler import MODEL
from controlplane.autoscaling.kpa import Decision
from controlplane.balancing.weigher import ClusterView
from controlplane.fleet import parse_fleet
from controlplane.signals.load import EndpointLoad

A, B, C, D, E = (f"127.0.0.1:800{i}" for i in range(1, 6))


def view(*loads: EndpointLoad, version: str = "v1", weight: int = 10, model: str = "m") -> ClusterView:
    return ClusterView(model, version, "least_request", loads, {ld.address: weight for ld in loads})


def load(address: str, running: float = 0.0, **kw: object) -> EndpointLoad:
    return EndpointLoad(address=address, running=running, **kw)  # type: ignore[arg-type]


def decision(desired: int, ready: int, **kw: object) -> Decision:
    fields: dict[str, object] = {
        "demand": 0.0,
        "stable_demand": 0.0,
        "panic_demand": 0.0,
        "target": 8.0,
        "panicking": False,
        "reason": "stable: the last 60s want 1",
    }
    return Decision(desired, ready, **{**fields, **kw})  # type: ignore[arg-type]


# ---- next_to_remove -----------------------------------------------------------------------


def test_nothing_to_remove_when_desired_covers_the_ready() -> None:
    v = view(load(A), load(B))
    assert next_to_remove(2, [v], v, set(), False) == ()
    assert next_to_remove(3, [v], v, set(), False) == ()


def test_the_least_loaded_go_first_then_the_newest() -> None:
    v = view(
        load(A, running=3),
        load(B, running=1, waiting=1),  # load is running + waiting: 2
        load(C, running=1, ready_for_s=600.0),
        load(D, running=1, ready_for_s=5.0),  # the newest of the equally loaded
    )
    assert next_to_remove(1, [v], v, set(), False) == (D, C, B)
    assert next_to_remove(3, [v], v, set(), False) == (D,)


def test_gpu_classes_the_model_does_not_prefer_go_first() -> None:
    v = view(load(A, preferred=True), load(B, running=5), load(C, preferred=True, running=0))
    # B is not of a preferred class: it goes first, loaded as it is.
    assert next_to_remove(1, [v], v, set(), True) == (B, A)
    # A model with no preference: the load alone decides (preferred is only ever set for one).
    assert next_to_remove(1, [v], v, set(), False) == (A, C)


def test_held_out_and_not_ready_endpoints_are_not_replicas_to_drain() -> None:
    v = ClusterView(
        "m",
        "v1",
        "least_request",
        (load(A), load(B, ready=False), load(C), load(D)),
        {A: 10, B: 10, C: 0, D: 10},  # C is held out (weight 0)
    )
    # Ready are A and D: one too many for 1.
    assert next_to_remove(1, [v], v, set(), False) == (A,)


def test_endpoints_already_draining_are_neither_counted_nor_named_again() -> None:
    v = view(load(A), load(B), load(C))
    # 3 ready, 1 wanted, B already on its way out: one more to go.
    assert next_to_remove(1, [v], v, {B}, False) == (A,)
    assert next_to_remove(2, [v], v, {B}, False) == ()


def test_a_whole_model_counts_every_version_but_drains_from_its_stable() -> None:
    stable = view(load(A), load(B, running=1))
    canary = view(load(C), version="v2")
    # 3 ready over both versions, 1 wanted: two from the stable version, least loaded first.
    assert next_to_remove(1, [stable, canary], stable, set(), False) == (A, B)
    # More to remove than the stable version has: only what it has.
    assert next_to_remove(0, [stable, canary], stable, set(), False) == (A, B)
    assert next_to_remove(1, [stable, canary], None, set(), False) == ()


# ---- scaling_messages ---------------------------------------------------------------------

FLEET = parse_fleet(
    f"""\
listener: {{port: 10000}}
tiers: {{small: {{autoscaling: {{min: 0, max: 6, idle_grace: 10s}}}}}}
models:
  m:
    params_b: 1
    stable: v1
    preferred_gpus: [H100]
    versions:
      v1: {{endpoints: ["{A}", {{address: "{B}", gpu: H100}}]}}
      v2: {{endpoints: ["{C}"]}}
  quiet:
    params_b: 1
    stable: v1
    autoscaling: {{min: 2}}
    versions: {{v1: {{endpoints: ["{D}", "{E}"]}}}}
"""
)


def test_one_message_per_decision_in_the_fleets_order_with_the_policy_bounds() -> None:
    views = {
        "m@v1": view(load(A), load(B, preferred=True)),
        "m@v2": view(load(C), version="v2"),
        "quiet@v1": view(load(D), load(E), model="quiet"),
    }
    decisions = {
        ("m", "v2"): decision(1, 1),
        ("m", MODEL): decision(1, 3, demand=2.5, idle_s=0.0),
        ("m", "v1"): decision(1, 2),
        ("quiet", MODEL): decision(2, 2, demand=0.0, idle_s=30.0, reason="stable: want 0; raised to min 2"),
    }
    rows = scaling_messages(FLEET, decisions, views, frozenset({C}))
    assert [(r.model, r.version) for r in rows] == [("m", ""), ("m", "v1"), ("m", "v2"), ("quiet", "")]
    whole, v1, v2, quiet = rows
    assert (whole.desired, whole.ready, whole.demand, whole.target_per_replica) == (1, 3, 2.5, 8.0)
    assert (whole.min, whole.max, quiet.min, quiet.max) == (0, 6, 2, 6)
    assert whole.active and not quiet.active  # idle 30s past its 10s grace
    assert quiet.reason == "stable: want 0; raised to min 2"
    # C (the canary) drains already; of the stable's two, A is not of the preferred class.
    assert list(whole.remove) == [A] and list(whole.draining) == [C]
    assert list(v1.remove) == [A] and list(v1.draining) == []
    assert list(v2.remove) == [] and list(v2.draining) == [C]
    assert list(quiet.remove) == [] and list(quiet.draining) == []
    assert not whole.HasField("predicted_demand")


def test_a_model_filter_and_a_model_not_decided_yet() -> None:
    decisions = {("m", MODEL): decision(2, 0), ("quiet", MODEL): decision(2, 0)}
    assert [r.model for r in scaling_messages(FLEET, decisions, {}, frozenset(), "quiet")] == ["quiet"]
    assert scaling_messages(FLEET, {}, {}, frozenset(), "m") == []
    # No views (the weigher has not run): nothing is named to remove.
    assert [list(r.remove) for r in scaling_messages(FLEET, decisions, {}, frozenset())] == [[], []]


def test_a_forecast_is_distinct_from_no_forecast() -> None:
    decisions = {
        ("m", MODEL): decision(3, 1, predicted_demand=0.0, forecast_method="holt", lead_s=30.0),
        ("quiet", MODEL): decision(2, 2),
    }
    m, quiet = scaling_messages(FLEET, decisions, {}, frozenset())
    assert m.HasField("predicted_demand") and m.predicted_demand == 0.0
    assert (m.forecast_method, m.lead_seconds) == ("holt", 30.0)
    assert not quiet.HasField("predicted_demand") and quiet.forecast_method == ""


def test_an_endpoint_ready_since_unknown_counts_as_the_oldest() -> None:
    v = view(load(A, ready_for_s=math.inf), load(B, ready_for_s=1.0))
    assert next_to_remove(1, [v], v, set(), False) == (B,)


def test_the_service_is_served_and_its_list_is_read_only() -> None:
    assert "controlplane.v1.AutoscalingService" in SERVICE_NAMES
    for name in SERVICE_NAMES:
        assert f"/{name}/List" in READ_ONLY_METHODS
