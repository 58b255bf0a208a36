from __future__ import annotations

import os
from collections.abc import Iterable

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.service.discovery.v3 import discovery_pb2
from hypothesis import example, given, settings
from hypothesis import strategies as st

from controlplane import limits
from controlplane.fleet import parse_fleet
from controlplane.routing.blend import entry_refs
from controlplane.routing.translate import CLUSTER, ENDPOINT, LISTENER, ROUTE, translate
from controlplane.xds.events import (
    Ack,
    Event,
    Nack,
    NackCleared,
    NodeIdentified,
    Refused,
    Send,
    StaleNonce,
    UnknownType,
)
from controlplane.xds.memory import ClusterMemory, dump_named
from controlplane.xds.memory import load as memory_load
from controlplane.xds.protocol import MAX_NAMES_PER_TYPE, MAX_UNKNOWN_TYPES_REPORTED, XdsStream
from controlplane.xds.snapshot import Lingering, Snapshot, build_snapshot
from tests.fleets import fleet_yaml
from tests.unit.fake_envoy import FakeEnvoy

ONE = {"a": {"v1": ["127.10.0.1:80", "127.10.0.2:80"]}}
TWO = {"a": {"v1": ["127.10.0.1:80", "127.10.0.2:80"]}, "b": {"v1": ["127.10.1.1:80"]}}


def snap(
    models: dict[str, dict[str, list[str]]],
    gen: int = 1,
    previous: Snapshot | None = None,
    weights: dict[str, dict[str, int]] | None = None,
    **kw: object,
) -> Snapshot:
    fleet = parse_fleet(fleet_yaml(models, **kw))  # type: ignore[arg-type]
    return build_snapshot(translate(fleet, weights), gen, created_at=float(gen), previous=previous)


def sends(events: Iterable[Event]) -> list[Send]:
    return [e for e in events if isinstance(e, Send)]


def sotw(payload: bytes) -> discovery_pb2.DiscoveryResponse:
    return discovery_pb2.DiscoveryResponse.FromString(payload)


def req(
    type_url: str, names: Iterable[str] = (), nonce: str = "", error: str = ""
) -> discovery_pb2.DiscoveryRequest:
    r = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=list(names), response_nonce=nonce)
    if error:
        r.error_detail.code = 3
        r.error_detail.message = error
    return r


def cluster_names(payload: bytes) -> set[str]:
    return {cluster_pb2.Cluster.FromString(a.value).name for a in sotw(payload).resources}


# ---- state of the world -------------------------------------------------------------------


def test_first_request_gets_the_full_state_and_node_is_reported() -> None:
    s = XdsStream(snap(ONE), delta=False)
    r = req(CLUSTER)
    r.node.id = "n1"
    ev = s.receive(r, 0)
    assert isinstance(ev[0], NodeIdentified) and ev[0].node_id == "n1"
    [out] = sends(ev)
    assert out.type_url == CLUSTER
    assert cluster_names(out.payload) == {"a@v1"}
    assert sotw(out.payload).nonce == out.nonce
    assert sotw(out.payload).version_info == out.version


def test_ack_is_recorded_and_nothing_is_resent() -> None:
    s = XdsStream(snap(ONE), delta=False)
    [out] = sends(s.receive(req(CLUSTER), 0))
    ev = s.receive(req(CLUSTER, nonce=out.nonce), 5.0)
    acks = [e for e in ev if isinstance(e, Ack)]
    assert len(acks) == 1 and acks[0].latency_s == 4.0  # snapshot created at t=1
    assert sends(ev) == []
    assert s.status(CLUSTER) == "SYNCED"
    # The same content in a new snapshot is not pushed again.
    assert sends(s.set_snapshot(snap(ONE, gen=2), 6)) == []


def test_nack_is_never_answered_with_the_same_config() -> None:
    s = XdsStream(snap(ONE), delta=False)
    [first] = sends(s.receive(req(CLUSTER), 0))
    s.receive(req(CLUSTER, nonce=first.nonce), 0)
    [bad] = sends(s.set_snapshot(snap(TWO, gen=2), 1))
    ev = s.receive(req(CLUSTER, nonce=bad.nonce, error="no"), 2)
    # The one change it carried is blamed; the state without it goes out in full, since
    # Envoy may or may not have applied the rest of a rejected response.
    assert [type(e) for e in ev] == [Nack, Send]
    assert cluster_names(ev[1].payload) == {"a@v1"}  # type: ignore[union-attr]
    assert s.status(CLUSTER) == "NACKED"
    assert s.types[CLUSTER].last_error == "no"
    s.receive(req(CLUSTER, nonce=ev[1].nonce), 3)  # type: ignore[union-attr]
    assert s.status(CLUSTER) == "NACKED"  # b@v1 is still wanted and still refused
    # Re-requesting, or a new snapshot with identical content, sends nothing.
    assert sends(s.receive(req(CLUSTER, nonce=ev[1].nonce), 3)) == []  # type: ignore[union-attr]
    assert sends(s.set_snapshot(snap(TWO, gen=3), 4)) == []
    # Different content goes out, and once ACKed the status clears.
    [fixed] = sends(
        s.set_snapshot(snap({"a": {"v1": ["127.10.0.1:80"]}, "c": {"v1": ["127.10.2.1:80"]}}, 5), 5)
    )
    assert cluster_names(fixed.payload) == {"a@v1", "c@v1"}
    s.receive(req(CLUSTER, nonce=fixed.nonce), 6)
    assert s.status(CLUSTER) == "SYNCED"


