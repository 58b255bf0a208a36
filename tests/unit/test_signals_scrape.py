"""The in-process scrape source (signals/scrape.py): the reason class of a scrape that read no
page; the page itself is parsed by the store."""

from __future__ import annotations

import asyncio

from controlplane.signals.probe import Probe, ProbeResult
from controlplane.signals.scrape import Scraper
from controlplane.signals.store import ScrapeResult


class FakeProber:
    def __init__(self, result: ProbeResult) -> None:
        self.result = result

    async def probe(self, address: str, probe: Probe, timeout_s: float) -> ProbeResult:
        return self.result


def scraped(result: ProbeResult) -> ScrapeResult:
    scraper = Scraper(0.5)
    scraper._client = lambda: FakeProber(result)  # type: ignore[assignment,method-assign,return-value]
    return asyncio.run(scraper._scrape("127.0.0.1:8000", scraper.default))


def test_a_scrape_that_read_no_page_says_why() -> None:
    assert (
        scraped(ProbeResult(None, "refused", None, None, "GET /metrics failed")).error_reason == "unreachable"
    )
    not_found = scraped(ProbeResult(200, None, 404, b"no", None))
    assert (not_found.metrics_error, not_found.error_reason) == (
        "GET /metrics answered HTTP 404",
        "http_error",
    )
    assert scraped(ProbeResult(200, None, 200, None, "page is over the limit")).error_reason == "unreadable"
    page = scraped(ProbeResult(200, None, 200, b"vllm:num_requests_running 1\n", None))
    assert (page.error_reason, page.metrics_text) == (None, "vllm:num_requests_running 1\n")
