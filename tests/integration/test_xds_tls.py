"""TLS and mutual TLS on the xDS port (issue 16, F4): a real Envoy with the bootstrap from
`controlplane bootstrap --xds-tls-*` gets its config over mTLS and serves traffic; a gRPC
client without a certificate, and one speaking plaintext, are refused. Certificates come
from the `openssl` command, made fresh for each run."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from controlplane.routing.translate import CLUSTER
from tests.integration.harness import BIN, ControlPlane, Emulator, Envoy, Traffic, free_port, wait_until

pytestmark = pytest.mark.envoy


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1, and a client certificate (Envoy's)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path / "certs"
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (d / "client.ext").write_text("subjectAltName=DNS:envoy-tls\nextendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)  # fmt: skip
    return d


@pytest.fixture
def served(tmp_path: Path, certs: Path) -> Iterator[tuple[ControlPlane, Emulator, int]]:
    server = Emulator("s1", tmp_path, "llama", slots=16, decode_ms_per_token=2)
    listener = free_port()
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"listener: {{port: {listener}}}\ntiers: {{small: {{}}}}\n"
        "models: {llama: {params_b: 8, stable: v1,\n"
        f"  versions: {{v1: {{endpoints: ['{server.address}']}}}}}}}}\n"
    )
    cp = ControlPlane(
        config,
        tmp_path,
        extra_args=["--xds-tls-cert", str(certs / "server.pem"), "--xds-tls-key", str(certs / "server.key"),
                    "--xds-client-ca", str(certs / "ca.pem")],
    ).start()  # fmt: skip
    try:
        yield cp, server, listener
    finally:
        cp.stop()
        server.stop()


def test_envoy_over_mutual_tls_gets_its_config_and_serves(
    tmp_path: Path, certs: Path, served: tuple[ControlPlane, Emulator, int]
) -> None:
    cp, _, listener = served
    envoy = Envoy(
        "envoy-tls",
        cp.xds,
        tmp_path,
        listener,
        bootstrap_args=["--xds-tls-ca", str(certs / "ca.pem"), "--xds-tls-cert", str(certs / "client.pem"),
                        "--xds-tls-key", str(certs / "client.key")],
    ).start()  # fmt: skip
    try:
        traffic = Traffic(listener, "llama", tmp_path, rate=20)
        wait_until(lambda: len(traffic.records()) > 20, 15, "traffic through Envoy")
        records = traffic.stop()
        assert [r for r in records if r["status"] != 200] == []
        wait_until(lambda: any(p["node_id"] == "envoy-tls" for p in cp.proxies()), 5, "the proxy in status")
        # Its load reports came over the same mutual-TLS connection.
        wait_until(lambda: cp.metric("controlplane_lrs_streams") == 1, 10, "an LRS stream")
    finally:
        envoy.stop()


@pytest.mark.parametrize("how", ["no client certificate", "plaintext"])
def test_a_client_without_a_certificate_is_refused(
    certs: Path, served: tuple[ControlPlane, Emulator, int], how: str
) -> None:
    cp, _, _ = served
    if how == "plaintext":
        channel = grpc.insecure_channel(cp.xds)
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
        channel = grpc.secure_channel(cp.xds, creds)
    with channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        request = discovery_pb2.DiscoveryRequest(type_url=CLUSTER)
        request.node.id = "intruder"
        with pytest.raises(grpc.RpcError) as e:
            next(iter(stub.StreamAggregatedResources(iter([request]), timeout=5)))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert all(p["node_id"] != "intruder" for p in cp.proxies())


def test_bad_tls_flags_are_refused_before_anything_starts(tmp_path: Path, certs: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("listener: {port: 10000}\ntiers: {small: {}}\n")
    cp = str(BIN / "controlplane")
    out = subprocess.run([cp, "serve", "--config", str(config), "--xds-tls-cert", str(certs / "server.pem")],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 2 and "--xds-tls-cert and --xds-tls-key go together" in out.stderr
    tls = ["--xds-tls-cert", str(certs / "server.pem"), "--xds-tls-key", str(certs / "server.csr")]
    out = subprocess.run(
        [cp, "serve", "--config", str(config), *tls], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "--xds-tls-key" in out.stderr and "no PRIVATE KEY block" in out.stderr


def test_with_mutual_tls_a_node_id_must_be_the_certificates_identity(
    certs: Path, served: tuple[ControlPlane, Emulator, int]
) -> None:
    """A proxy holding a valid certificate still cannot speak as another node: the node id
    must be its certificate's CN or a subjectAltName (here DNS:envoy-tls), for xDS and LRS."""
    from envoy.service.load_stats.v3 import lrs_pb2, lrs_pb2_grpc

    cp, _, _ = served
    creds = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(certs / "client.key").read_bytes(),
        certificate_chain=(certs / "client.pem").read_bytes(),
    )
    with grpc.secure_channel(cp.xds, creds) as channel:
        ads = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        impostor = discovery_pb2.DiscoveryRequest(type_url=CLUSTER)
        impostor.node.id = "gateway-7"
        with pytest.raises(grpc.RpcError) as e:
            next(iter(ads.StreamAggregatedResources(iter([impostor]), timeout=5)))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'gateway-7' is not an identity of the client certificate" in (e.value.details() or "")
        report = lrs_pb2.LoadStatsRequest()
        report.node.id = "gateway-7"
        with pytest.raises(grpc.RpcError) as e:
            next(
                iter(
                    lrs_pb2_grpc.LoadReportingServiceStub(channel).StreamLoadStats(iter([report]), timeout=5)
                )
            )
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        honest = discovery_pb2.DiscoveryRequest(type_url=CLUSTER)
        honest.node.id = "envoy-tls"
        reply = next(iter(ads.StreamAggregatedResources(iter([honest]), timeout=5)))
        assert reply.type_url == CLUSTER and reply.resources
