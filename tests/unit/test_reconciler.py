from __future__ import annotations

import asyncio

from controlplane.fleet import parse_fleet
from controlplane.obs.metrics import Metrics
from controlplane.xds.cache import SnapshotCache
from controlplane.xds.reconciler import Reconciler
from controlplane.xds.snapshot import Snapshot
from tests.fleets import fleet_yaml

MODELS = {f"m{i}": {"v1": [f"127.10.{i}.1:80", f"127.10.{i}.2:80"]} for i in range(20)}


def make(debounce: float = 0.05, max_delay: float = 1.0) -> tuple[Reconciler, list[Snapshot]]:
    r = Reconciler(SnapshotCache(), Metrics(), debounce_s=debounce, max_delay_s=max_delay)
    published: list[Snapshot] = []
    r.on_publish.append(published.append)
    r.set_fleet(parse_fleet(fleet_yaml(MODELS)))
    r.rebuild_now()
    published.clear()
    return r, published


def test_a_burst_of_100_weight_changes_in_100ms_gives_one_snapshot() -> None:
    async def scenario() -> list[Snapshot]:
        r, published = make(debounce=0.1)
        task = asyncio.create_task(r.run())
        for i in range(100):
            r.set_weights(f"m{i % 20}@v1", {f"127.10.{i % 20}.1:80": i + 2})
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.4)
        task.cancel()
        return published

    published = asyncio.run(scenario())
    assert len(published) == 1
    assert (
        len(published[0].changes["type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"]) == 20
    )


def test_a_steady_stream_of_changes_still_publishes_by_the_max_delay() -> None:
    async def scenario() -> list[Snapshot]:
        r, published = make(debounce=0.1, max_delay=0.3)
        task = asyncio.create_task(r.run())
        for i in range(40):  # a change every 25 ms for 1 s: never 100 ms of quiet
            r.set_weights("m1@v1", {"127.10.1.1:80": i + 2})
            await asyncio.sleep(0.025)
        await asyncio.sleep(0.3)
        task.cancel()
        return published

    published = asyncio.run(scenario())
    assert 3 <= len(published) <= 6


def test_no_snapshot_when_nothing_changed() -> None:
    r, published = make()
    r.set_weights("m1@v1", {})
    assert r.rebuild_now() is r.cache.current
    assert published == []


def test_serialisation_happens_once_per_version_whatever_the_number_of_streams() -> None:
    from envoy.service.discovery.v3 import discovery_pb2

    from controlplane.routing.translate import ENDPOINT
    from controlplane.xds.events import Send
    from controlplane.xds.protocol import XdsStream
    from controlplane.xds.snapshot import SERIALISED

    r, _ = make()
    first = r.cache.current
    assert first is not None
    names = sorted(first.resources[ENDPOINT])
    streams = [XdsStream(first, delta=False) for _ in range(50)]
    for s in streams:
        [out] = [
            e
            for e in s.receive(discovery_pb2.DiscoveryRequest(type_url=ENDPOINT, resource_names=names), 0)
            if isinstance(e, Send)
        ]
        s.receive(
            discovery_pb2.DiscoveryRequest(type_url=ENDPOINT, resource_names=names, response_nonce=out.nonce),
            0,
        )
    before = SERIALISED.value
    metric = "controlplane_snapshot_resources_serialised_total"
    counted = r.metrics.registry.get_sample_value(metric) or 0.0
    r.set_weights("m3@v1", {"127.10.3.1:80": 7})
    second = r.rebuild_now()
    assert second is not None and second is not first
    sent = [[e for e in s.set_snapshot(second, 1) if isinstance(e, Send)] for s in streams]
    assert SERIALISED.value - before == 1  # one assignment changed: one serialisation, for 50 streams
    assert (
        r.metrics.registry.get_sample_value("controlplane_snapshot_resources_serialised_total") == counted + 1
    )
    # Every stream was sent the very same encoded bytes object for it.
    field = second.resources[ENDPOINT]["m3@v1"].sotw_field
    assert all(len(out) == 1 and field in out[0].payload for out in sent)


def test_a_model_that_fails_to_build_is_counted_and_the_others_still_publish(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from controlplane.routing import incremental

    r, published = make()
    real = incremental.build_assignment

    def broken_for_m3(cname, *args, **kw):  # type: ignore[no-untyped-def]
        if cname == "m3@v1":
            raise ValueError("bad data")
        return real(cname, *args, **kw)

    monkeypatch.setattr(incremental, "build_assignment", broken_for_m3)
    r.set_weights("m3@v1", {"127.10.3.1:80": 5})
    r.set_weights("m4@v1", {"127.10.4.1:80": 5})
    snap = r.rebuild_now()
    assert snap is not None and published == [snap]
    changed = snap.changes["type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"]
    assert set(changed) == {"m4@v1"}  # m3 kept its last good assignment
    errors = r.metrics.model_build_errors.labels("m3")._value.get()
    assert errors == 1
