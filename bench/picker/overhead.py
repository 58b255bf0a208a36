"""What the picker's hop costs a request: the same zero-work backends behind the same real
Envoy, reached by two models that differ only in `balancing` (`plain`: the no-hop weights;
`picked`: ext_proc to a `controlplane picker`), at the same open-loop Poisson rate.

Per round, one arm after the other (the order alternates): requests, errors, latency p50 and
p99 as the client sees them, and for the picked arm the picker's CPU seconds per 1,000
requests (its process's user + system time over the arm). Then the picked arm's added
latency (p50 and p99, picked minus plain), median over the rounds. `--prompt-bytes` sends
prompts of that size (the picker never sees bodies; this shows it). Everything on loopback;
every process is stopped, on failure too.

    .venv/bin/python bench/picker/overhead.py                                  # 300 req/s, ~2 min
    .venv/bin/python bench/picker/overhead.py --rate 100 --prompt-bytes 200000 # large prompts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE.parent / "lb_quality"))
sys.path.insert(0, str(REPO))

from real import Stack, start_proxied, wait_http  # noqa: E402

from bench.ports import free_port  # noqa: E402

BACKEND = """
import sys, time
from controlplane.sim.backend import EchoBackend
EchoBackend(sys.argv[1], "plain", port=int(sys.argv[2])).start()
while True:
    time.sleep(3600)
"""


def fleet(listener: int, backends: list[str], picker: str, timeout_ms: float) -> str:
    eps = ", ".join(f"'{a}'" for a in backends)
    return (
        f"listener: {{port: {listener}}}\n"
        "signals: {enabled: false}\n"
        f"picker: {{endpoints: ['{picker}'], timeout: {timeout_ms:g}ms}}\n"
        "tiers: {small: {timeout: 10s}}\n"
        "models:\n"
        f"  plain: {{params_b: 1, stable: v1, versions: {{v1: {{endpoints: [{eps}]}}}}}}\n"
        "  picked:\n"
        f"    {{params_b: 1, balancing: picker, stable: v1, versions: {{v1: {{endpoints: [{eps}]}}}}}}\n"
    )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def arm(
    url: str, model: str, rate: float, duration: float, prompt: str, seed: int
) -> dict[str, object]:
    """Open-loop Poisson arrivals at `rate` for `duration` s; latencies of the 200s."""
    rng = random.Random(seed)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
    latencies: list[float] = []
    errors: list[str] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one() -> None:
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        errors.append(str(r.status))
                        return
            except aiohttp.ClientError as e:
                errors.append(repr(e))
                return
            latencies.append(time.perf_counter() - t0)

        tasks = []
        start = time.perf_counter()
        at = 0.0
        while at < duration:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    latencies.sort()

    def pct(q: float) -> float | None:
        return 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * q))] if latencies else None

    return {
        "requests": len(tasks),
        "errors": len(errors),
        "p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        if latencies
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=300.0, help="requests/s per arm (default: %(default)s)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per arm (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both arms (default: %(default)s)")
    p.add_argument("--prompt-bytes", type=int, default=16, help="prompt size (default: %(default)s)")
    p.add_argument("--timeout-ms", type=float, default=5.0, help="picker.timeout (default: %(default)s)")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-picker-"))
    stack = Stack(work)
    try:
        ports = [free_port(), free_port()]
        for i, port in enumerate(ports):
            stack.spawn(f"backend-{i}", [sys.executable, "-c", BACKEND, f"b{i}", str(port)])
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/health", 20, "a backend", stack.procs)
        listener, picker_port = free_port(), free_port()
        config = work / "fleet.yaml"
        backends = [f"127.0.0.1:{p}" for p in ports]
        config.write_text(fleet(listener, backends, f"127.0.0.1:{picker_port}", a.timeout_ms))
        start_proxied(stack, work, config, listener, "bench-envoy")
        serve = [list(map(str, proc.args)) for proc in stack.procs if "serve" in map(str, proc.args)]  # type: ignore[arg-type]
        xds = serve[0][serve[0].index("--xds-listen") + 1]
        picker = stack.spawn(
            "picker",
            [
                str(BIN / "controlplane"),
                "picker",
                "--control-plane",
                xds,
                "--listen",
                f"127.0.0.1:{picker_port}",
            ],
        )
        time.sleep(2.0)  # its ADS stream up and the first assignments in
        url = f"http://127.0.0.1:{listener}/v1/completions"
        prompt = "x" * a.prompt_bytes
        asyncio.run(arm(url, "picked", 50, 2, prompt, 0))  # warm both paths
        asyncio.run(arm(url, "plain", 50, 2, prompt, 0))
        added_p50, added_p99 = [], []
        for r in range(a.rounds):
            order = ["plain", "picked"] if r % 2 == 0 else ["picked", "plain"]
            got: dict[str, dict[str, object]] = {}
            for model in order:
                cpu0 = cpu_seconds(picker.pid)
                got[model] = asyncio.run(arm(url, model, a.rate, a.duration, prompt, r))
                if model == "picked":
                    used = cpu_seconds(picker.pid) - cpu0
                    done = int(got[model]["requests"])  # type: ignore[call-overload]
                    got[model]["picker_cpu_s_per_1000"] = round(1000 * used / max(1, done), 3)
                print(json.dumps({"round": r + 1, "arm": model, **got[model]}), flush=True)
            added_p50.append(float(got["picked"]["p50_ms"]) - float(got["plain"]["p50_ms"]))  # type: ignore[arg-type]
            added_p99.append(float(got["picked"]["p99_ms"]) - float(got["plain"]["p99_ms"]))  # type: ignore[arg-type]
        print(
            json.dumps(
                {
                    "rate": a.rate,
                    "prompt_bytes": a.prompt_bytes,
                    "added_p50_ms_median": round(statistics.median(added_p50), 3),
                    "added_p99_ms_median": round(statistics.median(added_p99), 3),
                    "added_p50_ms": [round(x, 3) for x in added_p50],
                    "added_p99_ms": [round(x, 3) for x in added_p99],
                }
            )
        )
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
