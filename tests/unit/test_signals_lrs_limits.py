"""A rogue load report cannot set an endpoint's error rate or in-flight count at will (issue 16,
F6): counts over a million a second are cut to that, and counted."""

from __future__ import annotations

import time

from envoy.service.load_stats.v3 import lrs_pb2
from prometheus_client import CollectorRegistry, Counter

from controlplane import limits
from controlplane.signals.lrs import LoadReportingServer
from controlplane.signals.store import SignalStore


def report(failed: int, in_progress: int) -> lrs_pb2.LoadStatsRequest:
    r = lrs_pb2.LoadStatsRequest()
    cs = r.cluster_stats.add(cluster_name="llama@v1")
    es = cs.upstream_locality_stats.add().upstream_endpoint_stats.add()
    es.address.socket_address.address = "127.0.0.1"
    es.address.socket_address.port_value = 8000
    es.total_successful_requests = 50
    es.total_error_requests = failed
    es.total_requests_in_progress = in_progress
    es.total_issued_requests = 50
    return r


def test_absurd_counts_are_cut_and_counted() -> None:
    store = SignalStore()
    counter = Counter("clamped", "", registry=CollectorRegistry())
    server = LoadReportingServer(store, clamped_counter=counter)
    server._record("n1", report(failed=2**64 - 1, in_progress=2**63))
    in_flight, _, ok, failed = store.lrs_totals(("llama", "127.0.0.1:8000"), now=time.monotonic())
    assert (in_flight, ok, failed) == (limits.LRS_MAX_COUNT, 50, limits.LRS_MAX_COUNT)
    assert server.clamped == 1 and counter._value.get() == 1
    server._record("n1", report(failed=3, in_progress=2))
    assert server.clamped == 1  # honest reports pass untouched


def test_a_grpc_clients_locality_report_counts_for_the_endpoint_it_names() -> None:
    """gRPC reports per locality, never per endpoint; each locality of ours is one endpoint,
    named by its sub_zone, so a proxyless client's traffic counts like an Envoy's."""
    store = SignalStore()
    server = LoadReportingServer(store)
    r = lrs_pb2.LoadStatsRequest()
    cs = r.cluster_stats.add(cluster_name="llama@v1")
    loc = cs.upstream_locality_stats.add()
    loc.locality.sub_zone = "127.0.0.1:8000"
    loc.total_successful_requests, loc.total_error_requests, loc.total_requests_in_progress = 40, 2, 3
    six = cs.upstream_locality_stats.add()
    six.locality.sub_zone = "[::1]:8001"
    six.total_successful_requests = 7
    cs.upstream_locality_stats.add().locality.zone = "z1"  # no endpoint named: nothing counted
    server._record("grpc-1", r)
    now = time.monotonic()
    assert store.lrs_totals(("llama", "127.0.0.1:8000"), now=now) == (3, 0, 40, 2)
    assert store.lrs_totals(("llama", "[::1]:8001"), now=now)[2] == 7
