"""The listen and TLS flags both side services take (`controlplane picker`, `controlplane
ratelimit`), and the one check of them: where a service may listen without client
certificates (docs/picker.md#trust, docs/quotas.md#trust)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.net.tls import ServerTls


@dataclass(frozen=True)
class SideService:
    """What differs between the side services in these flags' help and errors."""

    default_listen: str
    callers: str  # who reaches --listen, e.g. "Envoy reaches this picker over gRPC, and its peers read it"
    tls_field: str  # the fleet's key that tells proxies to verify it, e.g. "picker.tls"
    mutual_callers: str  # who must present a certificate, e.g. "each proxy, each peer"
    mutual_extra: str  # more on --tls-client-ca, or ""
    harm: str  # what an unauthenticated caller can do, in the error: e.g. "steer picks"
    harm_help: str  # the same in --allow-unauthenticated-clients's help, at more length
    trusted: str  # who alone may reach it when unauthenticated, e.g. "proxies and pickers"
    docs: str  # e.g. "docs/picker.md#trust"


def add_listen_flags(p: argparse.ArgumentParser, s: SideService) -> None:
    """--listen, --tls-cert, --tls-key, --tls-client-ca and --allow-unauthenticated-clients."""
    p.add_argument(
        "--listen",
        default=s.default_listen,
        metavar="HOST:PORT",
        help=f"where {s.callers} (default: %(default)s, loopback only). Beyond loopback it needs "
        "--tls-client-ca, or --allow-unauthenticated-clients",
    )
    p.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help=f"serve --listen over TLS with this certificate (PEM), with --tls-key; the fleet's "
        f"{s.tls_field} tells proxies to verify it ({s.docs})",
    )
    p.add_argument("--tls-key", type=Path, metavar="FILE", help="the private key of --tls-cert (PEM)")
    p.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help=f"mutual TLS: every caller ({s.mutual_callers}) must present a certificate this CA "
        f"signed{s.mutual_extra}",
    )
    p.add_argument(
        "--allow-unauthenticated-clients",
        action="store_true",
        help=f"listen beyond loopback without --tls-client-ca: anyone who reaches --listen can then "
        f"{s.harm_help}; only for a network that only {s.trusted} reach",
    )


def check_listen(args: argparse.Namespace, s: SideService) -> ServerTls | None:
    """The addresses (--listen, --metrics-listen), the TLS files, and that a listen address
    beyond loopback has mutual TLS or the explicit opt-out. The TLS to serve with (None:
    plaintext); ValueError with the one line to print."""
    from controlplane.net.tls import SIDE_FLAGS, ServerTls, TlsConfigInvalid, is_loopback, server_credentials
    from controlplane.obs.http import split_host_port

    for flag, value in (("--listen", args.listen), ("--metrics-listen", args.metrics_listen)):
        if value is not None:
            try:
                split_host_port(value)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
    tls = None
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together (--tls-client-ca needs both)")
        tls = ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)
        try:
            server_credentials(tls, SIDE_FLAGS)
        except TlsConfigInvalid as e:
            raise ValueError(str(e)) from None
    mutual = tls is not None and tls.client_ca is not None
    host = args.listen.rpartition(":")[0].strip("[]")
    if not mutual and not is_loopback(host) and not args.allow_unauthenticated_clients:
        raise ValueError(
            f"--listen {args.listen} is reachable from other machines, and without --tls-client-ca "
            f"anyone who reaches it can {s.harm}: give --tls-cert, --tls-key and --tls-client-ca "
            f"(mutual TLS), or --allow-unauthenticated-clients if only {s.trusted} reach "
            f"that network ({s.docs})"
        )
    return tls
