"""Real gRPC peers: proxyless grpcio xDS clients, health, reflection, per-type services."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.cluster.v3 import cds_pb2_grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from controlplane.routing.translate import CLUSTER
from controlplane.v1 import endpoint_pb2
from controlplane.xds.bootstrap import grpc_bootstrap
from tests.fleets import fleet_yaml
from tests.integration.harness import ControlPlane, Operator, wait_until


class GrpcBackend:
    """A real gRPC server whose health service knows one extra service: its own name."""

    def __init__(self, name: str) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        svc = self.health = health.HealthServicer()
        svc.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(svc, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def backends() -> Iterator[dict[str, GrpcBackend]]:
    b = {name: GrpcBackend(name) for name in ("g1", "g2")}
    try:
        yield b
    finally:
        for s in b.values():
            s.server.stop(0)


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def test_proxyless_grpc_client_follows_the_fleet(tmp_path: Path, backends: dict[str, GrpcBackend]) -> None:
    models = {"triton": {"v1": [backends["g1"].address], "v2": [backends["g2"].address]}}
    config = tmp_path / "fleet.yaml"
    write(config, fleet_yaml(models, extra_model_keys={"triton": "protocol: http2"}))
    cp = ControlPlane(config, tmp_path).start()
    boot = tmp_path / "grpc-bootstrap.json"
    boot.write_text(grpc_bootstrap("grpc-client-1", cp.xds))
    client = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("grpc_xds_client.py")), "xds:///triton", "g1", "g2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "GRPC_XDS_BOOTSTRAP": str(boot)},
    )
    try:
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "reached g1"
        assert [p["node_id"] for p in cp.proxies()] == ["grpc-client-1"]

        def statuses() -> dict[str, str]:
            return {t: v["status"] for t, v in cp.proxies()[0]["types"].items()}

        # The client ACKs every type. Its ACK travels on the ADS stream while its first RPC
        # goes out, so the control plane may still read a push as STALE when the RPC is
        # answered (a CI run under load saw 'endpoint': 'STALE'): wait for the ACK.
        synced = dict.fromkeys(("cluster", "endpoint", "listener", "route"), "SYNCED")
        wait_until(lambda: statuses() == synced, 10, "the client to ACK every type")
        # Moving stable to v2 moves the proxyless client too.
        write(
            config,
            fleet_yaml(models, stable={"triton": "v2"}, extra_model_keys={"triton": "protocol: http2"}),
        )
        client.stdin.write("go\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "reached g2"
        assert client.wait(10) == 0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        cp.stop()


def test_a_grpc_only_server_is_probed_over_grpc_health_and_reached(tmp_path: Path) -> None:
    """No HTTP at all on the server: the control plane asks grpc.health.v1 (the default for
    `protocol: http2`), sees it ready, and a proxyless client dialling xds:/// reaches it.
    NOT_SERVING then holds it out: the gRPC answer is what decides."""
    g = GrpcBackend("g1")
    config = tmp_path / "fleet.yaml"
    write(
        config,
        fleet_yaml({"embed": {"v1": [g.address]}}, extra_model_keys={"embed": "protocol: http2"})
        + "signals: {interval: 300ms, timeout: 200ms}\n",
    )
    cp = ControlPlane(config, tmp_path).start()
    op = Operator(cp)
    boot = tmp_path / "grpc-bootstrap.json"
    boot.write_text(grpc_bootstrap("grpc-client-1", cp.xds))

    def endpoint() -> endpoint_pb2.Endpoint:
        r = op.endpoints.List(endpoint_pb2.ListEndpointsRequest(model="embed"), metadata=op.md, timeout=5)
        return r.endpoints[0]

    try:
        time.sleep(1.5)  # five probe intervals: an HTTP probe would have lost sight of it by now
        wait_until(lambda: cp.metric("controlplane_signals_scrapes_total", outcome="ok") >= 3, 10, "probes")
        e = endpoint()
        assert (e.sight, e.state, e.note) == ("SEEN", "SERVING", ""), e
        assert cp.metric("controlplane_signals_scrapes_total", outcome="unreachable") == 0
        out = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("grpc_xds_client.py")), "xds:///embed", "g1"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "GRPC_XDS_BOOTSTRAP": str(boot)},
        )
        assert out.stdout.strip() == "reached g1", out.stdout + out.stderr
        g.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        wait_until(lambda: endpoint().state == "HELD_OUT", 5, "held out on NOT_SERVING")
        assert endpoint().sight == "SEEN" and "not ready" in endpoint().note
    finally:
        op.close()
        cp.stop()
        g.server.stop(0)


def test_unavailable_until_a_valid_config_then_serving(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    write(config, "listener: {port: 10000}\ntiers: {}\nmodels: {}\n")  # invalid: no tier
    cp = ControlPlane(config, tmp_path).start()
    try:
        channel = grpc.insecure_channel(cp.xds)
        health_stub = health_pb2_grpc.HealthStub(channel)
        status = health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        ads = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(
                ads.StreamAggregatedResources(
                    iter([discovery_pb2.DiscoveryRequest(type_url=CLUSTER)]), timeout=5
                )
            )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no complete configuration yet" in (e.value.details() or "")
        assert "tiers: missing" in cp.proc.log()  # type: ignore[union-attr]

        write(config, fleet_yaml({"m": {"v1": ["127.0.0.1:9"]}}))
        wait_until(
            lambda: (
                health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            ),
            3,
            "health to turn SERVING",
        )
        # The per-type CDS service answers too.
        cds = cds_pb2_grpc.ClusterDiscoveryServiceStub(channel)
        call = cds.StreamClusters(iter([discovery_pb2.DiscoveryRequest(type_url=CLUSTER)]), timeout=5)
        first = next(iter(call))
        call.cancel()
        # Every cluster, the holding service's included (a wildcard subscription gets it).
        names = [cluster_pb2.Cluster.FromString(a.value).name for a in first.resources]
        assert names == ["controlplane-hold", "m@v1"]
    finally:
        cp.stop()


def test_reflection_lists_the_services(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    write(config, fleet_yaml({"m": {"v1": ["127.0.0.1:9"]}}))
    cp = ControlPlane(config, tmp_path).start()
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(cp.xds))
        [resp] = list(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        )
        names = {s.name for s in resp.list_services_response.service}
        assert {
            "envoy.service.discovery.v3.AggregatedDiscoveryService",
            "envoy.service.cluster.v3.ClusterDiscoveryService",
            "grpc.health.v1.Health",
        } <= names
    finally:
        cp.stop()
