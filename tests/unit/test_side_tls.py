"""Proxies reach the side services over TLS when the fleet says `tls:` (fleet/values.py's
_side_tls; routing/clusters.py's upstream_tls), and the side services' own TLS flags
(net/tls.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, tls_pb2

from controlplane.fleet import FleetConfigInvalid, parse_fleet
from controlplane.fleet.model import SideTls
from controlplane.net.tls import SIDE_FLAGS, ServerTls, TlsConfigInvalid, is_loopback, server_credentials
from controlplane.resources import names
from controlplane.routing.translate import CLUSTER, translate

FLEET = """
listener: {port: 10000}
picker: {endpoints: ['127.0.0.1:18090']%s}
tiers: {small: {max_params_b: 20, balancing: picker}}
models:
  m: {params_b: 1, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9001']}}}
quotas:
  default: {requests_per_minute: 10}
  service: {endpoints: ['127.0.0.1:18081']%s}
"""


def _tls_of(cluster: object) -> tls_pb2.UpstreamTlsContext | None:
    assert isinstance(cluster, cluster_pb2.Cluster)
    if not cluster.HasField("transport_socket"):
        return None
    assert cluster.transport_socket.name == "envoy.transport_sockets.tls"
    ctx = tls_pb2.UpstreamTlsContext()
    assert cluster.transport_socket.typed_config.Unpack(ctx)
    return ctx


def test_without_tls_the_side_clusters_are_plaintext() -> None:
    clusters = translate(parse_fleet(FLEET % ("", ""))).by_type[CLUSTER]
    assert _tls_of(clusters[names.PICKER_CLUSTER]) is None
    assert _tls_of(clusters[names.RATELIMIT_CLUSTER]) is None


def test_mutual_tls_to_the_pickers_and_verified_tls_to_the_rate_limit_services() -> None:
    picker = (
        ", tls: {ca: /etc/cp/ca.pem, cert: /etc/cp/envoy.pem, key: /etc/cp/envoy.key, server_name: picker}"
    )
    quota = ", tls: {ca: /etc/cp/ca.pem}"
    fleet = parse_fleet(FLEET % (picker, quota))
    assert fleet.picker.tls == SideTls("/etc/cp/ca.pem", "/etc/cp/envoy.pem", "/etc/cp/envoy.key", "picker")
    clusters = translate(fleet).by_type[CLUSTER]
    p = _tls_of(clusters[names.PICKER_CLUSTER])
    assert p is not None
    assert p.sni == "picker"
    common = p.common_tls_context
    assert list(common.alpn_protocols) == ["h2"]  # gRPC servers require HTTP/2 by ALPN
    assert common.validation_context.trusted_ca.filename == "/etc/cp/ca.pem"
    [san] = common.validation_context.match_typed_subject_alt_names
    assert san.san_type == common_pb2.SubjectAltNameMatcher.DNS and san.matcher.exact == "picker"
    [cert] = common.tls_certificates
    assert (cert.certificate_chain.filename, cert.private_key.filename) == (
        "/etc/cp/envoy.pem",
        "/etc/cp/envoy.key",
    )
    q = _tls_of(clusters[names.RATELIMIT_CLUSTER])
    assert q is not None and q.sni == "" and not q.common_tls_context.tls_certificates
    assert q.common_tls_context.validation_context.trusted_ca.filename == "/etc/cp/ca.pem"


@pytest.mark.parametrize(
    ("picker_tls", "path", "reason"),
    [
        (", tls: {cert: a.pem, key: a.key}", "picker.tls.ca", "missing: the CA file"),
        (", tls: {ca: ca.pem, cert: a.pem}", "picker.tls", "cert and key go together"),
        (", tls: {ca: ''}", "picker.tls.ca", "expected a non-empty string"),
        (", tls: {ca: 3}", "picker.tls.ca", "expected a non-empty string"),
        (
            ", tls: {ca: ca.pem, sni: x}",
            "picker.tls.sni",
            "unknown key (allowed: ca, cert, key, server_name)",
        ),
        (", tls: ca.pem", "picker.tls", "expected a mapping"),
    ],
)
def test_a_bad_tls_block_is_refused_naming_the_field(picker_tls: str, path: str, reason: str) -> None:
    with pytest.raises(FleetConfigInvalid) as e:
        parse_fleet(FLEET % (picker_tls, ""))
    found = [(x.path, x.reason) for x in e.value.errors]
    assert any(p == path and reason in m for p, m in found), found


def test_an_edit_of_the_tls_block_alone_rebuilds_the_cluster() -> None:
    from controlplane.routing.incremental import IncrementalTranslator

    t = IncrementalTranslator()
    plain = t.translate(parse_fleet(FLEET % ("", ""))).by_type[CLUSTER]
    secured = t.translate(parse_fleet(FLEET % (", tls: {ca: ca.pem}", ", tls: {ca: ca.pem}"))).by_type[
        CLUSTER
    ]
    assert _tls_of(plain[names.PICKER_CLUSTER]) is None and _tls_of(secured[names.PICKER_CLUSTER]) is not None
    assert _tls_of(secured[names.RATELIMIT_CLUSTER]) is not None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.1", False), ("example.com", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_side_flags_are_named_in_errors(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("not pem")
    with pytest.raises(TlsConfigInvalid, match=r"^--tls-cert .*not a PEM file"):
        server_credentials(ServerTls(tmp_path / "c.pem", tmp_path / "k.pem"), SIDE_FLAGS)
    with pytest.raises(TlsConfigInvalid, match=r"^--tls-cert .*cannot read"):
        server_credentials(ServerTls(tmp_path / "none.pem", tmp_path / "k.pem"), SIDE_FLAGS)
