"""Load reports count only from proxies we serve (issue 16, F6): anyone who can reach the
port can open an LRS stream, but a report from a node holding no xDS stream is not used
(counted in controlplane_lrs_reports_refused_total), while the same report from a node
that holds one is (its absurd counts cut, as the clamp counter shows). Real grpcio clients
against `controlplane serve`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc

from controlplane.routing.translate import CLUSTER
from tests.integration.harness import ControlPlane, Emulator, free_port, wait_until


def _report(node: str, address: str) -> lrs_pb2.LoadStatsRequest:
    host, port = address.rsplit(":", 1)
    r = lrs_pb2.LoadStatsRequest()
    r.node.id = node
    cs = r.cluster_stats.add(cluster_name="llama@v1")
    es = cs.upstream_locality_stats.add().upstream_endpoint_stats.add()
    es.address.socket_address.address = host
    es.address.socket_address.port_value = int(port)
    es.total_issued_requests = 50
    es.total_error_requests = 2**64 - 1  # the lie that set an error rate of 1.0
    return r


def _send_reports(channel: grpc.Channel, node: str, address: str) -> None:
    """One LRS stream: the first request, then a report once the server answered."""
    answered = threading.Event()

    def requests() -> Iterator[lrs_pb2.LoadStatsRequest]:
        first = lrs_pb2.LoadStatsRequest()
        first.node.id = node
        yield first
        answered.wait(5)
        yield _report(node, address)
        answered.wait(0.5)  # keep the stream while the report is read

    stub = lrs_pb2_grpc.LoadReportingServiceStub(channel)
    for _ in stub.StreamLoadStats(requests(), timeout=10):
        answered.set()


def test_load_reports_count_only_from_nodes_holding_an_xds_stream(tmp_path: Path) -> None:
    server = Emulator("s1", tmp_path, "llama", slots=16, decode_ms_per_token=2)
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"listener: {{port: {free_port()}}}\ntiers: {{small: {{}}}}\n"
        "models: {llama: {params_b: 8, stable: v1,\n"
        f"  versions: {{v1: {{endpoints: ['{server.address}']}}}}}}}}\n"
    )
    cp = ControlPlane(config, tmp_path).start()
    try:
        with grpc.insecure_channel(cp.xds) as channel:
            _send_reports(channel, "rogue", server.address)
            wait_until(
                lambda: cp.metric("controlplane_lrs_reports_refused_total", reason="no_xds_stream") >= 1,
                5,
                "the rogue report to be refused",
            )
            assert cp.metric("controlplane_lrs_reports_clamped_total") == 0  # never read

            # A proxy we serve (an xDS stream held open) reports: its report is used.
            release = threading.Event()

            def ads_requests() -> Iterator[discovery_pb2.DiscoveryRequest]:
                first = discovery_pb2.DiscoveryRequest(type_url=CLUSTER)
                first.node.id = "gw-1"
                yield first
                release.wait(20)

            ads = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(
                ads_requests(), timeout=30
            )
            assert next(ads).type_url == CLUSTER
            try:
                _send_reports(channel, "gw-1", server.address)
                wait_until(
                    lambda: cp.metric("controlplane_lrs_reports_clamped_total") >= 1,
                    5,
                    "the report to be used",
                )
                assert cp.metric("controlplane_lrs_reports_refused_total", reason="no_xds_stream") == 1
            finally:
                release.set()
                ads.cancel()
    finally:
        cp.stop()
        server.stop()
