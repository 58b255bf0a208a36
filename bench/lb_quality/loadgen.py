"""Open-loop Poisson load against an OpenAI-compatible endpoint; prints one JSON summary line.

Arrivals are a Poisson process at `--rate` requests/s whatever the responses do (open
loop: a slow fleet builds a queue, as real users would). Each request asks for a number
of output tokens drawn from a lognormal, so request costs differ by ~100x. Run as its
own process so that the load generator and the system under test do not share a GIL.

With `--picker` it is also the balancer: each request goes straight to the server a
per-request full scan chooses (`controlplane.sim.pickers.full_scan_pick`) over the true
global state, which only the sole client knows exactly: every server's requests in flight,
its slots and its speed. That is the real-stack counterpart of the simulated picker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from controlplane.sim.pickers import ServerView, full_scan_pick


class Picker:
    """The full-scan picker over servers given as HOST:PORT@SPEED@SLOTS."""

    def __init__(self, spec: str, service_s: float) -> None:
        self.addresses: list[str] = []
        self.speeds: list[float] = []
        self.slots: list[int] = []
        for item in spec.split(","):
            address, speed, slots = item.split("@")
            self.addresses.append(address)
            self.speeds.append(float(speed))
            self.slots.append(int(slots))
        self.service_s = service_s
        self.in_flight = [0] * len(self.addresses)

    def pick(self) -> int:
        views = [
            ServerView(min(n, s), max(0, n - s), s, self.service_s / v)
            for n, s, v in zip(self.in_flight, self.slots, self.speeds, strict=True)
        ]
        return full_scan_pick(views)


def output_tokens(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def mean_output_tokens(median: float, sigma: float, lo: int, hi: int, seed: int = 7) -> float:
    """The mean of the clipped lognormal, estimated once (the bench sizes its load with it)."""
    rng = random.Random(seed)
    n = 200_000
    return sum(output_tokens(rng, median, sigma, lo, hi) for _ in range(n)) / n


async def open_loop(
    rng: random.Random,
    rate: float,
    warmup: float,
    duration: float,
    launch: Callable[[bool], Coroutine[Any, Any, None]],
) -> None:
    """Poisson arrivals at `rate` per second for `warmup` + `duration` seconds, whatever the
    responses do; each calls `launch(measured)` at once (so what it draws from `rng` is drawn
    in arrival order) and runs the coroutine it returns as a task. Returns once all are done."""
    tasks: set[asyncio.Task[None]] = set()
    start = time.monotonic()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= warmup + duration:
            break
        delay = start + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(launch(t >= warmup))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)


def served_by(body: bytes) -> str:
    """The answer's `model` field: a real llama.cpp server run with its name as its alias says
    who served the request there (the emulator says it in a header)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return ""
    return str(doc.get("model", "")) if isinstance(doc, dict) else ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    picker = Picker(args.picker, args.service_s) if args.picker else None
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    by_backend: dict[str, int] = {}
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)

    async def one(session: aiohttp.ClientSession, tokens: int, measure: bool) -> None:
        body: dict[str, object] = {"model": args.model, "prompt": "bench " * 32, "max_tokens": tokens}
        if args.ignore_eos:
            body["ignore_eos"] = True  # llama.cpp's: a random-weight model may end at once
        started = time.monotonic()
        server = picker.pick() if picker is not None else -1
        target = picker.addresses[server] if picker is not None else args.target
        if picker is not None:
            picker.in_flight[server] += 1
        try:
            async with session.post(f"http://{target}/v1/completions", json=body) as resp:
                data = await resp.read()
                status = str(resp.status)
                backend = resp.headers.get("x-emulator-server", "") or served_by(data)
        except Exception as e:  # a failed request is a result, not a crash
            status = type(e).__name__
            backend = ""
            if measure and len(errors) < 20:
                errors.append(repr(e))
        finally:
            if picker is not None:
                picker.in_flight[server] -= 1
        if not measure:
            return
        statuses[status] = statuses.get(status, 0) + 1
        by_backend[backend] = by_backend.get(backend, 0) + 1
        if status == "200":
            latencies.append(time.monotonic() - started)

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        def launch(measure: bool) -> Coroutine[Any, Any, None]:
            tokens = output_tokens(rng, args.tokens_median, args.tokens_sigma, 1, args.tokens_max)
            return one(session, tokens, measure)

        await open_loop(rng, args.rate, args.warmup, args.duration, launch)
    ok = statuses.get("200", 0)
    return {
        "requests": sum(statuses.values()),
        "ok": ok,
        "errors": sum(statuses.values()) - ok,
        "statuses": statuses,
        "by_backend": by_backend,
        "p50": percentile(latencies, 0.50),
        "p90": percentile(latencies, 0.90),
        "p99": percentile(latencies, 0.99),
        "mean": sum(latencies) / len(latencies) if latencies else float("nan"),
        "error_samples": errors,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", help="HOST:PORT of the Envoy listener")
    p.add_argument(
        "--picker", help="instead of --target: servers as HOST:PORT@SPEED@SLOTS,... picked per request"
    )
    p.add_argument("--service-s", type=float, default=0.375, help="--picker: mean service at speed 1")
    p.add_argument("--model", required=True)
    p.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before measuring")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tokens-median", type=float, default=24.0)
    p.add_argument("--tokens-sigma", type=float, default=0.9)
    p.add_argument("--tokens-max", type=int, default=400)
    p.add_argument("--timeout", type=float, default=120.0, help="per request")
    p.add_argument("--ignore-eos", action="store_true", help="ask for every token (llama.cpp's ignore_eos)")
    args = p.parse_args(argv)
    if not args.target and not args.picker:
        p.error("one of --target or --picker is required")
    summary = asyncio.run(run(args))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