@pytest.mark.parametrize("delta", [False, True])
def test_nack_then_revert_to_what_the_proxy_has_clears_the_nack(delta: bool) -> None:
    s = XdsStream(snap(ONE), delta=delta)
    first_req = discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER) if delta else req(CLUSTER)
    [first] = sends(s.receive(first_req, 0))
    ack = (
        discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER, response_nonce=first.nonce)
        if delta
        else req(CLUSTER, nonce=first.nonce)
    )
    s.receive(ack, 0)
    [bad] = sends(s.set_snapshot(snap(TWO, gen=2), 1))
    nack = (
        discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER, response_nonce=bad.nonce)
        if delta
        else req(CLUSTER, nonce=bad.nonce)
    )
    nack.error_detail.message = "no"
    ev = s.receive(nack, 2)
    # SotW re-sends the state without the blamed change (delta has nothing else to send).
    assert [type(e) for e in ev] == ([Nack] if delta else [Nack, Send])
    if not delta:
        s.receive(req(CLUSTER, nonce=ev[1].nonce), 2)  # type: ignore[union-attr]
    assert s.status(CLUSTER) == "NACKED"
    # Back to what the proxy has: nothing to send, and the status is not stuck on NACKED.
    ev = s.set_snapshot(snap(ONE, gen=3), 3)
    assert ev == [NackCleared(CLUSTER)]
    assert s.status(CLUSTER) == "SYNCED"


def test_stale_nonce_is_ignored() -> None:
    s = XdsStream(snap(TWO), delta=False)
    [out] = sends(s.receive(req(ENDPOINT, ["a@v1"]), 0))
    s.receive(req(ENDPOINT, ["a@v1"], nonce=out.nonce), 0)
    [out2] = sends(s.receive(req(ENDPOINT, ["a@v1", "b@v1"], nonce=out.nonce), 0))
    # A request still carrying the old nonce (and an old subscription) changes nothing.
    ev = s.receive(req(ENDPOINT, ["a@v1"], nonce=out.nonce), 0)
    assert ev == [StaleNonce(ENDPOINT, out.nonce)]
    assert s.types[ENDPOINT].names == {"a@v1", "b@v1"}
    assert s.types[ENDPOINT].in_flight is not None and s.types[ENDPOINT].in_flight.nonce == out2.nonce


def test_one_response_in_flight_coalesces_to_the_latest_snapshot() -> None:
    s = XdsStream(snap(ONE), delta=False)
    [out] = sends(s.receive(req(CLUSTER), 0))
    assert sends(s.set_snapshot(snap(TWO, gen=2), 1)) == []  # waiting for the ACK
    three = {**TWO, "c": {"v1": ["127.10.2.1:80"]}}
    assert sends(s.set_snapshot(snap(three, gen=3), 2)) == []
    [latest] = sends(s.receive(req(CLUSTER, nonce=out.nonce), 3))
    assert cluster_names(latest.payload) == {"a@v1", "b@v1", "c@v1"}
    assert latest.generation == 3


def test_the_oldest_unanswered_response_is_aged_from_its_send_until_an_ack_or_nack() -> None:
    s = XdsStream(snap(ONE), delta=False)
    assert s.unacked_since(CLUSTER) is None  # nothing asked, nothing sent
    [out] = sends(s.receive(req(CLUSTER), 10.0))
    assert s.unacked_since(CLUSTER) == 10.0  # when it was sent, not when its snapshot was made
    s.set_snapshot(snap(TWO, gen=2), 11.0)  # coalesced behind the one in flight: still 10
    assert s.unacked_since(CLUSTER) == 10.0
    [latest] = sends(s.receive(req(CLUSTER, nonce=out.nonce), 12.0))
    # The first one was answered; the response that replaced it waits from its own send.
    assert s.unacked_since(CLUSTER) == 12.0
    s.receive(req(CLUSTER, nonce=latest.nonce), 13.0)
    assert s.unacked_since(CLUSTER) is None and s.status(CLUSTER) == "SYNCED"
    # A stale nonce does not answer the response in flight; a NACK does.
    [bad] = sends(s.set_snapshot(snap(ONE, gen=3), 20.0))
    s.receive(req(CLUSTER, nonce="0"), 21.0)
    assert s.unacked_since(CLUSTER) == 20.0
    ev = s.receive(req(CLUSTER, nonce=bad.nonce, error="no"), 22.0)
    resent = sends(ev)
    # The NACK answered it; what goes out instead is aged from now.
    assert s.unacked_since(CLUSTER) == (22.0 if resent else None)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ([], {"a@v1", "b@v1"}),
        (["*"], {"a@v1", "b@v1"}),
        (["b@v1"], {"b@v1"}),
        (["*", "b@v1"], {"a@v1", "b@v1"}),
    ],
)
def test_wildcard_legacy_star_and_named(names: list[str], expected: set[str]) -> None:
    s = XdsStream(snap(TWO), delta=False)
    [out] = sends(s.receive(req(CLUSTER, names), 0))
    assert cluster_names(out.payload) == expected


def test_legacy_wildcard_ends_when_names_are_given() -> None:
    s = XdsStream(snap(TWO), delta=False)
    [out] = sends(s.receive(req(CLUSTER), 0))
    [out2] = sends(s.receive(req(CLUSTER, ["b@v1"], nonce=out.nonce), 0))
    assert cluster_names(out2.payload) == {"b@v1"}


def test_wildcard_listeners_exclude_proxyless_api_listeners() -> None:
    s = XdsStream(snap(TWO), delta=False)
    [out] = sends(s.receive(req(LISTENER), 0))
    assert [a.type_url for a in sotw(out.payload).resources] == [LISTENER]
    assert len(sotw(out.payload).resources) == 1  # the gateway listener only
    s2 = XdsStream(snap(TWO), delta=False)
    [named] = sends(s2.receive(req(LISTENER, ["a"]), 0))
    assert len(sotw(named.payload).resources) == 1


