"""How close a token quota holds under steady overload, across several proxies and services.

On loopback: emulated servers (`controlplane emulate`), the control plane, `--proxies` real
Envoys sharing the listener port, `--services` `controlplane ratelimit` processes on one real
redis-server (as one per control-plane replica), all listed in quotas.service.endpoints.
One tenant with `--tokens-per-minute`; a load generator (this process, aiohttp, open loop)
sends that tenant's requests at `--overload` times the rate its limit allows, for a warm-up
minute (the bucket starts full: the first minute's allowance is spent) then `--duration`
seconds measured. Printed: the tokens the tenant was served in the measured window (the
servers' own usage.total_tokens of every 200) against the limit over the window, 429s, and
how the requests spread over the proxies and services.

    .venv/bin/python bench/quotas/accuracy.py                 # 3 proxies, 2 services, 3 min (~5 min)
    .venv/bin/python bench/quotas/accuracy.py --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "lb_quality"))
sys.path.insert(0, str(HERE.parents[1]))

from real import BIN, Stack, proxy_requests, start_proxied, wait_http  # noqa: E402

from bench.ports import free_port, free_ports  # noqa: E402

MAX_TOKENS = 40
PROMPT = "quota " * 8


async def load(port: int, rate: float, warmup: float, duration: float, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    tokens = served = refused = errors = 0
    window = (0.0, 0.0)

    async def one(session: aiohttp.ClientSession, at: float) -> None:
        nonlocal tokens, served, refused, errors
        body = {"model": "chat", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        try:
            async with session.post(
                f"http://127.0.0.1:{port}/v1/completions", json=body, headers={"x-api-key": "acme"}
            ) as r:
                data = await r.read()
                measured = window[0] <= at < window[1]
                if r.status == 200:
                    if measured:
                        tokens += json.loads(data)["usage"]["total_tokens"]
                        served += 1
                elif r.status == 429:
                    refused += measured
                else:
                    errors += 1
        except aiohttp.ClientError:
            errors += 1

    connector = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.monotonic()
        window = (start + warmup, start + warmup + duration)
        tasks = []
        at = start
        while at < window[1]:
            at += rng.expovariate(rate)
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, at)))
        await asyncio.gather(*tasks)
    return {"tokens": tokens, "served": served, "refused": refused, "errors": errors}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-minute", type=int, default=2000)
    p.add_argument("--overload", type=float, default=3.0, help="offered tokens over the limit")
    p.add_argument("--duration", type=float, default=180.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before measuring (the full bucket)")
    p.add_argument("--proxies", type=int, default=3)
    p.add_argument("--services", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    work = Path(tempfile.mkdtemp(prefix="quota-accuracy-"))
    stack = Stack(work)
    try:
        redis_port = free_port()
        stack.spawn("redis", [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""])
        base = free_ports(2)
        emulate = [str(BIN / "controlplane"), "emulate", "--listen", f"127.0.0.1:{base}", "--model", "chat"]
        emulate += [
            "--count",
            "2",
            "--slots",
            "16",
            "--decode-ms-per-token",
            "2",
            "--prefill-ms-per-token",
            "0.1",
        ]
        stack.spawn("emulate", emulate)
        for port in (base, base + 1):
            wait_http(f"http://127.0.0.1:{port}/health", 20, "emulated servers", stack.procs)
        services = [free_port() for _ in range(args.services)]
        metrics = [free_port() for _ in range(args.services)]
        listener = free_port()
        servers = json.dumps([f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"])
        config = work / "fleet.yaml"
        config.write_text(
            f"listener: {{port: {listener}}}\n"
            "tiers: {small: {max_params_b: 20, timeout: 60s}}\n"
            "quotas:\n"
            f"  service: {{endpoints: {json.dumps([f'127.0.0.1:{s}' for s in services])}, timeout: 200ms}}\n"
            f"  tenants: {{acme: {{tokens_per_minute: {args.tokens_per_minute}}}}}\n"
            "models:\n"
            f"  chat: {{params_b: 8, stable: v1, versions: {{v1: {{endpoints: {servers}}}}}}}\n"
        )
        for i, (port, mport) in enumerate(zip(services, metrics, strict=True)):
            cmd = [
                str(BIN / "controlplane"),
                "ratelimit",
                "--config",
                str(config),
                "--listen",
                f"127.0.0.1:{port}",
            ]
            cmd += ["--metrics-listen", f"127.0.0.1:{mport}", "--store", f"redis://127.0.0.1:{redis_port}/0"]
            stack.spawn(f"ratelimit-{i}", cmd)
            wait_http(f"http://127.0.0.1:{mport}/metrics", 20, "the rate-limit service", stack.procs)
        start_proxied(stack, work, config, listener, "quota", proxies=args.proxies)
        per_request = len(PROMPT.split()) + MAX_TOKENS  # the emulator's usage: a word a token
        rate = args.overload * args.tokens_per_minute / 60.0 / per_request
        print(
            f"{args.proxies} Envoys, {args.services} rate-limit services on one redis-server; acme: "
            f"{args.tokens_per_minute} tokens/min, offered {rate:.2f} req/s (~{per_request} tokens each, "
            f"{args.overload:g}x); {args.warmup:g} s warm-up, {args.duration:g} s measured ...",
            flush=True,
        )
        got = asyncio.run(load(listener, rate, args.warmup, args.duration, args.seed))
        limit = args.tokens_per_minute * args.duration / 60.0
        decided = []
        for mport in metrics:
            with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
                page = r.read().decode()
            decided.append(
                sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in page.splitlines()
                    if line.startswith("controlplane_quota_decisions_total{")
                )
            )
        print(json.dumps(got))
        print("\n| tokens served | the limit over the window | served / limit | 200s | 429s | errors |")
        print("|---|---|---|---|---|---|")
        print(
            f"| {got['tokens']:.0f} | {limit:.0f} | {got['tokens'] / limit:.1%} | {got['served']:.0f} | "
            f"{got['refused']:.0f} | {got['errors']:.0f} |"
        )
        by_proxy = [proxy_requests(a) for a in stack.envoy_admins]
        print(f"requests by proxy {by_proxy}; decisions by service {decided}")
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
