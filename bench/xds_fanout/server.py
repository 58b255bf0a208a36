"""A benchmark server: ours (the real XdsServer + Reconciler) or the floor.

Reads commands on stdin, one per line:
  update I SEED        new random weights for cluster I
  burst N GAP_MS       N weight changes to random clusters, GAP_MS apart
  pushes               print the EDS pushes sent so far
and prints `ready`, then `published GEN T_MONOTONIC` for every snapshot (ours) or update
(floor) on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_fleet, new_weights

from controlplane.obs.logging import configure_logging
from controlplane.obs.metrics import Metrics
from controlplane.routing.translate import ENDPOINT, translate
from controlplane.xds.cache import SnapshotCache
from controlplane.xds.reconciler import Reconciler
from controlplane.xds.server import XdsServer


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def commands(handle: object) -> None:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        await handle(line.split())  # type: ignore[operator]


async def run_ours(args: argparse.Namespace) -> None:
    addresses = Path(args.addresses).read_text().split() if args.addresses else None
    fleet = bench_fleet(args.clusters, args.endpoints, addresses)
    cache = SnapshotCache()
    metrics = Metrics()
    reconciler = Reconciler(cache, metrics, debounce_s=args.debounce, max_delay_s=1.0)
    reconciler.on_publish.append(lambda s: say(f"published {s.generation} {time.monotonic():.6f}"))
    reconciler.set_fleet(fleet)
    weights = None
    if args.signals:
        # As `controlplane serve` runs: the weight loop with its collector processes.
        from controlplane.balancing.controller import WeightController

        weights = WeightController(reconciler, metrics, collectors=args.collectors)
        await weights.tick(first=True)
        weights_task = asyncio.create_task(weights.run())
    reconciler.rebuild_now()
    xds = XdsServer(cache, metrics)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", 1 << 20)])
    server.add_generic_rpc_handlers(tuple(xds.handlers()))
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    task = asyncio.create_task(reconciler.run())
    say("ready")

    async def handle(cmd: list[str]) -> None:
        if cmd[0] == "update":
            cname, w = new_weights(fleet, int(cmd[1]), int(cmd[2]))
            reconciler.set_weights(cname, w)
        elif cmd[0] == "burst":
            # N changes at fixed offsets GAP_MS apart (not N sleeps, which drift on a busy loop).
            t = time.monotonic()
            n, gap = int(cmd[1]), float(cmd[2]) / 1000
            for i in range(n):
                await asyncio.sleep(max(0.0, t + i * gap - time.monotonic()))
                cname, w = new_weights(fleet, i * 7919, 10_000 + i)
                reconciler.set_weights(cname, w)
            say(f"burst_done {time.monotonic() - t:.6f}")
        elif cmd[0] == "signals":
            # The collectors' counters, as the control plane exports them.
            names = (
                "controlplane_signals_collector_cpu_seconds_total",
                "controlplane_signals_pages_total",
                "controlplane_signals_page_bytes_total",
                "controlplane_signals_parse_seconds_total",
                "controlplane_signals_endpoints_backing_off",
                "controlplane_signals_scrape_lag_seconds",
            )
            values = [metrics.registry.get_sample_value(n) or 0.0 for n in names]
            scrapes = sum(
                metrics.registry.get_sample_value("controlplane_signals_scrapes_total", {"outcome": o}) or 0.0
                for o in ("ok", "unreachable", "http_error", "unreadable")
            )
            say("signals " + " ".join(f"{v:.6f}" for v in (*values, scrapes)))
        elif cmd[0] == "pushes":
            total = sum(
                metrics.registry.get_sample_value(
                    "controlplane_xds_pushes_total", {"type": "endpoint", "transport": t}
                )
                or 0
                for t in ("sotw", "delta")
            )
            say(f"pushes {int(total)}")
        elif cmd[0] == "status":
            # Per type: how many streams are in each protocol status (for diagnosing stalls).
            from collections import Counter

            from controlplane.obs.metrics import type_label

            counts: Counter[str] = Counter()
            for conn in list(xds.registry.streams.values()):
                for t, ts in conn.protocol.types.items():
                    flight = "inflight" if ts.in_flight is not None else "idle"
                    counts[f"{type_label(t)}:{conn.protocol.status(t)}:{flight}"] += 1
                if len(conn.protocol.types) < 4:
                    counts[f"types-requested:{len(conn.protocol.types)}"] += 1
            say("status " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        elif cmd[0] == "rebuild":
            # Time one incremental rebuild after one cluster's change, in-process.
            cname, w = new_weights(fleet, int(cmd[1]), int(cmd[2]))
            reconciler.weights[cname] = w
            t = time.perf_counter()
            reconciler.rebuild_now()
            say(f"rebuilt {time.perf_counter() - t:.6f}")

    await commands(handle)
    task.cancel()
    if weights is not None:
        weights_task.cancel()
        await weights.close()
    await server.stop(0)


async def run_floor(args: argparse.Namespace) -> None:
    """The floor from DESIGN.md: serialise once, write the same bytes to every stream."""
    from envoy.service.discovery.v3 import discovery_pb2
    from google.protobuf import any_pb2

    addresses = Path(args.addresses).read_text().split() if args.addresses else None
    fleet = bench_fleet(args.clusters, args.endpoints, addresses)
    desired = translate(fleet)
    version = 1

    def sotw(type_url: str, msgs: list[object]) -> bytes:
        r = discovery_pb2.DiscoveryResponse(version_info=str(version), type_url=type_url, nonce=str(version))
        for m in msgs:
            a = any_pb2.Any()
            a.Pack(m)  # type: ignore[arg-type]
            r.resources.append(a)
        return r.SerializeToString()

    def delta(type_url: str, named: dict[str, object]) -> bytes:
        r = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=str(version), type_url=type_url, nonce=str(version)
        )
        for name, m in named.items():
            res = r.resources.add(name=name, version=str(version))
            res.resource.Pack(m)  # type: ignore[arg-type]
        return r.SerializeToString()

    initial = {
        t: (sotw(t, list(desired.by_type[t].values())), delta(t, dict(desired.by_type[t])))
        for t in desired.by_type
    }
    # Wildcard listeners: the gateway only.
    lds = {n: m for n, m in desired.by_type[LISTENER].items() if n == "inference"}
    initial[LISTENER] = (sotw(LISTENER, list(lds.values())), delta(LISTENER, lds))
    queues: set[asyncio.Queue[bytes]] = set()

    def handler(is_delta: bool):  # type: ignore[no-untyped-def]
        async def handle(request_iterator, context):  # type: ignore[no-untyped-def]
            q: asyncio.Queue[bytes] = asyncio.Queue()
            queues.add(q)
            answered: set[str] = set()

            async def reader() -> None:
                async for req in request_iterator:
                    if req.type_url not in answered and req.type_url in initial:
                        answered.add(req.type_url)
                        q.put_nowait(initial[req.type_url][1 if is_delta else 0])

            task = asyncio.create_task(reader())
            try:
                while True:
                    await context.write(await q.get())
            finally:
                task.cancel()
                queues.discard(q)

        return handle

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", 1 << 20)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "envoy.service.discovery.v3.AggregatedDiscoveryService",
                {
                    "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
                        handler(False),
                        request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
                        response_serializer=lambda b: b,
                    ),
                    "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
                        handler(True),
                        request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
                        response_serializer=lambda b: b,
                    ),
                },
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    say("ready")

    async def handle(cmd: list[str]) -> None:
        nonlocal version
        if cmd[0] != "update":
            if cmd[0] == "pushes":
                say("pushes 0")
            return
        cname, w = new_weights(fleet, int(cmd[1]), int(cmd[2]))
        version += 1
        changed = translate(fleet, {cname: w}).by_type[ENDPOINT][cname]
        payload = sotw(ENDPOINT, [changed]) if not args.delta else delta(ENDPOINT, {cname: changed})
        say(f"published {version} {time.monotonic():.6f}")
        for q in queues:
            q.put_nowait(payload)

    await commands(handle)
    await server.stop(0)


LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["ours", "floor"], required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--clusters", type=int, default=10)
    p.add_argument("--endpoints", type=int, default=10_000)
    p.add_argument("--delta", action="store_true", help="floor: which encoding updates use")
    p.add_argument("--debounce", type=float, default=0.1)
    p.add_argument("--signals", action="store_true", help="ours: run the weight loop (collectors)")
    p.add_argument("--addresses", help="ours: a file of host:port endpoint addresses, in order")
    p.add_argument("--collectors", type=int, default=None, help="collector processes (default: by cores)")
    args = p.parse_args()
    configure_logging("json", "info")  # as `controlplane serve` runs by default
    asyncio.run(run_ours(args) if args.impl == "ours" else run_floor(args))


if __name__ == "__main__":
    main()
