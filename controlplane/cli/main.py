"""`controlplane`: serve, check-config, bootstrap, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from controlplane import __version__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="controlplane",
        description="An xDS control plane for AI inference traffic: it drives Envoy proxies "
        "(and proxyless gRPC clients) in front of GPU model servers.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="serve xDS to Envoy from a fleet YAML file",
        description="Serve ADS (state of the world and delta) and the per-type xDS services "
        "from a fleet YAML file. The file is watched: a valid edit is pushed to every proxy; an "
        "invalid edit is refused (logged, counted) and the last good config keeps being served.",
    )
    s.add_argument("--config", required=True, type=Path, help="fleet YAML file (see docs/configuration.md)")
    s.add_argument(
        "--xds-listen",
        default="127.0.0.1:18000",
        metavar="HOST:PORT",
        help="gRPC xDS address (default: %(default)s, loopback only)",
    )
    s.add_argument(
        "--metrics-listen",
        default="127.0.0.1:9102",
        metavar="HOST:PORT",
        help="HTTP address for /metrics, /healthz, /debug/proxies (default: %(default)s)",
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

    c = sub.add_parser(
        "check-config",
        help="validate a fleet YAML file",
        description="Validate a fleet YAML file. Prints every error with file, line, key path and "
        "reason, and exits 1 if there is any; prints a summary and exits 0 otherwise.",
    )
    c.add_argument("file", type=Path)

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
        "--no-load-reports",
        action="store_true",
        help="do not send Envoy load reports (LRS) to the control plane; by default Envoy reports "
        "per-endpoint requests in flight, issued, succeeded and failed every second",
    )

    d = sub.add_parser(
        "demo",
        help="run the demo: control plane, emulated backends and a real Envoy",
        description="Start the control plane on an example fleet, a few emulated inference "
        "servers and a real Envoy on loopback ports, send traffic, edit the fleet live, print a "
        "summary and stop everything.",
    )
    d.add_argument("--duration", type=float, default=20.0, help="seconds of traffic (default: %(default)s)")
    d.add_argument("--delta", action="store_true", help="run Envoy with delta xDS")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "bootstrap":
        return _bootstrap(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        from controlplane.sim.demo import run_demo

        return int(run_demo(duration_s=args.duration, delta=args.delta))
    return 2


def _check_config(path: Path) -> int:
    from controlplane.fleet.loader import FleetConfigInvalid, load_fleet

    try:
        fleet = load_fleet(path)
    except FleetConfigInvalid as e:
        for err in e.errors:
            print(err, file=sys.stderr)
        print(f"{path}: {len(e.errors)} error(s)", file=sys.stderr)
        return 1
    endpoints = sum(len(v.endpoints) for m in fleet.models for v in m.versions)
    print(f"{path}: ok: {len(fleet.tiers)} tiers, {len(fleet.models)} models, {endpoints} endpoints")
    for m in fleet.models:
        print(
            f"  {m.name}: tier {m.tier}, stable {m.stable}, versions {', '.join(v.name for v in m.versions)}"
        )
    return 0


def _bootstrap(args: argparse.Namespace) -> int:
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
                ),
                end="",
            )
    except ValueError as e:
        print(f"controlplane bootstrap: {e}", file=sys.stderr)
        return 2
    return 0


def _serve(args: argparse.Namespace) -> int:
    from controlplane.app import ServeOptions
    from controlplane.obs.http import split_host_port
    from controlplane.obs.logging import configure_logging

    configure_logging(args.log_format, args.log_level)
    for flag, value in (
        ("--xds-listen", args.xds_listen),
        ("--metrics-listen", args.metrics_listen),
    ):
        try:
            split_host_port(value)
        except ValueError as e:
            print(f"controlplane serve: {flag}: {e}", file=sys.stderr)
            return 2
    if not args.config.exists():
        print(f"controlplane serve: --config: {args.config} does not exist", file=sys.stderr)
        return 2
    options = ServeOptions(
        config=args.config,
        xds_listen=args.xds_listen,
        metrics_listen=args.metrics_listen,
        debounce_s=args.debounce,
        max_delay_s=args.max_delay,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run_until_signal(options))
    return 0


async def _run_until_signal(options: object) -> None:
    import signal

    from controlplane.app import ControlPlane, ServeOptions

    assert isinstance(options, ServeOptions)
    cp = ControlPlane(options)
    try:
        await cp.start()
    except OSError as e:
        print(f"controlplane serve: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await cp.stop()


if __name__ == "__main__":
    raise SystemExit(main())