def test_unknown_eds_name_gets_an_empty_assignment() -> None:
    s = XdsStream(snap(ONE), delta=False)
    [out] = sends(s.receive(req(ENDPOINT, ["ghost@v1"]), 0))
    [res] = sotw(out.payload).resources
    cla = endpoint_pb2.ClusterLoadAssignment.FromString(res.value)
    assert cla.cluster_name == "ghost@v1" and len(cla.endpoints) == 0


def test_unsubscribe_then_resubscribe_resends() -> None:
    s = XdsStream(snap(TWO), delta=False)
    [out] = sends(s.receive(req(ENDPOINT, ["a@v1", "b@v1"]), 0))
    s.receive(req(ENDPOINT, ["a@v1", "b@v1"], nonce=out.nonce), 0)
    assert sends(s.receive(req(ENDPOINT, ["a@v1"], nonce=out.nonce), 0)) == []
    assert set(s.types[ENDPOINT].acked) == {"a@v1"}
    [again] = sends(s.receive(req(ENDPOINT, ["a@v1", "b@v1"], nonce=out.nonce), 0))
    assert again.names == ("b@v1",)


def test_eds_sends_only_changed_assignments() -> None:
    s = XdsStream(snap(TWO), delta=False)
    [out] = sends(s.receive(req(ENDPOINT, ["a@v1", "b@v1"]), 0))
    s.receive(req(ENDPOINT, ["a@v1", "b@v1"], nonce=out.nonce), 0)
    changed = {"a": TWO["a"], "b": {"v1": ["127.10.1.1:80", "127.10.1.2:80"]}}
    [upd] = sends(s.set_snapshot(snap(changed, gen=2), 1))
    assert upd.names == ("b@v1",)


def test_unknown_type_is_reported_once_and_ignored() -> None:
    s = XdsStream(snap(ONE), delta=False)
    secret = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
    assert s.receive(req(secret), 0) == [UnknownType(secret)]
    assert s.receive(req(secret), 0) == []


def test_per_type_stream_serves_only_its_type() -> None:
    s = XdsStream(snap(ONE), delta=False, ads=False, type_url=CLUSTER)
    [out] = sends(s.receive(req(""), 0))  # type_url may be omitted on per-type services
    assert out.type_url == CLUSTER
    assert s.receive(req(LISTENER), 0) == [UnknownType(LISTENER)]


def test_proxyless_grpc_flow_is_not_gated() -> None:
    """gRPC asks LDS, RDS, CDS, EDS by name, one after another; none may wait on another."""
    s = XdsStream(snap(ONE), delta=False)
    [lds] = sends(s.receive(req(LISTENER, ["a"]), 0))
    s.receive(req(LISTENER, ["a"], nonce=lds.nonce), 0)
    [rds] = sends(s.receive(req(ROUTE, ["grpc/a"]), 0))
    [cds] = sends(s.receive(req(CLUSTER, ["a@v1"]), 0))
    [eds] = sends(s.receive(req(ENDPOINT, ["a@v1"]), 0))
    assert (rds.names, cds.names, eds.names) == (("grpc/a",), ("a@v1",), ("a@v1",))


# ---- make-before-break, with a model of Envoy ----------------------------------------------


def run(stream: XdsStream, envoy: FakeEnvoy, now: float = 0.0, limit: int = 200) -> None:
    """Exchange messages until both sides are quiet."""
    for _ in range(limit):
        if not envoy.outbox:
            return
        for ev in stream.receive(envoy.outbox.popleft(), now):
            if isinstance(ev, Send):
                envoy.receive(ev.payload)
    raise AssertionError("no quiescence")


def publish(stream: XdsStream, envoy: FakeEnvoy, s: Snapshot) -> None:
    for ev in stream.set_snapshot(s, 0):
        if isinstance(ev, Send):
            envoy.receive(ev.payload)


@pytest.mark.parametrize("delta", [False, True])
def test_initial_sync_sends_routes_only_after_clusters_and_endpoints(delta: bool) -> None:
    s = XdsStream(snap(TWO), delta=delta)
    envoy = FakeEnvoy(delta=delta)
    envoy.start()
    run(s, envoy)
    assert envoy.violations == []
    assert envoy.routed_clusters() == {"a@v1", "b@v1"} <= envoy.active_clusters()
    assert {t: s.status(t) for t in (CLUSTER, ENDPOINT, LISTENER, ROUTE)} == dict.fromkeys(
        (CLUSTER, ENDPOINT, LISTENER, ROUTE), "SYNCED"
    )


@pytest.mark.parametrize("delta", [False, True])
def test_adding_and_removing_a_model_is_make_before_break(delta: bool) -> None:
    s = XdsStream(snap(ONE), delta=delta)
    envoy = FakeEnvoy(delta=delta)
    envoy.start()
    run(s, envoy)
    publish(s, envoy, snap(TWO, gen=2))
    run(s, envoy)
    assert envoy.violations == []
    assert "b@v1" in envoy.routed_clusters()
    publish(s, envoy, snap(ONE, gen=3))
    run(s, envoy)
    assert envoy.violations == []
    assert set(envoy.clusters) == {"a@v1"}  # removed once no route named it
    assert envoy.routed_clusters() == {"a@v1"}


@pytest.mark.parametrize("delta", [False, True])
def test_changing_stable_moves_routes_after_the_new_cluster_is_warm(delta: bool) -> None:
    s = XdsStream(snap({"a": {"v1": ["127.10.0.1:80"]}}), delta=delta)
    envoy = FakeEnvoy(delta=delta)
    envoy.start()
    run(s, envoy)
    both = {"a": {"v1": ["127.10.0.1:80"], "v2": ["127.10.0.2:80"]}}
    publish(s, envoy, snap(both, gen=2, stable={"a": "v2"}))
    run(s, envoy)
    assert envoy.violations == []
    assert envoy.routed_clusters() == {"a@v1", "a@v2"}  # v1 only by its x-model-version route


