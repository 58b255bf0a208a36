"""Scrape targets for the signals benchmark, in one process: live servers and hung ones.

  python bench/signals_scale/targets.py --live 500 --hung 1500 --out addresses.txt

Live servers answer /health and /metrics with a full-size vLLM page (the emulator's
`sample_full_page`, 30-60 KB, a dozen histograms), each with its own load values.
Hung servers accept connections (the kernel does) and never answer: every scrape of them
times out, as for a server behind a network that drops packets. Every socket is on
127.0.0.1. Writes the addresses (live first) to --out, prints `ready`, and serves until
stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

from aiohttp import web

from controlplane.sim.emulator_metrics import sample_full_page


def page_for(i: int) -> bytes:
    text = sample_full_page("m", seed=i)
    # Each server's own load: replace the running/waiting gauges' values.
    out = []
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_waiting{"):
            line = line.rsplit(" ", 1)[0] + f" {i % 7}"
        elif line.startswith("vllm:num_requests_running{"):
            line = line.rsplit(" ", 1)[0] + f" {4 + i % 5}"
        out.append(line)
    return ("\n".join(out) + "\n").encode()


async def serve(live: int, hung: int, out: str) -> None:
    runners = []
    addresses = []
    pages = [page_for(i) for i in range(min(live, 64))]  # 64 distinct pages are plenty

    def app_for(i: int) -> web.Application:
        body = pages[i % len(pages)]

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=body, content_type="text/plain")

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        return app

    for i in range(live):
        runner = web.AppRunner(app_for(i), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        addresses.append(f"127.0.0.1:{port}")
        runners.append(runner)
    hung_socks = []
    for _ in range(hung):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # accepted by the kernel (until the backlog fills), never read
        hung_socks.append(s)
        addresses.append(f"127.0.0.1:{s.getsockname()[1]}")
    with open(out, "w") as f:
        f.write("\n".join(addresses) + "\n")
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    for r in runners:
        await r.cleanup()
    for s in hung_socks:
        s.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--live", type=int, default=500)
    p.add_argument("--hung", type=int, default=1500)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    asyncio.run(serve(a.live, a.hung, a.out))


if __name__ == "__main__":
    main()
