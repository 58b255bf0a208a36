"""A steady-rate traffic generator that records every response (run as its own process).

    python -m controlplane.sim.traffic --url http://127.0.0.1:10000 --model llama-3-8b \
        --rate 100 --duration 60 --out responses.jsonl

Requests start at a fixed rate whatever the responses do (open loop), each an OpenAI
completion for `--model`. Every response is one JSON line in `--out`, written as it
completes: `{"t": unix time sent, "status": 200, "server": "<x-emulator-server>",
"error": null}`. A connection reset or timeout has status 0 and the error's text. On
SIGTERM or after `--duration` it waits for requests in flight, then prints a summary line.
Tests and the demo use it to count non-2xx responses and resets through Envoy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from typing import IO

import aiohttp

from controlplane.net.http import client_session
from controlplane.process.stop import stop_on_signals


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    out: IO[str],
    tally: Counter[str],
) -> None:
    sent = time.time()
    status, server, error = 0, "", None
    try:
        async with session.post(url, data=body, headers=headers) as r:
            await r.read()
            status, server = r.status, r.headers.get("x-emulator-server", "")
    except (TimeoutError, aiohttp.ClientError) as e:
        error = f"{type(e).__name__}: {e}"
    tally["ok" if 200 <= status < 300 else "failed"] += 1
    out.write(json.dumps({"t": round(sent, 4), "status": status, "server": server, "error": error}) + "\n")
    out.flush()


async def run(args: argparse.Namespace, out: IO[str]) -> Counter[str]:
    body = json.dumps({"model": args.model, "prompt": "hello " * 8, "max_tokens": args.max_tokens}).encode()
    headers = {"content-type": "application/json", **dict(h.split(":", 1) for h in args.header)}
    url = args.url.rstrip("/") + "/v1/completions"
    tally: Counter[str] = Counter()
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    with stop_on_signals() as stop:
        tasks: set[asyncio.Task[None]] = set()
        # --fresh-connections: one TCP connection per request, so that several proxies sharing
        # a port (SO_REUSEPORT) each get a share; kept-alive connections stick to one proxy.
        async with client_session(
            limit=args.connections, force_close=args.fresh_connections, timeout=timeout
        ) as session:
            start = time.monotonic()
            n = 0
            while not stop.is_set() and (args.duration <= 0 or time.monotonic() - start < args.duration):
                t = asyncio.create_task(_one(session, url, body, headers, out, tally))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                n += 1
                delay = start + n / args.rate - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
            if tasks:
                await asyncio.wait(tasks, timeout=args.timeout)
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m controlplane.sim.traffic",
        description="Send completions at a steady rate and record every response as a JSON line.",
    )
    p.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:10000")
    p.add_argument("--model", required=True, help="the model to ask for")
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (default: %(default)s)")
    p.add_argument("--duration", type=float, default=0.0, help="seconds; 0 runs until SIGTERM (default)")
    p.add_argument(
        "--max-tokens", type=int, default=4, help="output tokens per request (default: %(default)s)"
    )
    p.add_argument("--timeout", type=float, default=30.0, help="per request, seconds (default: %(default)s)")
    p.add_argument("--connections", type=int, default=200, help="connection pool size (default: %(default)s)")
    p.add_argument(
        "--fresh-connections",
        action="store_true",
        help="open a new connection for every request instead of keeping connections alive "
        "(spreads load over proxies that share a port)",
    )
    p.add_argument("--header", action="append", default=[], metavar="NAME:VALUE", help="extra request header")
    p.add_argument("--out", required=True, help="JSON-lines file of responses ('-' for stdout)")
    args = p.parse_args(argv)
    if args.rate <= 0:
        p.error("--rate: must be greater than 0")
    with contextlib.ExitStack() as stack:
        out = sys.stdout if args.out == "-" else stack.enter_context(open(args.out, "w"))
        tally = asyncio.run(run(args, out))
    print(json.dumps({"ok": tally["ok"], "failed": tally["failed"]}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
