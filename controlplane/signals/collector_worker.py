"""A collector process: scrapes its share of the endpoints, parses the pages, and sends
compact load records to the control plane (I/O shell; runs outside the xDS process).

Each endpoint is scraped on its own schedule (`signals/schedule.py`: spread over the
interval, backing off from unreachable ones); at most `concurrency` scrapes run at once
per lane (one lane for endpoints that answered last time, one for those that did not,
so hung servers never delay live ones), and a scrape's timeout starts when it gets a
slot, not while it waits for one. Pages are
parsed here (`parse_metrics`, only the families read), so the control plane receives a
`ScrapeResult` with a `ServerSample`, never a page. Records go out in batches every
`FLUSH_S`, with the process's counters (CPU seconds, pages, bytes, lag, back-off).

The process runs at a lower scheduling priority (`NICE`) than the control plane: when the
machine is short of CPU, serving xDS wins. It exits when the control plane goes away.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
from yarl import URL

from controlplane.signals.parse import MetricsPageInvalid, parse_metrics
from controlplane.signals.schedule import Schedule
from controlplane.signals.store import EndpointKey, ScrapeResult

MAX_PAGE_BYTES = 4 << 20  # a metrics page larger than this is refused, not buffered
FLUSH_S = 0.05  # records are sent at most this long after their scrape ended
NICE = 10  # collectors yield the CPU to the xDS process


@dataclass(frozen=True)
class Settings:
    interval_s: float = 1.0
    timeout_s: float = 0.5
    metrics_path: str = "/metrics"
    health_path: str = "/health"
    concurrency: int = 128


@dataclass
class Stats:
    """Cumulative counters of one collector process (sent with every batch)."""

    scrapes: int = 0
    pages: int = 0
    page_bytes: int = 0
    unreachable: int = 0
    http_errors: int = 0
    unreadable: int = 0
    parse_s: float = 0.0
    max_lag_s: float = 0.0  # the latest start after its due time since the last batch
    backing_off: int = 0
    endpoints: int = 0
    cpu_s: float = 0.0


async def fetch(
    session: aiohttp.ClientSession,
    url: URL | str,
    path: str,
    timeout: aiohttp.ClientTimeout,
    *,
    want_body: bool,
) -> tuple[int | None, bytes | None, str | None]:
    """One GET: (status, body, error); error is set when no usable HTTP answer came in time.
    A body over MAX_PAGE_BYTES is refused, not buffered."""
    try:
        async with session.get(url, timeout=timeout) as resp:
            if not want_body:
                return resp.status, None, None
            if resp.content_length is not None and resp.content_length > MAX_PAGE_BYTES:
                return resp.status, None, f"page of {resp.content_length} bytes is over the limit"
            body = await read_page(resp.content, MAX_PAGE_BYTES)
            if body is None:
                return resp.status, None, f"page is over the {MAX_PAGE_BYTES} byte limit"
            return resp.status, body, None
    except TimeoutError:
        return None, None, f"GET {path} timed out after {timeout.total:g}s"
    except aiohttp.ClientError as e:
        return None, None, f"GET {path} failed: {e.__class__.__name__}: {e}"
    except OSError as e:
        return None, None, f"GET {path} failed: {e}"


async def read_page(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body, however many reads it arrives in (`read(n)` returns what has arrived,
    not n bytes), or None once it is over `limit` bytes."""
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = await content.read(1 << 16)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)


def main(argv: list[str] | None = None) -> None:
    """The process entry point: `python -m controlplane.signals.collector_worker --fd N
    --worker I`, started by CollectorPool with one end of a socket pair as fd N."""
    p = argparse.ArgumentParser(description="a signal collector process (started by the control plane)")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--worker", type=int, default=0)
    a = p.parse_args(argv)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    with contextlib.suppress(OSError, ValueError):
        # Two sockets per scrape in flight, two lanes: room for them whatever the default.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the control plane stops us (Ctrl-C hits both)
    asyncio.run(_Worker(Connection(a.fd), a.worker).run())


