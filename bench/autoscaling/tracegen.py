"""Replay a surge trace (controlplane/sim/scalesim.py Trace) against an OpenAI endpoint,
open loop; one JSON line per request on stdout: sent (s from start), latency, status.

Each request asks for round(service seconds / decode seconds per token) output tokens, so
an emulated server spends the trace's service time on it. Run as its own process, so the
load and the system under test do not share a GIL. The first line is
{"start_wall": <unix time the trace's t=0 was>}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp

from controlplane.sim.scalesim import Trace


async def run(args: argparse.Namespace) -> None:
    trace = Trace(**json.loads(args.trace))
    arrivals = trace.arrivals()
    url = f"http://{args.target}/v1/completions"
    out = sys.stdout
    timeout = aiohttp.ClientTimeout(total=args.timeout)

    async def one(session: aiohttp.ClientSession, sent: float, tokens: int, start: float) -> None:
        body = {"model": args.model, "prompt": "surge", "max_tokens": tokens}
        status: int | str
        try:
            async with session.post(url, json=body) as resp:
                await resp.read()
                status = resp.status
        except Exception as e:  # a failed request is a result
            status = type(e).__name__
        out.write(
            json.dumps({"sent": sent, "latency": time.monotonic() - start - sent, "status": status}) + "\n"
        )

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.monotonic()
        out.write(json.dumps({"start_wall": time.time()}) + "\n")
        tasks = set()
        for sent, work in arrivals:
            delay = start + sent - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tokens = max(1, round(work / args.decode_s))
            t = asyncio.create_task(one(session, sent, tokens, start))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
    out.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HOST:PORT of the listener")
    p.add_argument("--model", required=True)
    p.add_argument("--trace", required=True, help="the Trace's fields as JSON")
    p.add_argument("--decode-s", type=float, required=True, help="the servers' seconds per output token")
    p.add_argument("--timeout", type=float, default=300.0)
    asyncio.run(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
