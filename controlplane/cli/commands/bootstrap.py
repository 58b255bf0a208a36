"""`controlplane bootstrap`: print an Envoy bootstrap YAML (or, with --grpc, a proxyless gRPC
client's bootstrap JSON) that connects to the control plane over ADS."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `bootstrap` and its flags to `sub`."""
    b = sub.add_parser(
        "bootstrap",
        help="print an Envoy (or proxyless gRPC) bootstrap",
        description="Print an Envoy bootstrap YAML that works as-is with `envoy -c FILE`, "
        "connecting over ADS to the control plane. With --grpc, print a GRPC_XDS_BOOTSTRAP JSON "
        "for proxyless gRPC clients instead.",
    )
    b.add_argument("--node-id", required=True, help="the proxy's node id, shown in status and logs")
    b.add_argument(
        "--xds",
        default="127.0.0.1:18000",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="control-plane address(es) (default: %(default)s)",
    )
    b.add_argument("--delta", action="store_true", help="use delta (incremental) xDS: DELTA_GRPC")
    b.add_argument(
        "--admin-port",
        type=int,
        default=9901,
        help="Envoy admin port on 127.0.0.1 (default: %(default)s)",
    )
    b.add_argument("--node-cluster", default="inference-gateway", help="the proxy's node cluster")
    b.add_argument("--grpc", action="store_true", help="print a proxyless gRPC bootstrap (JSON)")
    b.add_argument(
        "--xds-tls-ca",
        metavar="FILE",
        help="connect to the control plane over TLS, verifying its certificate against this CA "
        "(a path on the Envoy's filesystem)",
    )
    b.add_argument(
        "--xds-tls-cert",
        metavar="FILE",
        help="the Envoy's own certificate, for a control plane that requires mutual TLS "
        "(--xds-client-ca); with --xds-tls-key",
    )
    b.add_argument("--xds-tls-key", metavar="FILE", help="the private key of --xds-tls-cert")
    b.add_argument(
        "--no-load-reports",
        action="store_true",
        help="do not send Envoy load reports (LRS) to the control plane; by default Envoy reports "
        "per-endpoint requests in flight, issued, succeeded and failed every second",
    )


def run(args: argparse.Namespace) -> int:
    """`controlplane bootstrap`: the bootstrap on stdout; exit 2 on a bad flag combination."""
    from controlplane.xds.bootstrap import envoy_bootstrap, grpc_bootstrap

    try:
        if args.grpc:
            print(grpc_bootstrap(args.node_id, args.xds.split(",")[0], args.node_cluster))
        else:
            print(
                envoy_bootstrap(
                    args.node_id,
                    args.xds.split(","),
                    delta=args.delta,
                    admin_port=args.admin_port,
                    node_cluster=args.node_cluster,
                    load_reports=not args.no_load_reports,
                    tls_ca=args.xds_tls_ca,
                    tls_cert=args.xds_tls_cert,
                    tls_key=args.xds_tls_key,
                ),
                end="",
            )
    except ValueError as e:
        print(f"controlplane bootstrap: {e}", file=sys.stderr)
        return 2
    return 0
