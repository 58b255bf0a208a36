"""What the picker's hop costs a request: the same zero-work backends behind the same real
Envoy, reached by three models that differ only in `balancing` and `tokenizer` (`plain`: the
no-hop weights; `picked`: ext_proc to a `controlplane picker`, headers only; `precise`: the
same with a `tokenizer:`, so the gateway hands the picker the body and the picker tokenizes
the prompt for the precise prefix index, docs/kv-events.md), at the same open-loop Poisson
rate.

Per round, one arm after the other (the order rotates): requests, errors, latency p50 and
p99 as the client sees them, and for the picked arms the picker's CPU seconds per 1,000
requests (its process's user + system time over the arm). Then each picked arm's added
latency (p50 and p99, minus plain), median over the rounds. `--prompt-bytes` sends prompts
of that size, words of text (the `picked` arm never sees bodies; `precise` tokenizes at most
their first 64 KiB, with the emulated fleets' byte-level tokenizer, sim/tokenizer.py).
Everything on loopback; every process is stopped, on failure too.

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
from controlplane.sim.tokenizer import make_tokenizer  # noqa: E402

BACKEND = """
import sys, time
from controlplane.sim.backend import EchoBackend
EchoBackend(sys.argv[1], "plain", port=int(sys.argv[2])).start()
while True:
    time.sleep(3600)
"""


def fleet(listener: int, backends: list[str], picker: str, timeout_ms: float, tokenizer: Path) -> str:
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
        "  precise:\n"
        f"    {{params_b: 1, balancing: picker, tokenizer: '{tokenizer}', stable: v1,\n"
        f"     versions: {{v1: {{endpoints: [{eps}]}}}}}}\n"
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
    p.add_argument("--rounds", type=int, default=3, help="rounds of every arm (default: %(default)s)")
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
        tokenizer = make_tokenizer(work / "tokenizer")
        config.write_text(fleet(listener, backends, f"127.0.0.1:{picker_port}", a.timeout_ms, tokenizer))
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
        rng = random.Random(0)
        words = ["alpha", "brown", "cache", "delta", "fox", "quick", "server", "token", "lazy", "dog"]
        prompt = ""
        while len(prompt) < a.prompt_bytes:
            prompt += rng.choice(words) + f"{rng.randrange(100)} "
        prompt = prompt[: a.prompt_bytes]
        arms = ["plain", "picked", "precise"]
        for model in arms:  # warm every path
            asyncio.run(arm(url, model, 50, 2, prompt, 0))
        added: dict[str, dict[str, list[float]]] = {m: {"p50": [], "p99": []} for m in arms[1:]}
        for r in range(a.rounds):
            order = arms[r % 3 :] + arms[: r % 3]
            got: dict[str, dict[str, object]] = {}
            for model in order:
                cpu0 = cpu_seconds(picker.pid)
                got[model] = asyncio.run(arm(url, model, a.rate, a.duration, prompt, r))
                if model != "plain":
                    used = cpu_seconds(picker.pid) - cpu0
                    done = int(got[model]["requests"])  # type: ignore[call-overload]
                    got[model]["picker_cpu_s_per_1000"] = round(1000 * used / max(1, done), 3)
                print(json.dumps({"round": r + 1, "arm": model, **got[model]}), flush=True)
            for model in arms[1:]:
                for q in ("p50", "p99"):
                    added[model][q].append(float(got[model][f"{q}_ms"]) - float(got["plain"][f"{q}_ms"]))  # type: ignore[arg-type]
        print(
            json.dumps(
                {
                    "rate": a.rate,
                    "prompt_bytes": a.prompt_bytes,
                    "timeout_ms": a.timeout_ms,
                    **{
                        f"{model}_added_{q}_ms_median": round(statistics.median(v), 3)
                        for model, qs in added.items()
                        for q, v in qs.items()
                    },
                    "added_ms": {
                        m: {q: [round(x, 3) for x in v] for q, v in qs.items()} for m, qs in added.items()
                    },
                }
            )
        )
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
