"""A collector process: scrapes its share of the endpoints, parses the pages, and sends
compact load records to the control plane (I/O shell; runs outside the xDS process).

Each endpoint is scraped on its own schedule (`signals/schedule.py`: spread over the
interval, backing off from unreachable ones); at most `concurrency` scrapes run at once
per lane (one lane for endpoints that answered last time, one for those that did not,
so hung servers never delay live ones), and a scrape's timeout starts when it gets a
slot, not while it waits for one. Pages are
parsed here (`parse_metrics`, only the families read), so the control plane receives a
`ScrapeResult` with a `ServerSample`, never a page. A llama.cpp page of a model with
adapters is followed by a GET of the server's /lora-adapters (signals/llamacpp_adapters.py),
in the same lane, with the same timeout. Records go out in batches every
`FLUSH_S`, with the process's counters (CPU seconds, pages, bytes, lag, back-off).

A sample's TTFT and TPOT histograms (about 40 buckets, most of a record's bytes) are sent
only when they changed since the endpoint's previous record, and whole every `REFRESH_S`
in any case, so a record lost on the way (or collapsed into a later one) costs at most that
long; None on the control plane's side means "unchanged" (signals/model_latency.py). Each is
stamped with a lifetime id (`ServerHistogram.life`, new when a counter went down), so the
control plane need not compare buckets to tell a restarted server.

The process runs at a lower scheduling priority (`NICE`) than the control plane: when the
machine is short of CPU, serving xDS wins. It exits when the control plane goes away.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import os
import random
import resource
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from controlplane.net.http import client_session
from controlplane.signals import llamacpp_adapters
from controlplane.signals.parse import (
    MetricsPageInvalid,
    ServerHistogram,
    ServerSample,
    parse_metrics,
    same_life,
)
from controlplane.signals.probe import Probe, Prober, at_port
from controlplane.signals.schedule import Schedule
from controlplane.signals.stalls import LoopStalls
from controlplane.signals.store import EndpointKey, ScrapeResult, fetch_error, page_error

FLUSH_S = 0.05  # records are sent at most this long after their scrape ended
NICE = 10  # collectors yield the CPU to the xDS process
REFRESH_S = 10.0  # unchanged latency histograms are sent again after this long


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
    stalled_s: float = 0.0  # seconds the event loop stood still (starved of CPU, or frozen)


# What a collector keeps of one histogram of an endpoint: the last read, its lifetime id.
_Kept = tuple[ServerHistogram, int]


class SentHistograms:
    """Per endpoint, the TTFT and TPOT histograms last read, with their lifetime ids, and when
    they were last sent whole: what `changed_only` leaves out of a record."""

    def __init__(self) -> None:
        self._last: dict[EndpointKey, tuple[_Kept | None, _Kept | None, float]] = {}
        # Lifetime ids, unique to this process (a collector started again never reuses one).
        self._lives = itertools.count(random.getrandbits(40) << 20 | 1)

    def retain(self, keys: set[EndpointKey]) -> None:
        """Forget endpoints no longer scraped (one that comes back is sent whole)."""
        self._last = {k: v for k, v in self._last.items() if k in keys}

    def changed_only(self, key: EndpointKey, sample: ServerSample, now: float) -> ServerSample:
        """The sample with each histogram None where unchanged since the endpoint's previous
        record (both whole every REFRESH_S), and stamped with its lifetime id: a new one
        whenever it is not `same_life` with the previous one read."""
        if sample.ttft is None and sample.tpot is None:
            self._last.pop(key, None)
            return sample
        last = self._last.get(key)
        whole = last is None or now - last[2] >= REFRESH_S
        ttft, kept_ttft = self._one(sample.ttft, last[0] if last else None, whole)
        tpot, kept_tpot = self._one(sample.tpot, last[1] if last else None, whole)
        self._last[key] = (kept_ttft, kept_tpot, last[2] if last is not None and not whole else now)
        return dataclasses.replace(sample, ttft=ttft, tpot=tpot)

    def _one(
        self, h: ServerHistogram | None, kept: _Kept | None, whole: bool
    ) -> tuple[ServerHistogram | None, _Kept | None]:
        if h is None:
            return None, None
        if kept is not None and h == kept[0]:
            life = kept[1]
            if not whole:
                return None, kept
        elif kept is not None and same_life(kept[0], h):
            life = kept[1]
        else:
            life = next(self._lives)
        return ServerHistogram(h.bounds, h.counts, h.count, h.sum, life), (h, life)


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
        self.prober: Prober | None = None
        self.stalls: LoopStalls | None = None
        self.probes: dict[EndpointKey, Probe] = {}  # targets probed otherwise than by default
        self.default_probe = Probe()  # the fleet's signals paths on the serving port
        self.tasks: set[asyncio.Task[None]] = set()
        self.histograms = SentHistograms()

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
            settings, targets, first, self.probes = body
            now = time.monotonic()
            if settings.concurrency != self.settings.concurrency:
                self.sem = asyncio.Semaphore(settings.concurrency)
                self.failing_sem = asyncio.Semaphore(settings.concurrency)
            self.settings = settings
            self.default_probe = Probe(health_path=settings.health_path, metrics_path=settings.metrics_path)
            self.schedule.set_interval(settings.interval_s, now)
            self.schedule.set_targets(targets, now, first=first)
            self.histograms.retain(set(targets))
            if self.prober is not None:  # close gRPC channels to servers no longer probed
                keep = {at_port(k[1], p.health_port) for k, p in self.probes.items() if p.health == "grpc"}
                task = asyncio.ensure_future(self.prober.forget(keep))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        self.wake.set()

    # -- the loop

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._reader, args=(loop,), daemon=True, name="collector-reader").start()
        session = client_session(
            limit=0,
            limit_per_host=2,
            headers={"User-Agent": "inference-controlplane-scraper"},
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",),  # plain text: nothing to decompress
        )
        stalls = LoopStalls(time.monotonic())
        self.stalls = stalls
        self.prober = Prober(session, stalls)
        ticker = asyncio.create_task(stalls.run())
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
            ticker.cancel()
            flusher.cancel()
            for t in list(self.tasks):
                t.cancel()
            await self.prober.close()
            await session.close()

    async def _one(self, key: EndpointKey, due: float) -> None:
        s = self.settings
        assert self.prober is not None
        probe = self.probes.get(key) or self.default_probe
        # Two lanes: endpoints whose last scrape failed wait for their own slots, so a fleet
        # of hung servers (each holding a slot for the whole timeout) never delays the
        # scrapes of the ones that answer.
        failing = bool(self.schedule.failures.get(key))
        lane = self.failing_sem if failing else self.sem
        async with lane:
            started = time.monotonic()
            self.stats.max_lag_s = max(self.stats.max_lag_s, started - due)
            # It did not answer last time: one health probe; the page only if it answers.
            r = await self.prober.probe(key[1], probe, s.timeout_s, health_first=failing)
        reached = r.reached
        self.stats.scrapes += 1
        if not reached:
            self.stats.unreachable += 1
        sample = None
        error = fetch_error(probe.metrics_path, r.metrics_status, r.metrics_error)
        if error is not None and error.reason == "http_error":
            self.stats.http_errors += 1
        if error is None and r.body is not None:
            self.stats.pages += 1
            self.stats.page_bytes += len(r.body)
            t0 = time.perf_counter()
            try:
                sample = parse_metrics(r.body.decode("utf-8", errors="replace"), key[0])
            except MetricsPageInvalid as e:
                error = page_error(e)
                self.stats.unreadable += 1
            self.stats.parse_s += time.perf_counter() - t0
            if sample is not None and llamacpp_adapters.wanted(sample, probe):
                async with lane:  # llama.cpp's adapters are not on its page: one more GET
                    sample = await llamacpp_adapters.with_adapters(
                        sample, self.prober, key[1], probe, s.timeout_s
                    )
            if sample is not None:
                sample = self.histograms.changed_only(key, sample, time.monotonic())
        self.outbox.append(
            (
                key,
                ScrapeResult(
                    health_status=r.health_status,
                    health_error=r.health_error,
                    metrics_error=None if error is None else error.text,
                    sample=sample,
                    reached=reached,
                    error_reason=None if error is None else error.reason,
                    serving_refused=r.serving_refused,
                ),
            )
        )
        self.schedule.done(key, due, reached, time.monotonic())
        self.wake.set()

    async def _flush_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FLUSH_S)
            batch, self.outbox = self.outbox, []
            self.stats.backing_off = self.schedule.backing_off()
            self.stats.endpoints = len(self.schedule)
            self.stats.cpu_s = time.process_time()
            if self.stalls is not None:
                self.stats.stalled_s = self.stalls.stalled_s
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
