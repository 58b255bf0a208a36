from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.fleet import parse_fleet
from controlplane.routing.incremental import IncrementalTranslator
from controlplane.routing.translate import CLUSTER, ENDPOINT, ROUTE, RoutingOverlay, translate
from controlplane.xds.snapshot import build_snapshot
from tests.fleets import fleet_yaml

FLEETS = [
    {"a": {"v1": ["10.0.0.1:80", "10.0.0.2:80"]}},
    {"a": {"v1": ["10.0.0.1:80", "10.0.0.2:80"]}, "b": {"v1": ["10.0.1.1:80"]}},
    {"a": {"v1": ["10.0.0.1:80"], "v2": ["10.0.0.3:80"]}, "b": {"v1": ["10.0.1.1:80"]}},
    {"b": {"v1": ["10.0.1.1:80", "10.0.1.2:80"]}},
]
ADDRS = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.1.1:80", "10.0.1.2:80"]


def serialised(d: object) -> dict[str, dict[str, bytes]]:
    by_type = d.by_type  # type: ignore[attr-defined]
    return {
        t: {n: m.SerializeToString(deterministic=True) for n, m in ms.items()} for t, ms in by_type.items()
    }


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, len(FLEETS) - 1),
            st.sampled_from(["v1", "v2"]),
            st.dictionaries(
                st.sampled_from(["a@v1", "a@v2", "b@v1"]),
                st.dictionaries(st.sampled_from(ADDRS), st.integers(1, 100), max_size=3),
                max_size=3,
            ),
            st.sampled_from([None, 0, 5, 50]),  # a rollout of a to v2: the canary's percent
            st.frozensets(st.sampled_from(ADDRS), max_size=2),  # draining endpoints
            st.sampled_from([None, "127.0.0.1:18002", "controlplane.svc:18002"]),  # holding service
            st.frozensets(st.sampled_from(["a", "b"])),  # models with no ready server
        ),
        min_size=1,
        max_size=8,
    )
)
def test_incremental_equals_full_translation(
    steps: list[
        tuple[int, str, dict[str, dict[str, int]], int | None, frozenset[str], str | None, frozenset[str]]
    ],
) -> None:
    inc = IncrementalTranslator()
    for fleet_i, stable_a, weights, canary, draining, hold_address, holding in steps:
        models = FLEETS[fleet_i]
        stable = {"a": stable_a} if "a" in models and stable_a in models["a"] else {}
        fleet = parse_fleet(fleet_yaml(models, stable=stable))
        splits = {}
        if canary is not None and "v2" in models.get("a", {}):
            splits = {"a": (("v1", 100 - canary), ("v2", canary)) if canary else (("v1", 100),)}
        overlay = RoutingOverlay(
            splits=splits,
            draining=draining,
            shadow={"a": ("v2", 10)} if canary == 50 and splits else {},
            holding=holding,
            hold_address=hold_address,
        )
        assert serialised(inc.translate(fleet, weights, None, overlay)) == serialised(
            translate(fleet, weights, None, overlay)
        )


def test_one_clusters_weight_change_builds_one_message_and_one_serialisation() -> None:
    models = {f"m{i}": {"v1": [f"10.0.{i}.{j}:80" for j in range(5)]} for i in range(50)}
    fleet = parse_fleet(fleet_yaml(models))
    inc = IncrementalTranslator()
    first = build_snapshot(inc.translate(fleet, {}), 1, 0.0)
    assert inc.built == 50 + 50 + 2 * 50 + 2  # clusters, assignments, API listener+route, gateway
    weights = {"m7@v1": {"10.0.7.1:80": 9}}
    second = build_snapshot(inc.translate(fleet, weights), 2, 0.0, previous=first)
    assert inc.built == 1
    assert second.changes[ENDPOINT] == {"m7@v1"}
    assert second.changes[CLUSTER] == frozenset() and second.changes[ROUTE] == frozenset()
    reused = sum(
        second.resources[t][n] is first.resources[t][n] for t in first.resources for n in first.resources[t]
    )
    assert reused == sum(len(r) for r in first.resources.values()) - 1


def test_snapshot_changes_list_removals() -> None:
    inc = IncrementalTranslator()
    a = build_snapshot(inc.translate(parse_fleet(fleet_yaml(FLEETS[1]))), 1, 0.0)
    b = build_snapshot(inc.translate(parse_fleet(fleet_yaml(FLEETS[0]))), 2, 0.0, previous=a)
    assert b.changes[CLUSTER] == {"b@v1"}
    assert "b@v1" not in b.resources[CLUSTER]
    assert b.parent == 1


# ---- isolation: one model's failure never stops the others' updates (issue 16) ------------


def test_a_model_that_fails_to_build_keeps_its_last_good_resources_and_others_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from controlplane.routing import incremental

    fleet = parse_fleet(fleet_yaml({"a": {"v1": ["127.10.0.1:80"]}, "b": {"v1": ["127.10.1.1:80"]}}))
    t = IncrementalTranslator()
    first = t.translate(fleet, {"a@v1": {"127.10.0.1:80": 10}, "b@v1": {"127.10.1.1:80": 10}})
    assert t.failed == {}
    real = incremental.build_assignment

    def broken_for_b(cname: str, *args: object, **kw: object) -> object:
        if cname == "b@v1":
            raise ValueError("cannot convert float NaN to integer")
        return real(cname, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(incremental, "build_assignment", broken_for_b)
    second = t.translate(fleet, {"a@v1": {"127.10.0.1:80": 70}, "b@v1": {"127.10.1.1:80": 70}})
    assert t.failed == {"b": "ValueError: cannot convert float NaN to integer"}
    a = second.by_type[ENDPOINT]["a@v1"]
    assert a.endpoints[0].lb_endpoints[0].load_balancing_weight.value == 70  # a updated
    assert second.by_type[ENDPOINT]["b@v1"] is first.by_type[ENDPOINT]["b@v1"]  # b kept its last
    assert set(second.by_type[CLUSTER]) == {"a@v1", "b@v1"}


def test_a_new_model_that_fails_to_build_is_left_out_until_it_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.routing import incremental

    t = IncrementalTranslator()
    t.translate(parse_fleet(fleet_yaml({"a": {"v1": ["127.10.0.1:80"]}})))
    real = incremental.build_cluster

    def broken_for_c(model: object, cname: str, *args: object) -> object:
        if cname.startswith("c@"):
            raise TypeError("complex")
        return real(model, cname, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(incremental, "build_cluster", broken_for_c)
    both = parse_fleet(fleet_yaml({"a": {"v1": ["127.10.0.1:80"]}, "c": {"v1": ["127.10.2.1:80"]}}))
    out = t.translate(both)
    assert set(t.failed) == {"c"} and set(out.by_type[CLUSTER]) == {"a@v1"}
    routes = out.by_type[ROUTE]
    assert "c@v1" not in str(routes)  # no route names a cluster that is not there
    monkeypatch.setattr(incremental, "build_cluster", real)
    healed = t.translate(both)
    assert t.failed == {} and set(healed.by_type[CLUSTER]) == {"a@v1", "c@v1"}
    assert serialised(healed) == serialised(translate(both))
