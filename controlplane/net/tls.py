"""TLS and mutual TLS on the gRPC ports we serve (I/O shell): the xDS and LRS port, and the
side services' (the pickers' ext_proc and peer port, the rate-limit service's).

`--xds-tls-cert` and `--xds-tls-key` turn TLS on; `--xds-client-ca` also requires every
client (Envoy, a proxyless gRPC client) to present a certificate signed by that CA, so
that nobody who merely reaches the port can subscribe, report load or exhaust the server.
`controlplane bootstrap --xds-tls-ca/--xds-tls-cert/--xds-tls-key` writes the matching
Envoy configuration. docs/xds.md#tls-on-the-xds-port says how to run it on Kubernetes.
The side services take `--tls-cert`, `--tls-key` and `--tls-client-ca` the same way
(`SIDE_FLAGS`); proxies reach them over TLS when the fleet says `tls:` (routing/clusters.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigInvalid(ValueError):
    """A TLS flag whose file cannot be used; the message names the flag and the reason."""


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key; with a client CA, mutual TLS (a client certificate
    signed by it is required)."""

    cert: Path
    key: Path
    client_ca: Path | None = None  # set: mutual TLS, a client certificate is required


XdsTls = ServerTls  # the xDS port's (serve --xds-tls-*)


@dataclass(frozen=True)
class TlsFlags:
    """The command-line flags a server's TLS files came from, for the errors that name them."""

    cert: str
    key: str
    client_ca: str


XDS_FLAGS = TlsFlags("--xds-tls-cert", "--xds-tls-key", "--xds-client-ca")
SIDE_FLAGS = TlsFlags("--tls-cert", "--tls-key", "--tls-client-ca")


def _read(flag: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TlsConfigInvalid(f"{flag} {path}: cannot read ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise TlsConfigInvalid(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def server_credentials(tls: ServerTls, flags: TlsFlags = XDS_FLAGS) -> grpc.ServerCredentials:
    """The gRPC server credentials for a port; raise TlsConfigInvalid naming the flag."""
    cert = _read(flags.cert, tls.cert)
    key = _read(flags.key, tls.key)
    if b"PRIVATE KEY" not in key:
        raise TlsConfigInvalid(f"{flags.key} {tls.key}: no PRIVATE KEY block")
    ca = _read(flags.client_ca, tls.client_ca) if tls.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def client_credentials(tls: ServerTls, flags: TlsFlags = SIDE_FLAGS) -> grpc.ChannelCredentials:
    """Credentials to dial a peer that serves with the same files (the pickers read each
    other): trust the client CA (which signed every peer), present this server's certificate."""
    if tls.client_ca is None:
        raise TlsConfigInvalid(f"{flags.client_ca}: needed to verify peers")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(flags.client_ca, tls.client_ca),
        private_key=_read(flags.key, tls.key),
        certificate_chain=_read(flags.cert, tls.cert),
    )


def is_loopback(host: str) -> bool:
    """Whether a listen host is a loopback address (127.0.0.0/8, ::1, localhost): only this
    machine can reach it. A wildcard or any other address is reachable from elsewhere."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def certificate_identities(context: grpc.aio.ServicerContext) -> set[str]:
    """The names the client's certificate gives it (its subject CN and subjectAltNames), as
    the TLS handshake verified them; empty without a client certificate."""
    auth = context.auth_context() or {}
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth.get(key, ()):
            names.add(value.decode(errors="replace") if isinstance(value, bytes) else str(value))
    return names


def identity_mismatch(context: grpc.aio.ServicerContext, node_id: str) -> str | None:
    """Why a client may not speak as `node_id` (mutual TLS: the node id must be one of its
    certificate's names), or None."""
    names = certificate_identities(context)
    if node_id in names:
        return None
    shown = ", ".join(sorted(names)[:8]) or "none"
    return (
        f"node id {node_id[:200]!r} is not an identity of the client certificate ({shown}); "
        "with --xds-client-ca a proxy's node id must be its certificate's CN or a subjectAltName"
    )
