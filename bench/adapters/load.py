"""Open-loop load over LoRA adapters: Poisson arrivals at `--rate`, each request naming one of
`--adapters` adapters (a0, a1, ...) drawn with Zipf popularity (adapter i's weight
1 / (i + 1) ** --zipf); streamed, so time to first token is the first chunk's. Prints one JSON
line: requests by status, TTFT and latency percentiles (answered 200), and requests per
adapter.

    load.py --target 127.0.0.1:10000 --rate 8 --duration 60 --adapters 16 --zipf 1.0

Run as its own process, so the load and the system under test do not share a GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lb_quality"))

from loadgen import output_tokens, percentile


async def run(args: argparse.Namespace) -> dict[str, object]:
    url = f"http://{args.target}/v1/completions"
    names = [f"a{i}" for i in range(args.adapters)]
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.adapters)]
    rng = random.Random(args.seed)
    start = time.monotonic()
    end = start + args.warmup + args.duration
    statuses: dict[str, int] = {}
    sent = [0]  # every request, the warm-up's too (what the servers' load counts cover)
    per_adapter: dict[str, int] = {}
    ttfts: list[float] = []
    latencies: list[float] = []

    async def one(session: aiohttp.ClientSession, adapter: str, tokens: int, measure: bool) -> None:
        prompt = f"r{rng.getrandbits(48):x} " + "bench " * (args.prompt_words - 1)
        body = {"model": adapter, "prompt": prompt, "max_tokens": tokens, "stream": True}
        t0 = time.monotonic()
        first = None
        try:
            async with session.post(url, json=body) as resp:
                async for _ in resp.content.iter_any():
                    if first is None:
                        first = time.monotonic() - t0
                status = str(resp.status)
        except Exception as e:  # a failed request is a result
            status = type(e).__name__
        if not measure:
            return
        statuses[status] = statuses.get(status, 0) + 1
        per_adapter[adapter] = per_adapter.get(adapter, 0) + 1
        if status == "200" and first is not None:
            ttfts.append(first)
            latencies.append(time.monotonic() - t0)

    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t = start
        while True:
            t += rng.expovariate(args.rate)
            if t >= end:
                break
            delay = t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            adapter = rng.choices(names, weights)[0]
            tokens = output_tokens(rng, 24.0, 0.9, 1, 400)
            sent[0] += 1
            task = asyncio.create_task(one(session, adapter, tokens, t >= start + args.warmup))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.wait(set(tasks))
    return {
        "requests": sum(statuses.values()),
        "sent": sent[0],
        "statuses": statuses,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "latency_p50": percentile(latencies, 0.5),
        "latency_p90": percentile(latencies, 0.9),
        "latency_p99": percentile(latencies, 0.99),
        "per_adapter": dict(sorted(per_adapter.items(), key=lambda kv: int(kv[0][1:]))),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HOST:PORT of the Envoy listener")
    p.add_argument("--rate", type=float, required=True, help="requests/s")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the adapters' popularity")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before measuring")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prompt-words", type=int, default=32, help="each prompt's words (tokens)")
    p.add_argument("--timeout", type=float, default=300.0, help="per request")
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
