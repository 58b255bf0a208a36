"""The collector processes against real sockets: live servers, hung ones and refused ones.

No Envoy here: what is under test is that collection runs in other processes, that the
first round waits at most one scrape timeout however many servers hang, that unreachable
servers are backed off, and that a collector that dies is replaced; and, with the real
`controlplane serve` and emulated servers, that the servers' TTFT and TPOT histograms come
out merged per model version on the control plane's /metrics.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from controlplane.fleet import parse_fleet
from controlplane.obs.metrics import Metrics
from controlplane.signals.collector import CollectorPool
from controlplane.signals.scrape import scrape_targets
from controlplane.signals.store import UNREACHABLE_AFTER
from controlplane.sim.emulator_metrics import TTFT_BUCKETS
from tests.fleets import fleet_yaml
from tests.integration.harness import Client, ControlPlane, Emulator, free_port, http_get, wait_until

PAGE = (
    'vllm:num_requests_running{{model_name="m"}} 2\n'
    'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
    'vllm:kv_cache_usage_perc{{model_name="m"}} 0.25\n'
    'vllm:e2e_request_latency_seconds_sum{{model_name="m"}} 10\n'
    'vllm:e2e_request_latency_seconds_count{{model_name="m"}} 20\n'
)


# Families that are not read, before the ones read, as on a real page: about 40 KB.
FILLER = "".join(f'vllm:iteration_tokens_total_bucket{{le="{i}",model_name="m"}} {i}\n' for i in range(700))


class _Handler(BaseHTTPRequestHandler):
    waiting = 0

    def do_GET(self) -> None:
        waiting = self.server.waiting  # type: ignore[attr-defined]
        body = b"ok" if self.path == "/health" else (FILLER + PAGE.format(waiting=waiting)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        # The page in three writes, apart: a client must read it whole, not what came first.
        third = len(body) // 3
        for part in (body[:third], body[third : 2 * third], body[2 * third :]):
            self.wfile.write(part)
            self.wfile.flush()
            time.sleep(0.01)

    def log_message(self, *args: object) -> None:
        pass


class Fixture:
    def __init__(self) -> None:
        self.live: list[ThreadingHTTPServer] = []
        self.hung: list[socket.socket] = []
        self.refused: list[str] = []

    def address(self, srv: ThreadingHTTPServer) -> str:
        return f"127.0.0.1:{srv.server_address[1]}"

    def start(self, live: int, hung: int, refused: int) -> None:
        for i in range(live):
            srv = ThreadingHTTPServer(("127.0.0.1", free_port()), _Handler)
            srv.waiting = i  # type: ignore[attr-defined]
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self.live.append(srv)
        for _ in range(hung):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(64)  # accepted by the kernel, never read: every request times out
            self.hung.append(s)
        self.refused = [f"127.0.0.1:{free_port()}" for _ in range(refused)]  # nothing listens

    def addresses(self) -> list[str]:
        return (
            [self.address(s) for s in self.live]
            + [f"127.0.0.1:{s.getsockname()[1]}" for s in self.hung]
            + self.refused
        )

    def close(self) -> None:
        for srv in self.live:
            srv.shutdown()
            srv.server_close()
        for s in self.hung:
            s.close()


@pytest.fixture
def servers() -> Iterator[Fixture]:
    f = Fixture()
    try:
        yield f
    finally:
        f.close()


def _fleet(addresses: list[str], interval: str = "500ms", timeout: str = "500ms"):  # type: ignore[no-untyped-def]
    text = fleet_yaml({"m": {"v1": addresses}}).replace(
        "tiers:", f"signals: {{interval: {interval}, timeout: {timeout}}}\ntiers:"
    )
    return parse_fleet(text)


def test_collectors_scrape_outside_wait_one_timeout_back_off_and_are_replaced(servers: Fixture) -> None:
    # More hung servers than a collector has slots (2 x 128): waiting for all of them
    # would take three timeouts; the first round must not.
    servers.start(live=3, hung=600, refused=40)
    fleet = _fleet(servers.addresses())
    targets = scrape_targets(fleet)
    metrics = Metrics()

    async def run() -> None:
        pool = CollectorPool(fleet, metrics, workers=2)
        try:
            # The first round: collectors start, then at most one scrape timeout (0.5 s),
            # however many servers hang.
            started = time.monotonic()
            first = await pool.collect(fleet, targets, first=True)
            waited = time.monotonic() - started
            ready_at = max(w.first_heard_at or 0.0 for w in pool._workers)
            assert time.monotonic() - ready_at < 0.5 + 0.4, f"waited {waited:.2f}s in all"
            # It did not wait for everyone: 300 hung servers per collector take three waves
            # of 128 slots, 1.5 s, to be answered for.
            assert len(first) < len(targets)
            live = {("m", servers.address(s)): i for i, s in enumerate(servers.live)}
            for key, waiting in live.items():
                # Those that got a slot in the first wave read right. A niced collector opening
                # 128 connections on a busy machine may not read a live one within 0.5 s: then
                # it says so as a timeout, never as a wrong sample (the rounds below must read
                # every live one right, five times).
                r = first.get(key)
                if r is not None and r.sample is not None:
                    assert r.sample.waiting == waiting
                elif r is not None:
                    assert "timed out" in (r.metrics_error or r.health_error or ""), r
            for addr in servers.refused:
                if ("m", addr) in first:
                    assert first[("m", addr)].health_error is not None
            # Rounds go on: live servers keep reporting; refused ones are backed off.
            seen: dict[tuple[str, str], int] = dict.fromkeys(live, 0)
            refused_attempts = 0
            # Six seconds, or longer (up to 15 s) until every live server has reported five
            # times: collectors run niced, and a busy machine starves them for a while. The
            # refused ones are counted over the first six seconds only.
            window = time.monotonic()
            while (elapsed := time.monotonic() - window) < 6 or (
                elapsed < 15 and not all(n >= 5 for n in seen.values())
            ):
                await asyncio.sleep(0.1)
                got = await pool.collect(fleet, targets)
                for key, r in got.items():
                    if key in seen:
                        if r.sample is not None:
                            assert r.sample.waiting == live[key], r
                            seen[key] += 1
                    elif key[1] in servers.refused and elapsed < 6:
                        refused_attempts += 1
            assert all(n >= 5 for n in seen.values()), seen
            # 40 refused over 6 s at 2/s would be 480 attempts; backed off after the
            # out-of-sight threshold, far fewer.
            assert refused_attempts < 40 * (UNREACHABLE_AFTER + 4), refused_attempts
            backing_off = metrics.registry.get_sample_value("controlplane_signals_endpoints_backing_off")
            assert backing_off is not None and backing_off >= 40
            assert (
                metrics.registry.get_sample_value("controlplane_signals_collector_cpu_seconds_total") or 0
            ) > 0
            # A collector killed: started again, and the live servers report again.
            victim = pool._workers[0].proc
            assert victim is not None
            victim.kill()
            victim.wait(5)
            await pool.collect(fleet, targets)
            restarts = metrics.registry.get_sample_value(
                "controlplane_signals_collector_restarts_total", {"reason": "exited"}
            )
            assert restarts == 1
            after = dict.fromkeys(live, 0)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not all(after.values()):
                await asyncio.sleep(0.1)
                for key in await pool.collect(fleet, targets):
                    if key in after:
                        after[key] += 1
            assert all(after.values()), after
        finally:
            await pool.close()
        assert all(w.proc is None for w in pool._workers)

    asyncio.run(run())


def _count_on(server: Emulator, name: str) -> float:
    """`name`'s _count on an emulated server's own /metrics page."""
    found = re.search(rf"^{name}_count\S* (\S+)$", http_get(f"http://{server.address}/metrics")[1], re.M)
    return float(found.group(1)) if found else math.nan


def test_the_version_ttft_histogram_is_merged_from_its_servers(tmp_path: Path) -> None:
    """The real `controlplane serve` scraping two real emulated servers of one version (vLLM's
    full page, through the collector processes): after some requests, its own /metrics has
    the version's TTFT and TPOT histograms with the counts the servers served."""
    servers = [
        Emulator(f"srv{i}", tmp_path, "m", decode_ms_per_token=1, prefill_ms_per_token=0.01, slots=4)
        for i in range(2)
    ]
    cp = ControlPlane(tmp_path / "fleet.yaml", tmp_path)
    try:
        yaml = fleet_yaml({"m": {"v1": [s.address for s in servers]}}, port=free_port())
        (tmp_path / "fleet.yaml").write_text(
            yaml.replace("tiers:", "signals: {interval: 250ms, timeout: 250ms}\ntiers:")
        )
        cp.start()
        version = {"model": "m", "version": "v1"}
        ttft = "controlplane_model_time_to_first_token_seconds"
        tpot = "controlplane_model_time_per_output_token_seconds"
        # The servers seen (their first histograms are baselines: nothing served yet).
        wait_until(
            lambda: f'{ttft}_count{{model="m",version="v1"}} 0.0' in cp.metrics_text(),
            10,
            "the version's TTFT histogram to be exported",
        )
        served = 0
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}).encode()
        for i in range(24):
            client = Client(servers[i % 2].port)
            reply = client.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            client.close()
            served += reply.status == 200
        assert served == 24
        # Within scrape timing: a scrape each 250 ms, its record in the next weight round.
        wait_until(
            lambda: cp.metric(f"{ttft}_count", **version) == served, 5, "TTFT _count = requests served"
        )
        assert cp.metric(f"{ttft}_bucket", le="+Inf", **version) == served
        assert sum(_count_on(s, "vllm:time_to_first_token_seconds") for s in servers) == served
        assert cp.metric(f"{ttft}_sum", **version) > 0
        # vLLM's buckets (the emulator's), common to both servers, cumulative.
        text = cp.metrics_text()
        les = re.findall(rf'{ttft}_bucket{{le="([^"+]+)",model="m",version="v1"}}', text)
        assert [float(le) for le in les] == list(TTFT_BUCKETS)
        counts = [cp.metric(f"{ttft}_bucket", le=le, **version) for le in les]
        assert counts == sorted(counts) and counts[-1] <= served
        # TPOT: one observation per output token after the first, as the servers count them.
        per_token = sum(_count_on(s, "vllm:inter_token_latency_seconds") for s in servers)
        assert per_token == served * 2
        wait_until(lambda: cp.metric(f"{tpot}_count", **version) == per_token, 5, "TPOT _count")
    finally:
        cp.stop()
        for s in servers:
            s.stop()