@pytest.mark.parametrize("delta", [False, True])
def test_rejected_cluster_keeps_routes_on_the_old_config(delta: bool) -> None:
    s = XdsStream(snap(ONE), delta=delta)
    envoy = FakeEnvoy(delta=delta, reject_clusters={"b@v1"})
    envoy.start()
    run(s, envoy)
    publish(s, envoy, snap(TWO, gen=2))
    run(s, envoy)
    assert envoy.violations == []
    assert envoy.routed_clusters() == {"a@v1"}  # the route to b never arrives
    assert s.status(CLUSTER) == "NACKED"
    before = envoy.responses
    publish(s, envoy, snap(TWO, gen=3))
    run(s, envoy)
    assert envoy.responses == before  # not re-sent


def _tick(stream: XdsStream, envoy: FakeEnvoy, now: float) -> None:
    for ev in stream.tick(now):
        if isinstance(ev, Send):
            envoy.receive(ev.payload)
    run(stream, envoy, now)


@pytest.mark.parametrize("delta", [False, True])
def test_a_cluster_no_route_names_goes_only_after_the_grace(delta: bool) -> None:
    """Envoy ACKs a route at once, but a request started on the old one picks its cluster
    later: the replaced version's cluster stays for the grace, then goes."""
    s = XdsStream(snap({"a": {"v1": ["127.10.0.1:80"]}}), delta=delta, removal_grace_s=2.0)
    envoy = FakeEnvoy(delta=delta)
    envoy.start()
    run(s, envoy)
    assert s.next_deadline() is None
    publish(s, envoy, snap({"a": {"v2": ["127.10.0.2:80"]}}, gen=2))
    run(s, envoy, now=10.0)
    assert envoy.violations == []
    assert envoy.routed_clusters() == {"a@v2"}
    assert set(envoy.clusters) == {"a@v1", "a@v2"}  # routed to by nothing, still there
    assert not s.routes_to("a@v1")  # a rollout waiting for its routes to move goes on now
    assert s.next_deadline() == 12.0
    assert s.status(CLUSTER) == "STALE"
    _tick(s, envoy, 11.9)
    assert set(envoy.clusters) == {"a@v1", "a@v2"}
    _tick(s, envoy, 12.0)
    assert set(envoy.clusters) == {"a@v2"}
    assert envoy.violations == []
    assert s.next_deadline() is None
    assert s.status(CLUSTER) == "SYNCED"


@pytest.mark.parametrize("delta", [False, True])
def test_without_a_grace_the_cluster_goes_at_the_route_ack(delta: bool) -> None:
    s = XdsStream(snap({"a": {"v1": ["127.10.0.1:80"]}}), delta=delta)
    envoy = FakeEnvoy(delta=delta)
    envoy.start()
    run(s, envoy)
    publish(s, envoy, snap({"a": {"v2": ["127.10.0.2:80"]}}, gen=2))
    run(s, envoy, now=10.0)
    assert set(envoy.clusters) == {"a@v2"} and s.next_deadline() is None


def test_a_cluster_named_again_within_the_grace_stays() -> None:
    s = XdsStream(snap({"a": {"v1": ["127.10.0.1:80"]}}), delta=True, removal_grace_s=2.0)
    envoy = FakeEnvoy(delta=True)
    envoy.start()
    run(s, envoy)
    g2 = snap({"a": {"v1": ["127.10.0.1:80"], "v2": ["127.10.0.2:80"]}}, gen=2, stable={"a": "v2"})
    publish(s, envoy, snap({"a": {"v2": ["127.10.0.2:80"]}}, gen=2))
    run(s, envoy, now=10.0)
    publish(s, envoy, g2)
    run(s, envoy, now=11.0)
    _tick(s, envoy, 12.0)
    assert set(envoy.clusters) == {"a@v1", "a@v2"}  # named by its x-model-version route again
    assert envoy.violations == []


def test_after_a_restart_the_declared_clusters_get_the_grace_once_a_route_is_acked() -> None:
    """kill -9, the version replaced in the file meanwhile, a new process: the proxy's old
    route named v1, and a request on it may still pick v1 after the new route's ACK."""
    envoy = FakeEnvoy(delta=True)
    first = XdsStream(snap({"a": {"v1": ["127.10.0.1:80"]}}), delta=True, removal_grace_s=2.0)
    envoy.start()
    run(first, envoy)
    s = XdsStream(snap({"a": {"v2": ["127.10.0.2:80"]}}), delta=True, removal_grace_s=2.0)
    envoy.reconnect()
    run(s, envoy, now=5.0)
    assert envoy.violations == []
    assert envoy.routed_clusters() == {"a@v2"}
    assert set(envoy.clusters) == {"a@v1", "a@v2"}
    assert s.next_deadline() == 7.0
    _tick(s, envoy, 7.0)
    assert set(envoy.clusters) == {"a@v2"}
    assert envoy.violations == []


