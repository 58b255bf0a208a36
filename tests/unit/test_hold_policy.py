"""Which models hold (hold/policy.py): a model holds only when it has no server with weight."""

from __future__ import annotations

from controlplane.fleet import parse_fleet
from controlplane.hold.policy import candidate_servers, ready_servers
from controlplane.routing.translate import RoutingOverlay
from tests.fleets import fleet_yaml

FLEET = parse_fleet(fleet_yaml({"m": {"v2": ["127.0.0.1:8001", "127.0.0.1:8002"], "v1": ["127.0.0.1:8003"]}}))
MODEL = FLEET.models[0]


def test_a_version_not_weighed_yet_is_not_ready() -> None:
    # A version replaced in one edit, before the next signals round: the model holds (the
    # holding cluster is always warm) until the round weighs it.
    assert ready_servers(FLEET, MODEL, RoutingOverlay(), {"m@v1": {"127.0.0.1:8003": 5}}) == ()


def test_weight_zero_is_not_ready() -> None:
    weights = {"m@v2": {"127.0.0.1:8001": 0, "127.0.0.1:8002": 1}}
    assert ready_servers(FLEET, MODEL, RoutingOverlay(), weights) == (("127.0.0.1:8002", 100),)
    weights = {"m@v2": {"127.0.0.1:8001": 0, "127.0.0.1:8002": 0}}
    assert ready_servers(FLEET, MODEL, RoutingOverlay(), weights) == ()


def test_draining_servers_and_versions_outside_the_split_are_left_out() -> None:
    weights = {"m@v2": {"127.0.0.1:8001": 3, "127.0.0.1:8002": 3}, "m@v1": {"127.0.0.1:8003": 2}}
    overlay = RoutingOverlay(splits={"m": (("v2", 90), ("v1", 10))}, draining=frozenset({"127.0.0.1:8001"}))
    assert ready_servers(FLEET, MODEL, overlay, weights) == (("127.0.0.1:8002", 270), ("127.0.0.1:8003", 20))
    assert candidate_servers(MODEL, overlay) == (("127.0.0.1:8002", 90), ("127.0.0.1:8003", 10))
    only_v1 = RoutingOverlay(splits={"m": (("v2", 0), ("v1", 100))})
    assert ready_servers(FLEET, MODEL, only_v1, weights) == (("127.0.0.1:8003", 200),)
