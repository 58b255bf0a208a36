"""Open-loop load of several streams at once (tenants, priority classes), each its own Poisson
arrivals; prints one JSON line: per stream, its requests by status and its time to first
token and latency percentiles (answered 200), and the 429s' times.

    load.py --target 127.0.0.1:10000 --model bench-8b --duration 60 \
        --stream light:acme:standard:2.0 --stream heavy:globex:standard:20.0

A stream is NAME:TENANT:CLASS:RATE (requests/s): TENANT goes in `x-api-key`, CLASS in
`x-priority` ("-" for neither). Requests stream (TTFT is the time to the first chunk); their
output tokens are drawn as loadgen.py's (lognormal, median 24, at most 400). Run as its own
process, so the load and the system under test do not share a GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lb_quality"))

from loadgen import output_tokens, percentile


@dataclass
class Stream:
    name: str
    tenant: str
    klass: str
    rate: float
    statuses: dict[str, int] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    refused_after: list[float] = field(default_factory=list)  # seconds to a 429

    def summary(self) -> dict[str, object]:
        return {
            "tenant": self.tenant,
            "class": self.klass,
            "rate": self.rate,
            "requests": sum(self.statuses.values()),
            "statuses": self.statuses,
            "ttft_p50": percentile(self.ttfts, 0.5),
            "ttft_p90": percentile(self.ttfts, 0.9),
            "ttft_p99": percentile(self.ttfts, 0.99),
            "latency_p50": percentile(self.latencies, 0.5),
            "latency_p99": percentile(self.latencies, 0.99),
            "refused_after_max": max(self.refused_after, default=None),
        }


def parse_stream(text: str) -> Stream:
    try:
        name, tenant, klass, rate = text.split(":")
        return Stream(name, "" if tenant == "-" else tenant, "" if klass == "-" else klass, float(rate))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME:TENANT:CLASS:RATE, got {text!r}") from None


async def run(args: argparse.Namespace) -> dict[str, object]:
    url = f"http://{args.target}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    start = time.monotonic()
    end = start + args.warmup + args.duration
    rng_words = random.Random(args.seed)

    async def one(session: aiohttp.ClientSession, s: Stream, tokens: int, measure: bool) -> None:
        headers = {}
        if s.tenant:
            headers["x-api-key"] = s.tenant
        if s.klass:
            headers["x-priority"] = s.klass
        # A word of its own first: no server holds any of it cached (a prefix cache would
        # otherwise serve every prompt after the first without its prefill).
        prompt = f"r{rng_words.getrandbits(48):x} " + "bench " * (args.prompt_words - 1)
        body = {"model": args.model, "prompt": prompt, "max_tokens": tokens, "stream": True}
        t0 = time.monotonic()
        first = None
        try:
            async with session.post(url, json=body, headers=headers) as resp:
                async for _ in resp.content.iter_any():
                    if first is None:
                        first = time.monotonic() - t0
                status = str(resp.status)
        except Exception as e:  # a failed request is a result
            status = type(e).__name__
        if not measure:
            return
        s.statuses[status] = s.statuses.get(status, 0) + 1
        if status == "200" and first is not None:
            s.ttfts.append(first)
            s.latencies.append(time.monotonic() - t0)
        elif status == "429":
            s.refused_after.append(time.monotonic() - t0)

    async def arrivals(
        session: aiohttp.ClientSession, s: Stream, rng: random.Random, tasks: set[asyncio.Task[None]]
    ) -> None:
        t = start
        while True:
            t += rng.expovariate(s.rate)
            if t >= end:
                return
            delay = t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tokens = output_tokens(rng, 24.0, 0.9, 1, 400)
            task = asyncio.create_task(one(session, s, tokens, t >= start + args.warmup))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        await asyncio.gather(
            *(
                arrivals(session, s, random.Random(args.seed * 1000 + i), tasks)
                for i, s in enumerate(args.stream)
            )
        )
        while tasks:
            await asyncio.wait(set(tasks))
    return {s.name: s.summary() for s in args.stream}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HOST:PORT of the Envoy listener")
    p.add_argument("--model", required=True)
    p.add_argument(
        "--stream", type=parse_stream, action="append", required=True, help="NAME:TENANT:CLASS:RATE"
    )
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
