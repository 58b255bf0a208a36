from __future__ import annotations

import dataclasses

from controlplane.fleet.loader import parse_fleet
from controlplane.rollout import machine
from controlplane.rollout.machine import RolloutSpec
from controlplane.rollout.overlay import EndpointDrain, ModelLayer, effective, stale_layers
from controlplane.routing.translate import translate

FLEET = """
listener: {port: 10000}
tiers: {small: {}}
models:
  m:
    params_b: 8
    stable: v1
    versions:
      v1: {endpoints: [{address: "127.0.0.1:8001"}, {address: "127.0.0.1:8002"}]}
      v2: {endpoints: [{address: "127.0.0.1:8003"}]}
"""


def _fleet(stable: str = "v1"):  # type: ignore[no-untyped-def]
    return parse_fleet(FLEET.replace("stable: v1", f"stable: {stable}"))


def test_no_layer_is_the_file() -> None:
    f = _fleet()
    eff, ov = effective(f, {}, {}, {})
    assert eff == f
    assert ov.splits == {} and ov.draining == frozenset()


def test_a_running_rollout_splits_by_its_weights() -> None:
    r, _ = machine.start(RolloutSpec("m", "v1", "v2", interval_s=1), 0.0)
    r, _ = machine.apply(r, machine.Tick(0.0))  # every proxy ready: step 1
    _, ov = effective(_fleet(), {}, {"m": r}, {})
    assert ov.splits == {"m": (("v1", 95), ("v2", 5))}
    rc = translate(_fleet(), overlay=ov).by_type[
        "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
    ]["inference"]
    default = next(x for x in rc.virtual_hosts[0].routes if x.name == "header/m")
    assert [(c.name, c.weight.value) for c in default.route.weighted_clusters.clusters] == [
        ("m@v1", 95),
        ("m@v2", 5),
    ]


def test_waiting_rollout_keeps_everything_on_stable() -> None:
    r, _ = machine.start(RolloutSpec("m", "v1", "v2"), 0.0)
    _, ov = effective(_fleet(), {}, {"m": r}, {})
    assert ov.splits == {"m": (("v1", 100),)}


def test_promoted_stable_holds_until_the_file_changes_stable() -> None:
    layer = ModelLayer("m", file_stable="v1", stable="v2", versions={"v1": ("retired", 5.0)})
    eff, _ = effective(_fleet(), {"m": layer}, {}, {})
    m = eff.models[0]
    assert m.stable == "v2"
    assert [v.name for v in m.versions] == ["v2"]  # v1 retired: its cluster is gone
    # The operator edits the file's stable: the layer no longer applies.
    assert stale_layers(_fleet("v2"), [layer]) == [layer]
    eff2, _ = effective(_fleet("v2"), {"m": layer}, {}, {})
    assert [v.name for v in eff2.models[0].versions] == ["v1", "v2"]


def test_draining_version_endpoints_are_draining_unless_a_rollout_uses_them() -> None:
    layer = ModelLayer("m", file_stable="v1", versions={"v2": ("draining", 1.0)})
    _, ov = effective(_fleet(), {"m": layer}, {}, {})
    assert ov.draining == {"127.0.0.1:8003"}
    r, _ = machine.start(RolloutSpec("m", "v1", "v2"), 0.0)
    _, ov = effective(_fleet(), {"m": layer}, {"m": r}, {})
    assert ov.draining == frozenset()


def test_endpoint_drains_mark_then_remove() -> None:
    d = EndpointDrain("127.0.0.1:8001", "draining", 0.0, 60.0, "me", "maintenance")
    eff, ov = effective(_fleet(), {}, {}, {d.address: d})
    assert ov.draining == {"127.0.0.1:8001"}
    assert len(eff.models[0].versions[0].endpoints) == 2
    done = dataclasses.replace(d, state="drained")
    eff, ov = effective(_fleet(), {}, {}, {d.address: done})
    assert ov.draining == frozenset()
    assert [e.address for e in eff.models[0].versions[0].endpoints] == ["127.0.0.1:8002"]


def test_shadow_mirrors_a_share_to_the_canary_while_the_rollout_runs() -> None:
    r, _ = machine.start(RolloutSpec("m", "v1", "v2", shadow_percent=20), 0.0)
    _, ov = effective(_fleet(), {}, {"m": r}, {})
    assert ov.shadow == {"m": ("v2", 20)}
    rc = translate(_fleet(), overlay=ov).by_type[
        "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
    ]["inference"]
    routes = {x.name: x for x in rc.virtual_hosts[0].routes}
    [mirror] = routes["body/m"].route.request_mirror_policies
    assert mirror.cluster == "m@v2"
    assert mirror.runtime_fraction.default_value.numerator == 20
    assert routes["body/m"].route.cluster == "m@v1"  # users are still served by stable only
    assert not routes["body/m@v2"].route.request_mirror_policies  # x-model-version: never mirrored
    done, _ = machine.apply(r, machine.Abort())
    _, ov = effective(_fleet(), {}, {"m": done}, {})
    assert ov.shadow == {}


def test_draining_endpoints_are_sent_as_draining() -> None:
    from envoy.config.core.v3 import health_check_pb2

    d = EndpointDrain("127.0.0.1:8002", "draining", 0.0, 60.0, "me", "")
    _, ov = effective(_fleet(), {}, {}, {d.address: d})
    cla = translate(_fleet(), overlay=ov).by_type[
        "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    ]["m@v1"]
    status = {
        lb.endpoint.address.socket_address.port_value: lb.health_status
        for loc in cla.endpoints
        for lb in loc.lb_endpoints
    }
    assert status == {8001: health_check_pb2.UNKNOWN, 8002: health_check_pb2.DRAINING}
