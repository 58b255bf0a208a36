"""Probe every endpoint's health and metrics concurrently, each bounded in time (I/O shell).

One aiohttp session with keep-alive connections is reused across rounds. A server that
hangs costs its own timeout and nothing else: every endpoint is scraped in parallel and a
round takes at most `timeout_s` (plus scheduling), twice that for a llama.cpp server of a
model with adapters, whose /lora-adapters is asked once its page is read
(signals/llamacpp_adapters.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping, Sequence

from controlplane.fleet.model import Fleet
from controlplane.net.http import client_session
from controlplane.signals import llamacpp_adapters
from controlplane.signals.parse import MetricsPageInvalid, parse_metrics
from controlplane.signals.probe import Probe, Prober, probes_of
from controlplane.signals.store import EndpointKey, ScrapeResult, fetch_error


def scrape_targets(fleet: Fleet) -> list[EndpointKey]:
    """Every (model, address) the fleet lists, in fleet order, without repeats."""
    seen: dict[EndpointKey, None] = {}
    for m in fleet.models:
        for v in m.versions:
            for ep in v.endpoints:
                seen[(m.name, ep.address)] = None
    return list(seen)


class Scraper:
    """Reusable HTTP (and gRPC health) client for scrape rounds. Close it with `close()`."""

    def __init__(self, timeout_s: float, metrics_path: str = "/metrics", health_path: str = "/health"):
        self.timeout_s = timeout_s
        self.default = Probe(health_path=health_path, metrics_path=metrics_path)
        self._prober: Prober | None = None

    def _client(self) -> Prober:
        if self._prober is None or self._prober.session.closed:
            self._prober = Prober(
                client_session(
                    limit=256, limit_per_host=2, headers={"User-Agent": "inference-controlplane-scraper"}
                )
            )
        return self._prober

    async def close(self) -> None:
        if self._prober is not None:
            await self._prober.close()
            await self._prober.session.close()

    async def scrape_round(
        self, targets: Iterable[EndpointKey], probes: Mapping[EndpointKey, Probe] | None = None
    ) -> dict[EndpointKey, ScrapeResult]:
        """Scrape all targets at once; every result arrives within the timeout."""
        keys = list(targets)
        probes = probes or {}
        results = await asyncio.gather(*(self._scrape(k[1], probes.get(k, self.default), k[0]) for k in keys))
        return dict(zip(keys, results, strict=True))

    async def _scrape(self, address: str, probe: Probe, model: str | None = None) -> ScrapeResult:
        client = self._client()
        r = await client.probe(address, probe, self.timeout_s)
        error = fetch_error(probe.metrics_path, r.metrics_status, r.metrics_error)
        text = r.body.decode("utf-8", errors="replace") if r.body is not None and error is None else None
        sample = None
        if text is not None and probe.adapters:
            # A llama.cpp page's adapters are read from its server: the page is parsed here to
            # tell (a page refused is left to the store, which says why).
            with contextlib.suppress(MetricsPageInvalid):
                sample = parse_metrics(text, model)
            if sample is not None:
                sample = await llamacpp_adapters.with_adapters(sample, client, address, probe, self.timeout_s)
                text = None
        return ScrapeResult(
            health_status=r.health_status,
            health_error=r.health_error,
            metrics_text=text,
            sample=sample,
            metrics_error=None if error is None else error.text,
            reached=r.reached,
            error_reason=None if error is None else error.reason,
            serving_refused=r.serving_refused,
        )


class InlineScrapeSource:
    """The `scrape` source in this process: one concurrent round per call (tests, tools)."""

    failing: str | None = None  # every call is a whole round: nothing to fall behind

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
        return await self.scraper.scrape_round(targets, probes_of(fleet))

    async def close(self) -> None:
        await self.scraper.close()
