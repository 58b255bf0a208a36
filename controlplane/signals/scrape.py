"""Scrape every endpoint's /health and /metrics concurrently, each bounded in time (I/O shell).

One aiohttp session with keep-alive connections is reused across rounds. A server that
hangs costs its own timeout and nothing else: every endpoint is scraped in parallel and a
round takes at most `timeout_s` (plus scheduling).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import aiohttp

from controlplane.fleet.model import Fleet
from controlplane.signals.collector_worker import fetch
from controlplane.signals.store import EndpointKey, ScrapeResult


def scrape_targets(fleet: Fleet) -> list[EndpointKey]:
    """Every (model, address) the fleet lists, in fleet order, without repeats."""
    seen: dict[EndpointKey, None] = {}
    for m in fleet.models:
        for v in m.versions:
            for ep in v.endpoints:
                seen[(m.name, ep.address)] = None
    return list(seen)


class Scraper:
    """Reusable HTTP client for scrape rounds. Close it with `close()`."""

    def __init__(self, timeout_s: float, metrics_path: str = "/metrics", health_path: str = "/health"):
        self.timeout_s = timeout_s
        self.metrics_path = metrics_path
        self.health_path = health_path
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, limit_per_host=2, force_close=False),
                headers={"User-Agent": "inference-controlplane-scraper"},
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def scrape_round(self, targets: Iterable[EndpointKey]) -> dict[EndpointKey, ScrapeResult]:
        """Scrape all targets at once; every result arrives within the timeout."""
        keys = list(targets)
        results = await asyncio.gather(*(self._scrape(addr) for _, addr in keys))
        return dict(zip(keys, results, strict=True))

    async def _scrape(self, address: str) -> ScrapeResult:
        health, metrics = await asyncio.gather(
            self._get(address, self.health_path, want_body=False),
            self._get(address, self.metrics_path, want_body=True),
        )
        h_status, _, h_err = health
        m_status, text, m_err = metrics
        if m_err is None and m_status is not None and m_status != 200:
            m_err = f"GET {self.metrics_path} answered HTTP {m_status}"
        return ScrapeResult(
            health_status=h_status,
            health_error=h_err,
            metrics_text=text if m_err is None else None,
            metrics_error=m_err,
        )

    async def _get(
        self, address: str, path: str, *, want_body: bool
    ) -> tuple[int | None, str | None, str | None]:
        """(status, body, error): error is set when no HTTP answer came in time."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        status, body, error = await fetch(
            self._client(), f"http://{address}{path}", path, timeout, want_body=want_body
        )
        return status, body.decode("utf-8", errors="replace") if body is not None else None, error


class InlineScrapeSource:
    """The `scrape` source in this process: one concurrent round per call (tests, tools)."""

    def __init__(self, fleet: Fleet) -> None:
        s = fleet.signals
        self._settings = (s.timeout_s, s.metrics_path, s.health_path)
        self.scraper = Scraper(*self._settings)

    def matches(self, fleet: Fleet) -> bool:
        s = fleet.signals
        return (s.timeout_s, s.metrics_path, s.health_path) == self._settings

    async def collect(
        self, fleet: Fleet, targets: Sequence[EndpointKey], *, first: bool = False
    ) -> dict[EndpointKey, ScrapeResult]:
        return await self.scraper.scrape_round(targets)

    async def close(self) -> None:
        await self.scraper.close()