def test_delta_initial_versions_skip_unchanged_resources_and_remove_gone_ones() -> None:
    """A reconnecting delta proxy keeps every cluster it declares until a route sent on this
    stream is ACKed (its routes may still name them); then the gone ones are removed."""
    s = XdsStream(snap(ONE), delta=True)
    first = snap(ONE)
    known = first.resources[CLUSTER]["a@v1"].version
    r = discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER)
    r.initial_resource_versions["a@v1"] = known
    r.initial_resource_versions["old@v1"] = "x"
    [out] = sends(s.receive(r, 0))
    d = discovery_pb2.DeltaDiscoveryResponse.FromString(out.payload)
    assert [x.name for x in d.resources] == []
    assert list(d.removed_resources) == []  # kept: a route from before may name it
    assert s.status(CLUSTER) == "STALE"
    s.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER, response_nonce=out.nonce), 0)
    # Its route from before, at a version we do not know: not confirmed until ACKed here.
    rr = discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE, resource_names_subscribe=["inference"])
    rr.initial_resource_versions["inference"] = "unknown"
    [empty] = sends(s.receive(rr, 0))
    assert (empty.names, empty.removed) == ((), ())  # a@v1 has no endpoints ACKed yet: nothing partial
    s.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE, response_nonce=empty.nonce), 0)
    er = discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=["a@v1", "old@v1"])
    er.initial_resource_versions["old@v1"] = "y"
    eds = [e for e in sends(s.receive(er, 0)) if e.type_url == ENDPOINT]
    assert [x.name for x in discovery_pb2.DeltaDiscoveryResponse.FromString(eds[0].payload).resources] == [
        "a@v1"
    ]  # old@v1 keeps the assignment it has
    [rds] = sends(
        s.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, response_nonce=eds[0].nonce), 0)
    )
    assert rds.type_url == ROUTE
    [cds] = sends(s.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE, response_nonce=rds.nonce), 0))
    assert cds.type_url == CLUSTER and cds.removed == ("old@v1",)


def test_delta_named_subscription_of_missing_resource_is_answered_as_removed() -> None:
    s = XdsStream(snap(ONE), delta=True)
    r = discovery_pb2.DeltaDiscoveryRequest(type_url=ROUTE, resource_names_subscribe=["nope"])
    [out] = sends(s.receive(r, 0))
    d = discovery_pb2.DeltaDiscoveryResponse.FromString(out.payload)
    assert list(d.removed_resources) == ["nope"]
    assert d.resources[:] == []


def test_delta_stale_nonce_still_applies_subscription_changes() -> None:
    s = XdsStream(snap(TWO), delta=True)
    r = discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=["a@v1"])
    [out] = sends(s.receive(r, 0))
    r2 = discovery_pb2.DeltaDiscoveryRequest(
        type_url=ENDPOINT, response_nonce="999", resource_names_subscribe=["b@v1"]
    )
    ev = s.receive(r2, 0)
    assert StaleNonce(ENDPOINT, "999") in ev
    assert s.types[ENDPOINT].names == {"a@v1", "b@v1"}
    ack = discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, response_nonce=out.nonce)
    [more] = sends(s.receive(ack, 0))
    assert more.names == ("b@v1",)


MODEL_SETS = [
    {},
    ONE,
    TWO,
    {"b": {"v1": ["127.10.1.1:80"]}},
    {"a": {"v1": ["127.10.0.1:80"], "v2": ["127.10.0.3:80"]}},
    {"c": {"v1": ["127.10.2.1:80"]}, "a": {"v2": ["127.10.0.3:80"]}},
]
STABLES = [{}, {"a": "v2"}]


@settings(max_examples=int(os.environ.get("XDS_FUZZ_EXAMPLES", "150")), deadline=None)
@given(
    delta=st.booleans(),
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("publish"), st.integers(0, len(MODEL_SETS) - 1), st.integers(0, 1)),
            st.tuples(st.just("weights"), st.integers(0, 3), st.integers(1, 50)),
            st.tuples(st.just("drain"), st.just(0), st.just(0)),
            st.tuples(st.just("to_server"), st.integers(1, 3), st.just(0)),
            st.tuples(st.just("to_client"), st.integers(1, 3), st.just(0)),
        ),
        max_size=40,
    ),
)
def test_any_interleaving_never_routes_to_a_missing_cluster(
    delta: bool, steps: list[tuple[str, int, int]]
) -> None:
    """Random snapshots and message interleavings: Envoy never routes to a cluster it lacks,
    and once quiet it converges to the latest snapshot."""
    gen = 1
    current = snap(ONE)
    s = XdsStream(current, delta=delta)
    envoy = FakeEnvoy(delta=delta)
    envoy.start()
    wire: list[bytes] = []
    models: dict[str, dict[str, list[str]]] = ONE
    stable: dict[str, str] = {}
    weights: dict[str, dict[str, int]] = {}
    for kind, a, b in steps:
        if kind in ("publish", "weights"):
            gen += 1
            if kind == "publish":
                models = MODEL_SETS[a]
                stable = {k: v for k, v in STABLES[b].items() if k in models and v in models[k]}
                stable.update({m: next(iter(vs)) for m, vs in models.items() if m not in stable})
            else:
                # One cluster's endpoint weights change: the fast path's case.
                clusters = [f"{m}@{v}" for m, vs in models.items() for v in vs]
                if clusters:
                    c = clusters[a % len(clusters)]
                    m, v = c.split("@")
                    weights = {**weights, c: {addr: b for addr in models[m][v]}}
            current = (
                snap(models, gen=gen, stable=stable, previous=current, weights=weights)
                if models
                else _empty_snapshot(gen, current)
            )
            wire += [e.payload for e in s.set_snapshot(current, gen) if isinstance(e, Send)]
        elif kind == "drain":
            _drain(s, envoy, wire, gen)
        else:
            _deliver(kind, a, s, envoy, wire, gen)
        assert envoy.violations == []
    _drain(s, envoy, wire, gen)
    assert envoy.violations == []
    assert set(envoy.clusters) == set(current.resources[CLUSTER])
    expected_routes = current.resources[ROUTE]["inference"].refs
    assert envoy.routed_clusters() == expected_routes
    for name, res in current.resources[ENDPOINT].items():
        assert envoy.assignments[name].SerializeToString(deterministic=True) == res.message.SerializeToString(  # type: ignore[union-attr]
            deterministic=True
        ), f"{name}: endpoints not converged"


