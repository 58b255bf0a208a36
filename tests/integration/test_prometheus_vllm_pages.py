"""The Prometheus source reads a real vLLM page as the scraper does (issue 32).

A real Prometheus (Debian's package; skipped without it unless CONTROLPLANE_REQUIRE_PROMTOOL
is set) scrapes two loopback servers that serve pages captured from a real vLLM 0.32
(tests/fixtures/pages/vllm/): the busy page as it was, and a data-parallel variant of it
(a second engine, its own KV use, aborted and failed requests counted). The source's
instant queries must give each endpoint the sample `parse_metrics` reads from the same
page: running and waiting summed over engines, KV use their mean, successes without the
aborted and failed requests, the per-token histogram under vLLM 0.32's name.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from controlplane.fleet.loader import parse_fleet
from controlplane.obs.metrics import Metrics
from controlplane.signals.parse import ServerSample, parse_metrics
from controlplane.signals.prometheus import PrometheusSource
from tests.fleets import fleet_yaml
from tests.integration.harness import wait_until
from tests.integration.prometheus import Prometheus, prometheus_binary

PAGES = Path(__file__).parents[1] / "fixtures" / "pages" / "vllm"
MODEL = "tiny-random-llama"  # the served name on the captured pages
FIELDS = (
    "running",
    "waiting",
    "kv_use",
    "latency_sum_s",
    "latency_count",
    "successes",
    "token_latency_sum_s",
    "token_latency_count",
)


def data_parallel(page: str) -> str:
    """The page as a two-engine server prints it: every engine="0" series again for engine
    "1", whose KV use is 0.5, with 3 requests aborted and 2 failed."""
    out: list[str] = []
    for line in page.splitlines():
        out.append(line)
        if line.startswith("#") or 'engine="0"' not in line:
            continue
        twin = line.replace('engine="0"', 'engine="1"')
        name = twin.split("{", 1)[0]
        if name == "vllm:kv_cache_usage_perc":
            twin = re.sub(r" \S+$", " 0.5", twin)
        elif name == "vllm:request_success_total" and 'finished_reason="abort"' in twin:
            twin = re.sub(r" \S+$", " 3.0", twin)
        elif name == "vllm:request_success_total" and 'finished_reason="error"' in twin:
            twin = re.sub(r" \S+$", " 2.0", twin)
        out.append(twin)
    return "\n".join(out) + "\n"


class PageServer:
    """One loopback HTTP server answering GET /metrics with a fixed page."""

    def __init__(self, page: str) -> None:
        body = page.encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pages() -> Iterator[dict[str, tuple[PageServer, str]]]:
    busy = (PAGES / "metrics-busy.txt").read_text()
    servers: dict[str, tuple[PageServer, str]] = {}
    try:
        for name, page in (("one-engine", busy), ("two-engines", data_parallel(busy))):
            servers[name] = (PageServer(page), page)
        yield servers
    finally:
        for server, _ in servers.values():
            server.close()


def test_the_prometheus_source_reads_real_vllm_pages_as_the_scraper_does(
    tmp_path: Path, pages: dict[str, tuple[PageServer, str]]
) -> None:
    binary = prometheus_binary()
    addresses = {name: server.address for name, (server, _) in pages.items()}
    prometheus = Prometheus.scraping(binary, tmp_path, sorted(addresses.values()))
    try:
        wait_until(prometheus.ready, 30, "prometheus to be ready")
        # Both targets scraped, the second engine's series included.
        wait_until(
            lambda: len(prometheus.query("vllm:kv_cache_usage_perc")) == 3, 30, "both pages in Prometheus"
        )
        # Two versions, so that the rollout analysis's success counter is asked too.
        fleet = parse_fleet(
            fleet_yaml({MODEL: {"v1": [addresses["one-engine"]], "v2": [addresses["two-engines"]]}})
            + "signals: {source: prometheus, prometheus: "
            + f"{{url: '{prometheus.url}', interval: 5s, timeout: 5s}}}}\n"
        )
        targets = [(MODEL, a) for a in addresses.values()]

        async def collect() -> dict[str, ServerSample]:
            source = PrometheusSource(fleet, Metrics())
            try:
                results = await source.collect(fleet, targets, first=True)
            finally:
                await source.close()
            out = {}
            for (_, address), result in results.items():
                assert result.sample is not None, (address, result)
                out[address] = result.sample
            return out

        got = asyncio.run(collect())
        assert set(got) == set(addresses.values())
        for name, (server, page) in pages.items():
            want = parse_metrics(page, model=MODEL)
            sample = got[server.address]
            for field in FIELDS:
                assert getattr(sample, field) == pytest.approx(getattr(want, field)), (name, field)
        one, two = got[addresses["one-engine"]], got[addresses["two-engines"]]
        # Figures the test knows on its own, so the comparison cannot pass on a shared mistake.
        assert one.running == 4 and one.waiting == 4  # as the captured page says
        assert two.running == 8 and two.waiting == 8  # summed over the engines
        assert one.kv_use is not None and two.kv_use == pytest.approx((one.kv_use + 0.5) / 2)
        assert two.successes == pytest.approx(2 * (one.successes or 0))  # aborts, errors not counted
        per_token = one.token_latency_count
        assert per_token and two.token_latency_count == pytest.approx(2 * per_token)
    finally:
        prometheus.stop()