class _Worker:
    def __init__(self, conn: Connection, worker_id: int) -> None:
        self.conn = conn
        self.settings = Settings()
        self.schedule = Schedule(self.settings.interval_s, seed=worker_id)
        self.outbox: list[tuple[EndpointKey, ScrapeResult]] = []
        self.stats = Stats()
        self.stop = asyncio.Event()
        self.wake = asyncio.Event()
        self.sem = asyncio.Semaphore(self.settings.concurrency)
        self.failing_sem = asyncio.Semaphore(self.settings.concurrency)
        self.session: aiohttp.ClientSession | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        # Built once per target, not per request (URL parsing is a good share of a request).
        self._urls: dict[tuple[str, str], URL] = {}
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    # -- messages from the control plane (a reader thread hands them to the loop)

    def _reader(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the control plane is gone: so are we
            loop.call_soon_threadsafe(self._apply, msg)

    def _apply(self, msg: tuple[str, Any]) -> None:
        kind, body = msg
        if kind == "stop":
            self.stop.set()
        elif kind == "config":
            settings, targets, first = body
            now = time.monotonic()
            if settings.concurrency != self.settings.concurrency:
                self.sem = asyncio.Semaphore(settings.concurrency)
                self.failing_sem = asyncio.Semaphore(settings.concurrency)
            self.settings = settings
            self.schedule.set_interval(settings.interval_s, now)
            self.schedule.set_targets(targets, now, first=first)
        self.wake.set()

    # -- the loop

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._reader, args=(loop,), daemon=True, name="collector-reader").start()
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=2, force_close=False),
            headers={"User-Agent": "inference-controlplane-scraper"},
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",),  # plain text: nothing to decompress
        )
        flusher = asyncio.create_task(self._flush_forever())
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                for key, due in self.schedule.due(now):
                    task = asyncio.create_task(self._one(key, due))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                nxt = self.schedule.next_due()
                wait = 0.5 if nxt is None else min(0.5, max(0.0, nxt - time.monotonic()))
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), timeout=wait)
        finally:
            flusher.cancel()
            for t in list(self.tasks):
                t.cancel()
            await self.session.close()

    async def _one(self, key: EndpointKey, due: float) -> None:
        s = self.settings
        # Two lanes: endpoints whose last scrape failed wait for their own slots, so a fleet
        # of hung servers (each holding a slot for the whole timeout) never delays the
        # scrapes of the ones that answer.
        lane = self.failing_sem if self.schedule.failures.get(key) else self.sem
        async with lane:
            started = time.monotonic()
            self.stats.max_lag_s = max(self.stats.max_lag_s, started - due)
            if lane is self.failing_sem:
                # It did not answer last time: one probe of /health; the page only if it answers.
                h_status, _, h_err = await self._get(key[1], s.health_path, s.timeout_s, want_body=False)
                if h_status is None:
                    m_status, body, m_err = None, None, h_err
                else:
                    m_status, body, m_err = await self._get(
                        key[1], s.metrics_path, s.timeout_s, want_body=True
                    )
            else:
                (h_status, _, h_err), (m_status, body, m_err) = await asyncio.gather(
                    self._get(key[1], s.health_path, s.timeout_s, want_body=False),
                    self._get(key[1], s.metrics_path, s.timeout_s, want_body=True),
                )
        reached = h_status is not None or m_status is not None
        self.stats.scrapes += 1
        if not reached:
            self.stats.unreachable += 1
        sample = None
        if m_err is None and m_status is not None and m_status != 200:
            m_err = f"GET {s.metrics_path} answered HTTP {m_status}"
            self.stats.http_errors += 1
        if m_err is None and body is not None:
            self.stats.pages += 1
            self.stats.page_bytes += len(body)
            t0 = time.perf_counter()
            try:
                sample = parse_metrics(body.decode("utf-8", errors="replace"), key[0])
            except MetricsPageInvalid as e:
                m_err = f"unreadable metrics page: {e}"
                self.stats.unreadable += 1
            self.stats.parse_s += time.perf_counter() - t0
        self.outbox.append(
            (
                key,
                ScrapeResult(health_status=h_status, health_error=h_err, metrics_error=m_err, sample=sample),
            )
        )
        self.schedule.done(key, due, reached, time.monotonic())
        self.wake.set()

    async def _get(
        self, address: str, path: str, timeout_s: float, *, want_body: bool
    ) -> tuple[int | None, bytes | None, str | None]:
        """(status, body, error): error is set when no usable HTTP answer came in time."""
        assert self.session is not None
        timeout = self._timeouts.get(timeout_s)
        if timeout is None:
            timeout = self._timeouts[timeout_s] = aiohttp.ClientTimeout(total=timeout_s)
        url = self._urls.get((address, path))
        if url is None:
            if len(self._urls) > 65536:
                self._urls.clear()
            url = self._urls[(address, path)] = URL.build(scheme="http", authority=address, path=path)
        return await fetch(self.session, url, path, timeout, want_body=want_body)

    async def _flush_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FLUSH_S)
            batch, self.outbox = self.outbox, []
            self.stats.backing_off = self.schedule.backing_off()
            self.stats.endpoints = len(self.schedule)
            self.stats.cpu_s = time.process_time()
            stats = Stats(**vars(self.stats))
            self.stats.max_lag_s = 0.0
            try:
                await loop.run_in_executor(None, self.conn.send, ("results", (batch, stats)))
            except (OSError, ValueError):
                os._exit(0)


if __name__ == "__main__":
    # Run as the named module, not __main__: the records' classes must pickle by their
    # importable names (controlplane.signals.collector_worker.Stats), as the control plane
    # unpickles them.
    from controlplane.signals import collector_worker

    collector_worker.main()
