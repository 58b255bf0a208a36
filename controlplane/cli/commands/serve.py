"""`controlplane serve`: serve xDS to Envoy (and proxyless gRPC) from a fleet file, or from
etcd with --store; with the operator API, metrics, holding and scaler services beside it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from controlplane.admin.defaults import DEFAULT_ADMIN_LISTEN, DEFAULT_STATE_DIR
from controlplane.cli.fleet_input import STDIN


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `serve` and its flags to `sub`."""
    s = sub.add_parser(
        "serve",
        help="serve xDS to Envoy from a fleet YAML file",
        description="Serve ADS (state of the world and delta) and the per-type xDS services "
        "from a fleet YAML file. The file is watched: a valid edit is pushed to every proxy; an "
        "invalid edit is refused (logged, counted) and the last good config keeps being served.",
    )
    s.add_argument(
        "--config",
        type=Path,
        help="fleet YAML file (see docs/configuration.md); the embedded default. Not with --store, "
        "where the fleet lives in etcd (see `controlplane import`)",
    )
    s.add_argument(
        "--store",
        metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
        help="run as one of several replicas sharing the fleet, rollout and drain state in etcd "
        "(docs/ha.md); default: the --config file and SQLite under --state-dir",
    )
    s.add_argument(
        "--replica-id",
        default="",
        metavar="ID",
        help="this replica's name in leader election and in the audit trail, where the rollout "
        "controller's own moves read controller@ID (default: random)",
    )
    s.add_argument(
        "--leader-ttl",
        type=int,
        default=5,
        metavar="SECONDS",
        help="with --store: the leader's lease; another replica takes over this long after the "
        "leader dies (default: %(default)s)",
    )
    s.add_argument(
        "--signal-collectors",
        type=int,
        default=None,
        metavar="N",
        help="processes that scrape and parse the servers' metrics, outside the xDS process "
        "(default: one per CPU core but one, at least 1, at most 8; 0 scrapes in the xDS "
        "process itself, for debugging only)",
    )
    s.add_argument(
        "--xds-listen",
        default="127.0.0.1:18000",
        metavar="HOST:PORT",
        help="gRPC xDS address (default: %(default)s, loopback only)",
    )
    s.add_argument(
        "--xds-tls-cert",
        type=Path,
        metavar="FILE",
        help="PEM certificate (chain) for TLS on the xDS port; with --xds-tls-key (default: plaintext)",
    )
    s.add_argument("--xds-tls-key", type=Path, metavar="FILE", help="PEM private key for --xds-tls-cert")
    s.add_argument(
        "--xds-client-ca",
        type=Path,
        metavar="FILE",
        help="PEM CA: require every xDS client (Envoy, proxyless gRPC) to present a certificate "
        "it signed (mutual TLS); needs --xds-tls-cert and --xds-tls-key",
    )
    s.add_argument(
        "--metrics-listen",
        default="127.0.0.1:9102",
        metavar="HOST:PORT",
        help="HTTP address for /metrics, /healthz, /debug/proxies (default: %(default)s)",
    )
    s.add_argument(
        "--admin-listen",
        default=DEFAULT_ADMIN_LISTEN,
        metavar="HOST:PORT",
        help="gRPC address of the operator API used by cpctl and grpcurl (default: %(default)s)",
    )
    s.add_argument(
        "--hold-listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT|off",
        help="the holding service: requests for a model with no ready server (loading, held out, "
        "scaled to zero) wait here and go on to the first ready one, instead of getting 503 "
        "(docs/autoscaling.md). Port 0 picks a free port; 'off' turns holding off (default: %(default)s)",
    )
    s.add_argument(
        "--hold-address",
        default=None,
        metavar="HOST:PORT",
        help="the address proxies dial to reach the holding service, when it is not the listen "
        "address (a Service name on Kubernetes; needed when listening on 0.0.0.0)",
    )
    s.add_argument(
        "--scaler-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve KEDA's external scaler (gRPC, read-only: desired replicas and activity per "
        "model; docs/autoscaling.md) on this address (default: not served)",
    )
    s.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        metavar="DIR",
        help="rollout and drain state (SQLite) and the generated admin token (default: %(default)s)",
    )
    s.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="FILE",
        help="the operator API's bearer token; default: <state-dir>/admin-token, created (0600) "
        "on first start",
    )
    s.add_argument(
        "--admin-readonly-token-file",
        type=Path,
        metavar="FILE",
        help="an optional second token that may only read (get, list, watch, history)",
    )
    s.add_argument("--log-format", choices=["console", "json"], default="console", help="log output format")
    s.add_argument("--log-level", default="info", help="debug, info, warning, error (default: info)")
    s.add_argument(
        "--debounce",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="publish a snapshot once changes have been quiet this long (default: %(default)s)",
    )
    s.add_argument(
        "--max-delay",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="but never later than this after the first change of a burst (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """`controlplane serve`: check every flag before anything starts (exit 2), then serve until
    SIGINT or SIGTERM."""
    from controlplane.app import ServeOptions
    from controlplane.obs.http import split_host_port
    from controlplane.obs.logging import configure_logging

    configure_logging(args.log_format, args.log_level)
    for flag, value in (
        ("--xds-listen", args.xds_listen),
        ("--metrics-listen", args.metrics_listen),
        ("--admin-listen", args.admin_listen),
        *((("--scaler-listen", args.scaler_listen),) if args.scaler_listen else ()),
        *((("--hold-listen", args.hold_listen),) if args.hold_listen != "off" else ()),
        *((("--hold-address", args.hold_address),) if args.hold_address else ()),
    ):
        try:
            split_host_port(value)
        except ValueError as e:
            print(f"controlplane serve: {flag}: {e}", file=sys.stderr)
            return 2
    xds_tls = None
    if args.xds_tls_cert or args.xds_tls_key or args.xds_client_ca:
        from controlplane.net.tls import TlsConfigInvalid, XdsTls, server_credentials

        if not (args.xds_tls_cert and args.xds_tls_key):
            print("controlplane serve: --xds-tls-cert and --xds-tls-key go together", file=sys.stderr)
            return 2
        xds_tls = XdsTls(args.xds_tls_cert, args.xds_tls_key, args.xds_client_ca)
        try:
            server_credentials(xds_tls)  # every file checked before anything starts
        except TlsConfigInvalid as e:
            print(f"controlplane serve: {e}", file=sys.stderr)
            return 2
    if args.store is None and args.config is None:
        print(
            "controlplane serve: give --config FILE (the fleet file), or --store etcd://... for "
            "several replicas",
            file=sys.stderr,
        )
        return 2
    if args.store is not None:
        from controlplane.ha.etcd import StoreUrlInvalid, parse_store_url

        if args.config is not None:
            print(
                "controlplane serve: --config and --store: with --store the fleet lives in etcd; "
                f"load the file with: controlplane import --from {args.config} --to {args.store}",
                file=sys.stderr,
            )
            return 2
        try:
            parse_store_url(args.store)
        except StoreUrlInvalid as e:
            print(f"controlplane serve: --store: {e}", file=sys.stderr)
            return 2
        if args.signal_collectors is not None and not 0 <= args.signal_collectors <= 64:
            print("controlplane serve: --signal-collectors: 0 to 64", file=sys.stderr)
            return 2
        if args.leader_ttl < 2:
            print("controlplane serve: --leader-ttl: at least 2 seconds", file=sys.stderr)
            return 2
    elif str(args.config) == STDIN:
        print(
            "controlplane serve: --config: serve watches a file; standard input (-) is not one",
            file=sys.stderr,
        )
        return 2
    elif not args.config.exists():
        print(f"controlplane serve: --config: {args.config} does not exist", file=sys.stderr)
        return 2
    options = ServeOptions(
        config=args.config,
        xds_listen=args.xds_listen,
        xds_tls=xds_tls,
        metrics_listen=args.metrics_listen,
        debounce_s=args.debounce,
        max_delay_s=args.max_delay,
        state_dir=args.state_dir,
        admin_listen=args.admin_listen,
        admin_token_file=args.admin_token_file,
        admin_readonly_token_file=args.admin_readonly_token_file,
        store=args.store,
        replica_id=args.replica_id,
        leader_ttl_s=args.leader_ttl,
        signal_collectors=args.signal_collectors,
        scaler_listen=args.scaler_listen,
        hold_listen=None if args.hold_listen == "off" else args.hold_listen,
        hold_address=args.hold_address,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run_until_signal(options))
    return 0


async def _run_until_signal(options: object) -> None:
    from controlplane.admin.auth import TokenFileError
    from controlplane.app import ControlPlane, ServeOptions
    from controlplane.process.stop import until_stop_signal

    assert isinstance(options, ServeOptions)
    cp = ControlPlane(options)
    try:
        await cp.start()
    except (OSError, TokenFileError) as e:
        await cp.weights.close()
        print(f"controlplane serve: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    await until_stop_signal()
    await cp.stop()
