"""What a rate-limit decision costs: `controlplane ratelimit` answering Envoy's protocol at a
steady open-loop rate, with its buckets in memory and on a real redis-server.

One run starts, on loopback, the service (in memory), then a redis-server and the service on
it; a gRPC client in this process sends ShouldRateLimit calls as Envoy does (one descriptor:
model, tenant; 100 tenants in turn, each far from its limit, so every call takes from a
bucket) at `--rate` per second for `--duration` seconds per arm, and prints p50, p99 and
max as the client sees them (gRPC both ways, Python on both sides, on the same two cores),
the time inside the service's handler (its own histogram), and Redis's against memory's.

    .venv/bin/python bench/quotas/decisions.py                 # 1,000/s, 20 s per arm
    .venv/bin/python bench/quotas/decisions.py --rate 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: bench.ports

from bench.ports import free_port  # noqa: E402

FLEET = """\
listener: {port: %d}
tiers: {small: {max_params_b: 20}}
quotas:
  service: {endpoints: ['127.0.0.1:%d']}
  default: {requests_per_minute: 100000000, tokens_per_minute: 100000000}
models:
  chat: {params_b: 8, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9']}}}
"""


def wait_port(port: int, procs: list[subprocess.Popen[bytes]], timeout: float = 15.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"exited early: {p.args!r}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


async def drive(port: int, rate: float, duration: float, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    latencies: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)

        def request(i: int) -> rls_pb2.RateLimitRequest:
            d = ratelimit_pb2.RateLimitDescriptor()
            d.entries.add(key="model", value="chat")
            d.entries.add(key="tenant", value=f"tenant-{i % 100}")
            return rls_pb2.RateLimitRequest(domain="inference", descriptors=[d])

        for i in range(200):  # warm-up: connection, buckets
            await stub.ShouldRateLimit(request(i), timeout=2)

        async def one(i: int) -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                r = await stub.ShouldRateLimit(request(i), timeout=2)
                if r.overall_code != rls_pb2.RateLimitResponse.OK:
                    errors += 1
            except grpc.RpcError:
                errors += 1
                return
            latencies.append(time.perf_counter() - t0)

        tasks = []
        start = time.perf_counter()
        at = start
        i = 0
        while at - start < duration:
            at += rng.expovariate(rate)
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
            i += 1
        await asyncio.gather(*tasks)
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return {
        "calls": len(latencies),
        "errors": errors,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "max_ms": latencies[-1] * 1000,
    }


def inside(metrics_port: int) -> dict[str, float]:
    """The service's own decision time (controlplane_quota_decision_seconds, in the handler:
    no gRPC, no client): its mean and the bucket bound its p99 is under, ms."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        page = r.read().decode()
    buckets: list[tuple[float, float]] = []
    total = count = 0.0
    for line in page.splitlines():
        if line.startswith("controlplane_quota_decision_seconds_bucket{"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith("controlplane_quota_decision_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("controlplane_quota_decision_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    p99 = next((le for le, n in sorted(buckets) if n >= 0.99 * count), float("inf"))
    return {"inside_mean_ms": total / count * 1000 if count else 0.0, "inside_p99_le_ms": p99 * 1000}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1000.0, help="decisions per second (open loop)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per arm")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    redis_server = shutil.which("redis-server")
    work = Path(tempfile.mkdtemp(prefix="quota-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, dict[str, float]] = {}
    try:
        arms = ["memory"] + (["redis"] if redis_server else [])
        redis_port = free_port()
        if redis_server:
            procs.append(
                subprocess.Popen(
                    [
                        redis_server,
                        "--port",
                        str(redis_port),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            wait_port(redis_port, procs)
        for arm in arms:
            port = free_port()
            config = work / f"{arm}.yaml"
            config.write_text(FLEET % (free_port(), port))
            store = "memory" if arm == "memory" else f"redis://127.0.0.1:{redis_port}/0"
            log = (work / f"{arm}.log").open("wb")
            metrics = free_port()
            cmd = [str(BIN / "controlplane"), "ratelimit", "--config", str(config), "--store", store]
            cmd += ["--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}"]
            svc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            procs.append(svc)
            try:
                wait_port(port, procs)
            except RuntimeError:
                print((work / f"{arm}.log").read_text()[-2000:], file=sys.stderr)
                raise
            print(f"{arm}: {args.rate:g} decisions/s for {args.duration:g} s ...", flush=True)
            results[arm] = asyncio.run(drive(port, args.rate, args.duration, args.seed))
            results[arm].update(inside(metrics))
            print(json.dumps({"arm": arm, **{k: round(v, 3) for k, v in results[arm].items()}}), flush=True)
            svc.send_signal(signal.SIGTERM)
            svc.wait(10)
            procs.remove(svc)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(
        "\n| store | decisions | errors | p50 ms | p99 ms | max ms | in the handler: mean ms | p99 under ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for arm, r in results.items():
        cells = [f"{r['calls']:.0f}", f"{r['errors']:.0f}"]
        cells += [f"{r[k]:.2f}" for k in ("p50_ms", "p99_ms", "max_ms", "inside_mean_ms", "inside_p99_le_ms")]
        print(f"| {arm} | " + " | ".join(cells) + " |")
    if "redis" in results:
        m, r = results["memory"], results["redis"]
        ratio = {k: r[k] / m[k] for k in ("p50_ms", "p99_ms")}
        print(f"\nRedis against memory: p50 {ratio['p50_ms']:.2f}x, p99 {ratio['p99_ms']:.2f}x")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