def _deliver(kind: str, n: int, s: XdsStream, envoy: FakeEnvoy, wire: list[bytes], now: float) -> None:
    """`n` messages one way: Envoy's requests to the server ("to_server"), or the server's
    responses to Envoy ("to_client")."""
    for _ in range(n):
        if kind == "to_server" and envoy.outbox:
            wire += [e.payload for e in s.receive(envoy.outbox.popleft(), now) if isinstance(e, Send)]
        elif kind == "to_client" and wire:
            envoy.receive(wire.pop(0))


def _drain(s: XdsStream, envoy: FakeEnvoy, wire: list[bytes], now: float) -> None:
    """Deliver everything both ways, in order, until both sides are quiet."""
    for _ in range(500):
        if wire:
            envoy.receive(wire.pop(0))
        elif envoy.outbox:
            wire += [e.payload for e in s.receive(envoy.outbox.popleft(), now) if isinstance(e, Send)]
        else:
            return


def _empty_snapshot(
    gen: int, previous: Snapshot | None = None, seed: dict[str, Lingering] | None = None
) -> Snapshot:
    text = "listener: {port: 10000}\ntiers:\n  small: {timeout: 30s}\nmodels: {}\n"
    return build_snapshot(
        translate(parse_fleet(text)), gen, float(gen), previous=previous, lingering_seed=seed
    )


@pytest.mark.parametrize("delta", [False, True])
def test_one_clusters_weight_change_sends_just_that_assignment(delta: bool) -> None:
    first = snap(TWO)
    s = XdsStream(first, delta=delta)
    envoy = FakeEnvoy(delta=delta)
    envoy.start()
    run(s, envoy)
    assert all(ts.settled == 1 for ts in s.types.values())
    second = snap(TWO, gen=2, previous=first, weights={"b@v1": {"127.10.1.1:80": 5}})
    [out] = sends(s.set_snapshot(second, 2))
    assert out.type_url == ENDPOINT and out.names == ("b@v1",)
    envoy.receive(out.payload)
    run(s, envoy)
    [loc] = envoy.assignments["b@v1"].endpoints
    assert loc.lb_endpoints[0].load_balancing_weight.value == 5
    assert all(ts.settled == 2 for ts in s.types.values())


# ---- a moving fleet against a faithful Envoy ----------------------------------------------

BAD = "cluster_overrides: {connect_timeout: -1s}"  # Envoy refuses the whole CDS response
CLUSTER_EDITS = [
    "",
    "cluster_overrides: {connect_timeout: 2s}",
    "cluster_overrides: {connect_timeout: 3s}",
    BAD,
]
MODELS = ("a", "b", "c")


def moving_snapshot(
    state: dict[str, tuple[str, int]],
    gen: int,
    previous: Snapshot | None,
    weights: dict[str, dict[str, int]] | None = None,
    seed: dict[str, Lingering] | None = None,
) -> Snapshot:
    """model -> (its one version, its cluster edit): each version has two endpoints."""
    models = {
        m: {v: [f"127.0.{MODELS.index(m) + 1}.{int(v[1:]) * 10 + i}:80" for i in range(2)]}
        for m, (v, _) in state.items()
    }
    extra = {m: CLUSTER_EDITS[e] for m, (_, e) in state.items() if CLUSTER_EDITS[e]}
    if not models:
        return _empty_snapshot(gen, previous, seed)
    fleet = parse_fleet(fleet_yaml(models, extra_model_keys=extra))
    return build_snapshot(translate(fleet, weights), gen, float(gen), previous=previous, lingering_seed=seed)


def _bad_clusters(state: dict[str, tuple[str, int]]) -> set[str]:
    return {f"{m}@{v}" for m, (v, e) in state.items() if CLUSTER_EDITS[e] == BAD}


