"""Render Envoy (and proxyless gRPC) bootstraps from the templates in the top-level envoy/."""

from __future__ import annotations

import string
from pathlib import Path

_PKG_TEMPLATES = Path(__file__).resolve().parent.parent / "_envoy_templates"
_REPO_TEMPLATES = Path(__file__).resolve().parents[2] / "envoy"


def template_dir() -> Path:
    """The templates: packaged in a wheel, or the repository's envoy/ in a checkout."""
    return _PKG_TEMPLATES if _PKG_TEMPLATES.is_dir() else _REPO_TEMPLATES


def _split(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--xds: expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def envoy_bootstrap(
    node_id: str,
    xds: list[str],
    *,
    delta: bool = False,
    admin_port: int = 9901,
    admin_address: str = "127.0.0.1",
    node_cluster: str = "inference-gateway",
    load_reports: bool = True,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> str:
    """An Envoy bootstrap YAML that connects to the control plane over ADS and, unless
    `load_reports` is off, sends it load reports (LRS) over the same connection. `tls_ca`:
    over TLS, verifying the control plane against that CA; `tls_cert`/`tls_key`: presenting
    that certificate (mutual TLS). Paths are the Envoy's. Its stats_matcher makes Envoy create
    only the stats deploy/ and the tests read (docs/deploy.md#prometheus)."""
    if not node_id:
        raise ValueError("--node-id: must not be empty")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("--xds-tls-cert and --xds-tls-key go together")
    if tls_cert is not None and tls_ca is None:
        raise ValueError("--xds-tls-cert: give --xds-tls-ca too (the CA that signed the control plane's)")
    endpoints = []
    for addr in xds:
        host, port = _split(addr)
        endpoints.append(
            "        - endpoint:\n"
            f'            address: {{socket_address: {{address: "{host}", port_value: {port}}}}}'
        )
    text = (template_dir() / "bootstrap-ads.yaml").read_text()
    return string.Template(text).substitute(
        node_id=_quote(node_id),
        node_cluster=_quote(node_cluster),
        admin_address=admin_address,
        admin_port=admin_port,
        api_type="DELTA_GRPC" if delta else "GRPC",
        xds_endpoints="\n".join(endpoints),
        load_stats=_LOAD_STATS if load_reports else "",
        transport_socket=_tls_socket(tls_ca, tls_cert, tls_key) if tls_ca else "",
    )


def _tls_socket(ca: str, cert: str | None, key: str | None) -> str:
    """The xds_cluster's TLS transport socket (ALPN h2: gRPC), with the Envoy's own
    certificate when the control plane requires one."""
    lines = [
        "    transport_socket:",
        "      name: envoy.transport_sockets.tls",
        "      typed_config:",
        '        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext',
        "        common_tls_context:",
        "          alpn_protocols: [h2]",
        f"          validation_context: {{trusted_ca: {{filename: {_quote(ca)}}}}}",
    ]
    if cert is not None and key is not None:
        lines += [
            "          tls_certificates:",
            f"          - certificate_chain: {{filename: {_quote(cert)}}}",
            f"            private_key: {{filename: {_quote(key)}}}",
        ]
    return "\n".join(lines) + "\n"


# Envoy reports per-endpoint request counts to the control plane (LRS) when asked.
_LOAD_STATS = """\
cluster_manager:
  load_stats_config:
    api_type: GRPC
    transport_api_version: V3
    grpc_services:
    - envoy_grpc: {cluster_name: xds_cluster}
"""


def grpc_bootstrap(node_id: str, xds: str, node_cluster: str = "proxyless") -> str:
    """A bootstrap JSON for proxyless gRPC clients (GRPC_XDS_BOOTSTRAP)."""
    _split(xds)
    text = (template_dir() / "grpc-bootstrap.json").read_text()
    return string.Template(text).substitute(
        node_id=node_id.replace('"', ""), node_cluster=node_cluster, xds_address=xds
    )


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
