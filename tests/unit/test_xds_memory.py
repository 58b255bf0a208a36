from __future__ import annotations

import struct

import pytest

from controlplane.fleet import parse_fleet
from controlplane.routing.translate import CLUSTER, ENDPOINT, ROUTE, translate
from controlplane.xds.memory import MAGIC, MAGIC_V1, ClusterMemory, dump, load
from controlplane.xds.snapshot import Lingering, Placeholder, Snapshot, build_snapshot
from tests.fleets import fleet_yaml

V1 = {"a": {"v1": ["127.0.0.1:81", "127.0.0.1:82"]}, "b": {"v1": ["127.0.0.1:83"]}}
V2 = {"a": {"v2": ["127.0.0.1:84"]}, "b": {"v1": ["127.0.0.1:83"]}}


def snap(models: dict[str, dict[str, list[str]]], gen: int = 1, previous: Snapshot | None = None) -> Snapshot:
    return build_snapshot(translate(parse_fleet(fleet_yaml(models))), gen, float(gen), previous=previous)


def test_a_shared_dict_is_recorded_once_and_only_news_count_as_changes() -> None:
    s = snap(V1)
    m = ClusterMemory()
    m.record(s.resources[CLUSTER])
    assert m.changes == 2 and {c.name for c in m.clusters()} == {"a@v1", "b@v1"}
    m.record(s.resources[CLUSTER])  # a thousand proxies ACKing the same snapshot
    m.record(dict(s.resources[CLUSTER]))  # the same content in another dict
    assert m.changes == 2
    m.record({"x@v1": Placeholder.of(CLUSTER, "x@v1", "v")})  # content we never had: not kept
    assert m.get("x@v1") is None
    m.record_routes(s.resources[ROUTE].values())
    inference = s.resources[ROUTE]["inference"]
    assert m.route("inference", inference.version) is inference
    assert m.route("grpc/a", inference.version) is None  # the version belongs to another name


def test_the_oldest_entries_leave_first() -> None:
    s = snap(V1)
    m = ClusterMemory(limit=1, routes=1)
    m.record(s.resources[CLUSTER])
    assert [c.name for c in m.clusters()] == ["b@v1"]
    m.record_routes(s.resources[ROUTE].values())
    assert len(m.routes()) == 1


def test_dump_and_load_keep_clusters_routes_and_each_clusters_last_assignment() -> None:
    first = snap(V1)
    m = ClusterMemory()
    m.record(first.resources[CLUSTER])
    m.record_routes([first.resources[ROUTE]["inference"]])
    second = snap(V2, 2, first)  # a@v1 left the fleet: it lingers with its last assignment
    assert "a@v1" in second.lingering
    data = dump(m, second)
    again = ClusterMemory()
    found = load(again, data)
    assert (found.clusters, found.routes) == (3, 1)  # a@v2 too: in the snapshot, not yet ACKed
    assert again.get("a@v1") is not None
    assert again.get("a@v1").version == m.get("a@v1").version  # type: ignore[union-attr]
    assert found.assignments["a@v1"].version == first.resources[ENDPOINT]["a@v1"].version
    assert found.assignments["b@v1"].version == second.resources[ENDPOINT]["b@v1"].version
    route = first.resources[ROUTE]["inference"]
    assert again.route("inference", route.version) is not None


def test_what_no_proxy_acked_yet_is_written_too_lingering_included() -> None:
    """A proxy may ACK a cluster and be killed with us before the next write: the file names
    every cluster of the snapshot, and those lingering after it, ACKed or not."""
    first = snap(V1)
    m = ClusterMemory()  # nothing ACKed
    found = load(ClusterMemory(), dump(m, first))
    assert found.clusters == 2 and set(found.assignments) == {"a@v1", "b@v1"}
    second = snap(V2, 2, first)  # a@v1 leaves before any proxy ACKed it
    again = ClusterMemory()
    found = load(again, dump(m, second))
    assert found.clusters == 3 and again.clusters() == []  # none is taken for one a proxy ACKed
    assert {c.name for c in again.sent()} == {"a@v1", "a@v2", "b@v1"}
    assert again.content("a@v1").version == first.resources[CLUSTER]["a@v1"].version  # type: ignore[union-attr]
    assert found.assignments["a@v1"].version == first.resources[ENDPOINT]["a@v1"].version
    # An ACKed definition wins over the snapshot's (which a proxy may have refused).
    older = build_snapshot(
        translate(
            parse_fleet(fleet_yaml(V1, extra_model_keys={"b": "cluster_overrides: {connect_timeout: 2s}"}))
        ),
        1,
        1.0,
    ).resources[CLUSTER]["b@v1"]
    assert older.version != second.resources[CLUSTER]["b@v1"].version
    m.record({"b@v1": older})
    kept = ClusterMemory()
    load(kept, dump(m, second))
    assert kept.get("b@v1").version == older.version  # type: ignore[union-attr]
    assert kept.content("b@v1").version == older.version  # type: ignore[union-attr]
    # What was restored unACKed is written again, until a proxy ACKs it.
    again_twice = ClusterMemory()
    load(again_twice, dump(again, None))
    assert {c.name for c in again_twice.sent()} == {"a@v1", "a@v2", "b@v1"}


def test_a_version_1_file_still_loads() -> None:
    first = snap(V1)
    m = ClusterMemory()
    m.record(first.resources[CLUSTER])
    data = dump(m, first)
    # Version 1 had three sections: drop the fourth and take the old header.
    body = data[len(MAGIC) :]
    parts = []
    for _ in range(3):
        (n,) = struct.unpack(">I", body[:4])
        parts.append(body[: 4 + n])
        body = body[4 + n :]
    found = load(ClusterMemory(), MAGIC_V1 + b"".join(parts))
    assert found.clusters == 2 and set(found.assignments) == {"a@v1", "b@v1"}


def test_a_restarted_servers_first_snapshot_lingers_what_it_remembers() -> None:
    first = snap(V1)
    m = ClusterMemory()
    m.record(first.resources[CLUSTER])
    found = load(ClusterMemory(), dump(m, first))
    seed = {n: Lingering(a, 0.0) for n, a in found.assignments.items()}
    restarted = build_snapshot(translate(parse_fleet(fleet_yaml(V2))), 1, 1.0, lingering_seed=seed)
    assert set(restarted.lingering) == {"a@v1"}  # b@v1 is in the fleet: not lingering
    assert restarted.get(ENDPOINT, "a@v1") is seed["a@v1"].assignment


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "unknown header"),
        (b"something else entirely", "unknown header"),
        (b"controlplane-xds-memory 1\n\x00\x00", "truncated"),
        (b"controlplane-xds-memory 1\n\x00\x00\x00\x09abc", "truncated"),
        (b"controlplane-xds-memory 1\n\x00\x00\x00\x03\xff\xff\xff", "unreadable"),
    ],
)
def test_a_damaged_file_is_refused_with_the_reason(data: bytes, why: str) -> None:
    m = ClusterMemory()
    with pytest.raises(ValueError, match=why):
        load(m, data)
    assert m.clusters() == []