@settings(max_examples=int(os.environ.get("XDS_FUZZ_EXAMPLES", "150")), deadline=None)
@given(
    delta=st.booleans(),
    steps=st.lists(
        st.one_of(
            # A fleet edit on one model: 0 add/remove it, 1 replace its version (the old one
            # leaves the file), 2 a cluster-level edit or a NACK-inducing override.
            st.tuples(st.just("edit"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 3)),
            st.tuples(st.just("weights"), st.integers(0, 2), st.integers(1, 50), st.just(0)),
            st.tuples(st.just("to_server"), st.integers(1, 3), st.just(0), st.just(0)),
            st.tuples(st.just("to_client"), st.integers(1, 3), st.just(0), st.just(0)),
            st.tuples(st.just("drain"), st.just(0), st.just(0), st.just(0)),
            st.tuples(st.just("reconnect"), st.integers(0, 1), st.just(0), st.just(0)),
            st.tuples(st.just("restart"), st.integers(0, 1), st.just(0), st.just(0)),
        ),
        max_size=40,
    ),
)
# A model added, ACKed and routed to after the last periodic write, removed, and the server
# killed: only the write ahead of the snapshot that added it names its cluster.
@example(
    delta=False,
    steps=[
        ("drain", 0, 0, 0),
        ("edit", 1, 0, 0),
        *[("to_server", 3, 0, 0), ("to_client", 3, 0, 0)] * 6,
        ("edit", 1, 0, 0),
        ("restart", 0, 0, 0),
    ],
)
def test_a_moving_fleet_never_leaves_a_routed_request_failing(
    delta: bool, steps: list[tuple[str, int, int, int]]
) -> None:
    """Random fleet edits (versions replaced with the old one removed, models added and
    removed, cluster-level edits, a cluster Envoy refuses beside other changes), weight
    changes, reconnects, restarts (kill -9: only the state directory survives) and message
    interleavings, against a model of Envoy that re-warms,
    holds its CDS ACK and applies NACKed responses in part: no moment in which a routed
    request would fail, and once quiet the proxy has everything it can apply."""
    state: dict[str, tuple[str, int]] = {"a": ("v1", 0)}
    gen = 1
    current = moving_snapshot(state, gen, None)
    memory = ClusterMemory()  # the process's, shared by its streams
    s = XdsStream(current, delta=delta, memory=memory)
    envoy = FakeEnvoy(delta=delta)
    envoy.start()
    wire: list[bytes] = []
    weights: dict[str, dict[str, int]] = {}
    # The memory file as the server writes it: ahead of a snapshot with new cluster names
    # (XdsServer.write_ahead), and now and then (here: when the wire is quiet). A kill -9
    # keeps only this, not what was ACKed since.
    persisted, written = dump_named(memory, current)
    for kind, a, b, c in steps:
        if kind in ("edit", "weights"):
            if kind == "edit":
                model = MODELS[a]
                version, edit = state.get(model, ("v1", 0))
                if b == 0:
                    if model in state:
                        del state[model]
                    else:
                        state[model] = ("v1", 0)
                elif model in state and b == 1:
                    state[model] = ("v2" if version == "v1" else "v1", edit)
                elif model in state:
                    state[model] = (version, c)
            elif state:
                m = sorted(state)[a % len(state)]
                cname = f"{m}@{state[m][0]}"
                weights = {**weights, cname: dict.fromkeys(_addresses(current, cname), b)}
            gen += 1
            new = moving_snapshot(state, gen, current, weights)
            if not new.resources[CLUSTER].keys() <= written:
                persisted, written = dump_named(memory, new)
            current = new
            wire += [e.payload for e in s.set_snapshot(current, gen) if isinstance(e, Send)]
        elif kind == "drain":
            _drain(s, envoy, wire, gen)
            persisted, written = dump_named(memory, current)
        elif kind == "reconnect":
            envoy.reconnect(routes_late=bool(a))
            wire.clear()  # what was on its way is lost with the stream
            s = XdsStream(current, delta=delta, memory=memory)
        elif kind == "restart":
            # kill -9: a new process with only the state directory, on the fleet as it is now
            # (which the proxy may not have had yet).
            memory = ClusterMemory()
            found = memory_load(memory, persisted)
            seed = {n: Lingering(a, 0.0) for n, a in found.assignments.items()}
            gen += 1
            current = moving_snapshot(state, gen, None, weights, seed)
            persisted, written = dump_named(memory, current)
            envoy.reconnect(routes_late=bool(a))
            wire.clear()
            s = XdsStream(current, delta=delta, memory=memory)
        else:
            _deliver(kind, a, s, envoy, wire, gen)
        assert envoy.violations == []
    _drain(s, envoy, wire, gen)
    assert envoy.violations == []
    bad = _bad_clusters(state)
    for name, res in current.resources[CLUSTER].items():
        if name in bad:
            continue
        assert envoy.clusters.get(name) == res.message.SerializeToString(deterministic=True), name  # type: ignore[union-attr]
        assert envoy.assignments[name].SerializeToString(deterministic=True) == current.resources[ENDPOINT][
            name
        ].message.SerializeToString(deterministic=True), f"{name}: endpoints not converged"  # type: ignore[union-attr]
    # Beyond the fleet, only what its routes still need (a replacement it refused).
    assert set(envoy.clusters) <= set(current.resources[CLUSTER]) | envoy.routed_clusters()
    desired_route = current.resources[ROUTE]["inference"].message
    assert isinstance(desired_route, route_pb2.RouteConfiguration)
    good = {r.name: r for r in desired_route.virtual_hosts[0].routes if not (_route_clusters(r) & bad)}
    held = {r.name: r for r in envoy.routes["inference"].virtual_hosts[0].routes}
    for name, r in good.items():
        assert held.get(name) == r, f"route entry {name} not converged"
    assert s.status(CLUSTER) == ("NACKED" if bad else "SYNCED")
    if not bad:
        # (An empty fleet gives no endpoint name to ask for: EDS is never sent.)
        expected = dict.fromkeys((LISTENER, ROUTE), "SYNCED")
        expected[ENDPOINT] = "SYNCED" if state else s.status(ENDPOINT)
        assert {t: s.status(t) for t in (ENDPOINT, LISTENER, ROUTE)} == expected


def _addresses(snapshot: Snapshot, cluster: str) -> list[str]:
    cla = snapshot.resources[ENDPOINT][cluster].message
    assert isinstance(cla, endpoint_pb2.ClusterLoadAssignment)
    return [
        f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}"
        for loc in cla.endpoints
        for e in loc.lb_endpoints
    ]


def _route_clusters(r: route_components_pb2.Route) -> set[str]:
    return set(entry_refs(r))


# ---- bounds on what a client can make a stream hold ----------------------------------------


def test_a_subscription_past_the_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "XDS_MAX_UNKNOWN_NAMES", 10**6)  # this bound alone
    s = XdsStream(snap(ONE), delta=True)
    names = [f"n{i}" for i in range(MAX_NAMES_PER_TYPE)]
    ok = s.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=names), 0)
    assert not [e for e in ok if isinstance(e, Refused)]
    more = s.receive(
        discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=["one-more"]), 0
    )
    [refused] = [e for e in more if isinstance(e, Refused)]
    assert refused.code == "RESOURCE_EXHAUSTED" and str(MAX_NAMES_PER_TYPE) in refused.message
    assert not sends(more)  # nothing more is sent to it


@pytest.mark.parametrize("delta", [True, False])
def test_names_that_do_not_exist_are_bounded_per_stream(delta: bool) -> None:
    """A client inventing names costs every response their work: past the bound (or as
    many as the fleet has) the stream is refused, naming the count and the bound."""
    s = XdsStream(snap(ONE), delta=delta)
    invented = [f"nope-{i}" for i in range(limits.XDS_MAX_UNKNOWN_NAMES)]

    def ask(names: list[str]) -> list[Event]:
        if delta:
            return s.receive(
                discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=names), 0
            )
        return s.receive(req(ENDPOINT, ["a@v1", *invented, *names]), 0)

    first = ask(invented if delta else [])
    assert not [e for e in first if isinstance(e, Refused)]  # at the bound: served
    [refused] = [e for e in ask(["nope-more"]) if isinstance(e, Refused)]
    assert refused.code == "RESOURCE_EXHAUSTED"
    assert (
        f"{limits.XDS_MAX_UNKNOWN_NAMES + 1} names" in refused.message and "do not exist" in refused.message
    )


def test_a_fleet_larger_than_the_floor_allows_as_many_unknown_names_as_it_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits, "XDS_MAX_UNKNOWN_NAMES", 1)
    s = XdsStream(snap(TWO), delta=True)  # two clusters: two unknown names allowed
    ok = s.receive(
        discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=["x", "y"]), 0
    )
    assert not [e for e in ok if isinstance(e, Refused)]
    more = s.receive(
        discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT, resource_names_subscribe=["z"]), 0
    )
    assert [e.code for e in more if isinstance(e, Refused)] == ["RESOURCE_EXHAUSTED"]


def test_lingering_clusters_are_not_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy still subscribed to clusters that just left the fleet is not refused."""
    monkeypatch.setattr(limits, "XDS_MAX_UNKNOWN_NAMES", 0)
    before = snap(TWO)
    after = snap(ONE, gen=2, previous=before)
    assert "b@v1" in after.lingering
    s = XdsStream(after, delta=False)
    events = s.receive(req(ENDPOINT, ["a@v1", "b@v1"]), 0)
    assert not [e for e in events if isinstance(e, Refused)] and sends(events)


def test_a_resource_name_longer_than_the_bound_is_refused() -> None:
    s = XdsStream(snap(ONE), delta=False)
    long_name = "x" * (limits.XDS_MAX_NAME_CHARS + 1)
    [refused] = [e for e in s.receive(req(ENDPOINT, [long_name]), 0) if isinstance(e, Refused)]
    assert refused.code == "INVALID_ARGUMENT" and str(limits.XDS_MAX_NAME_CHARS) in refused.message
    assert long_name not in refused.message


def test_unknown_types_are_reported_a_bounded_number_of_times() -> None:
    s = XdsStream(snap(ONE), delta=False)
    reported = [e for i in range(50) for e in s.receive(req(f"type.googleapis.com/x.Unknown{i}"), 0)]
    assert len(reported) == MAX_UNKNOWN_TYPES_REPORTED
    assert all(isinstance(e, UnknownType) for e in reported)


def test_a_huge_nack_message_is_kept_and_shown_cut_but_still_blames() -> None:
    """Issue 16, F4(d): a 3.5 MB NACK message grew /debug/proxies past what clients read."""
    from controlplane import limits

    s = XdsStream(snap(ONE), delta=False)
    [first] = sends(s.receive(req(CLUSTER), 0))
    s.receive(req(CLUSTER, nonce=first.nonce), 0)
    [bad] = sends(s.set_snapshot(snap(TWO, gen=2), 1))
    huge = "x" * 3_500_000 + " b@v1"
    ev = s.receive(req(CLUSTER, nonce=bad.nonce, error=huge), 2)
    [nack] = [e for e in ev if isinstance(e, Nack)]
    assert len(s.types[CLUSTER].last_error) < limits.XDS_MAX_NACK_MESSAGE_CHARS + 100
    assert s.types[CLUSTER].last_error.endswith(
        f"({len(huge) - limits.XDS_MAX_NACK_MESSAGE_CHARS} more characters)"
    )
    assert len(nack.message) < limits.XDS_MAX_NACK_MESSAGE_CHARS + 100
    assert nack.rejected == ("b@v1",)


def test_a_huge_node_id_ends_the_stream() -> None:
    from controlplane import limits

    s = XdsStream(snap(ONE), delta=False)
    r = req(CLUSTER)
    r.node.id = "n" * (limits.XDS_MAX_NODE_ID_CHARS + 1)
    [refused] = s.receive(r, 0)
    assert isinstance(refused, Refused) and refused.code == "INVALID_ARGUMENT"
    assert s.node_id == "" and not s.types


def test_the_shared_names_cache_stays_bounded_whatever_clients_invent() -> None:
    """Issue 16, F4(a): subscriptions to many invented names stayed in the shared cache after
    their client left (850 MB)."""
    from controlplane import limits
    from controlplane.xds import protocol

    for i in range(40):
        protocol.shared_names(f"invented-{i}-{j}" for j in range(20_000))
    assert protocol._SHARED_TOTAL[0] <= limits.XDS_SHARED_NAMES_MAX
    assert sum(len(k) for k in protocol._SHARED_NAMES) == protocol._SHARED_TOTAL[0]
    big = protocol.shared_names(f"huge-{j}" for j in range(limits.XDS_SHARED_NAMES_MAX // 4 + 1))
    assert big not in protocol._SHARED_NAMES  # held by its own stream only
    common = protocol.shared_names(["a@v1", "b@v1"])
    assert protocol.shared_names(["b@v1", "a@v1"]) is common  # sharing still works
