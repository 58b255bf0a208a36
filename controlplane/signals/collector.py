"""The `scrape` signal source: collector processes scrape and parse; this process merges.

The process that serves xDS never scrapes or parses. `CollectorPool` starts collector
processes (`collector_worker.py`, sized to the cores: one per core but one, at least one,
at most `MAX_WORKERS`) and gives each a share of the endpoints (by a hash of the address,
stable as the fleet changes). Each scrapes its share on its own schedule and sends back
compact records (a parsed `ServerSample` per endpoint, its latency histograms only when
they changed); a reader thread per process puts them in an inbox, and each weight round
takes what arrived (`collect`), at once: the latest record per endpoint.

A collector that dies is started again (its endpoints' signals age meanwhile and fade to
capacity, as for an unreadable page); one that stops reporting for `STUCK_AFTER_S` (or
five intervals, whichever is longer) is killed and started again. Nothing here waits on a
collector, except the very first round, which waits for the collectors to start and then
at most one scrape timeout for first signals.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection

import structlog

from controlplane.fleet.model import Fleet
from controlplane.obs.metrics import Metrics
from controlplane.signals.collector_worker import Settings, Stats
from controlplane.signals.probe import Probe, probes_of
from controlplane.signals.store import EndpointKey, ScrapeResult

log = structlog.get_logger("controlplane.signals")

MAX_WORKERS = 8
STUCK_AFTER_S = 10.0
START_TIMEOUT_S = 15.0  # a collector that has not reported by then is started again
CONCURRENCY = 128  # scrapes in flight per collector
# A collector reports every FLUSH_S (50 ms), records or not: one not heard for this long is
# not collecting (starved of CPU, stuck, or starting again), and the source counts as failing.
SILENT_S = 1.0


def default_workers() -> int:
    """One collector per core but one (the xDS process keeps a core), at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(MAX_WORKERS, cores - 1))


def settings_of(fleet: Fleet) -> Settings:
    s = fleet.signals
    return Settings(s.interval_s, s.timeout_s, s.metrics_path, s.health_path, CONCURRENCY)


def _later(earlier: ScrapeResult, later: ScrapeResult) -> ScrapeResult:
    """Two records of one endpoint in one round: the later stands, with the earlier's TTFT and
    TPOT histograms where it has none (a collector leaves out histograms unchanged since its
    previous record, which here is `earlier`)."""
    a, b = earlier.sample, later.sample
    if a is None or b is None:
        return later
    ttft = b.ttft if b.ttft is not None else a.ttft
    tpot = b.tpot if b.tpot is not None else a.tpot
    if ttft is b.ttft and tpot is b.tpot:
        return later
    return dataclasses.replace(later, sample=dataclasses.replace(b, ttft=ttft, tpot=tpot))


class _Worker:
    """One collector process and the thread that reads its records."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.started_at = 0.0
        self.heard_at: float | None = None  # its latest report
        self.first_heard_at: float | None = None  # its first report since it was started
        self.sent: tuple[Settings, tuple[EndpointKey, ...], dict[EndpointKey, Probe]] | None = None
        self.stats = Stats()
        self.counted = Stats()  # what was already added to the counters


class CollectorPool:
    """SignalSource `scrape`: collector processes, merged here."""

    def __init__(self, fleet: Fleet, metrics: Metrics, workers: int | None = None) -> None:
        self.metrics = metrics.collectors
        self.n = workers or default_workers()
        self._inbox: collections.deque[tuple[EndpointKey, ScrapeResult]] = collections.deque()
        self._lock = threading.Lock()
        self._workers = [_Worker(i) for i in range(self.n)]
        self._closed = False
        self._first_done = False
        self._probes: tuple[Fleet | None, dict[EndpointKey, Probe]] = (None, {})
        for w in self._workers:
            self._start(w)

    # -- processes

    def _start(self, w: _Worker) -> None:
        # A fresh interpreter (`python -m ...collector_worker`), not a fork of this process
        # (threads, gRPC) nor multiprocessing's spawn (which re-imports our __main__), talking
        # over a socket pair.
        ours, theirs = socket.socketpair()
        with theirs:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "controlplane.signals.collector_worker",
                    "--fd",
                    str(theirs.fileno()),
                    "--worker",
                    str(w.index),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        conn = Connection(ours.detach())
        w.proc, w.conn, w.started_at, w.heard_at, w.sent = proc, conn, time.monotonic(), None, None
        w.first_heard_at = None
        w.counted = Stats()
        reader = threading.Thread(target=self._read, args=(w, conn), daemon=True, name=f"collector-{w.index}")
        reader.start()

    def _read(self, w: _Worker, conn: Connection) -> None:
        while True:
            try:
                kind, (batch, stats) = conn.recv()
            except (EOFError, OSError, ValueError, TypeError):
                return
            if kind != "results":
                continue
            with self._lock:
                if conn is not w.conn:
                    return  # replaced meanwhile
                self._inbox.extend(batch)
                w.stats = stats
                w.heard_at = time.monotonic()
                if w.first_heard_at is None:
                    w.first_heard_at = w.heard_at

    def _stop(self, w: _Worker) -> None:
        """Stop a collector and wait for it (a thread's work: it may take seconds)."""
        conn, proc = w.conn, w.proc
        w.conn = w.proc = None
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop", None))
            conn.close()
        if proc is not None:
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5.0)

    def _discard(self, w: _Worker) -> None:
        """Stop a collector that is being replaced, without blocking the event loop: it
        exited, or went silent (stuck), so it is killed at once and reaped by a thread. (It
        used to be waited for here, up to 6 s inside a weight round on a loaded machine,
        where a process slow to die failed the round.)"""
        conn, proc = w.conn, w.proc
        w.conn = w.proc = None
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            threading.Thread(target=proc.wait, name=f"reap-collector-{w.index}", daemon=True).start()

    def _watch(self, interval_s: float) -> None:
        """Start again a collector that died or went silent."""
        now = time.monotonic()
        silent_after = max(STUCK_AFTER_S, 5 * interval_s)
        for w in self._workers:
            reason = None
            if w.proc is None or w.proc.poll() is not None:
                reason = "exited"
            elif w.heard_at is None and now - w.started_at > START_TIMEOUT_S:
                reason = "never reported"
            elif w.heard_at is not None and now - w.heard_at > silent_after:
                reason = "silent"
            if reason is not None:
                code = w.proc.returncode if w.proc is not None else None
                log.warning("collector restarted", collector=w.index, reason=reason, exit_code=code)
                self.metrics.restarts.labels(reason).inc()
                self._discard(w)
                self._start(w)

    # -- SignalSource

    def matches(self, fleet: Fleet) -> bool:
        return getattr(fleet.signals, "source", "scrape") == "scrape"

    @property
    def failing(self) -> str | None:
        """Which collector processes are not reporting (exited, starting again, or silent for
        over `SILENT_S`): their share of the endpoints gets no fresh signals meanwhile."""
        now = time.monotonic()
        with self._lock:
            down = [
                w.index
                for w in self._workers
                if w.proc is None
                or w.proc.poll() is not None
                or w.heard_at is None
                or now - w.heard_at > SILENT_S
            ]
        if not down:
            return None
        return f"collector processes not reporting: {', '.join(map(str, down))} (of {self.n})"

    async def collect(
        self, fleet: Fleet, targets: Sequence[EndpointKey], *, first: bool = False
    ) -> Mapping[EndpointKey, ScrapeResult]:
        settings = settings_of(fleet)
        self._watch(settings.interval_s)
        shares: list[list[EndpointKey]] = [[] for _ in range(self.n)]
        for key in targets:
            shares[zlib.crc32(key[1].encode()) % self.n].append(key)
        first = first or not self._first_done
        probes = self._probes_of(fleet, settings)
        for w, share in zip(self._workers, shares, strict=True):
            mine = {k: probes[k] for k in share if k in probes}
            sent = (settings, tuple(share), mine)
            if w.sent != sent and w.conn is not None:
                with contextlib.suppress(OSError, ValueError):
                    w.conn.send(("config", (settings, share, first, mine)))
                    w.sent = sent
        out: dict[EndpointKey, ScrapeResult] = {}
        if first:
            await self._first_signals(settings, set(targets), out)
            self._first_done = True
        self._drain(out)
        self._export()
        return out

    def _probes_of(self, fleet: Fleet, settings: Settings) -> dict[EndpointKey, Probe]:
        """The targets probed otherwise than the default (HTTP health and metrics on the
        serving port), worked out once per fleet."""
        cached_for, probes = self._probes
        if cached_for is not fleet:
            default = Probe(health_path=settings.health_path, metrics_path=settings.metrics_path)
            probes = {k: p for k, p in probes_of(fleet).items() if p != default}
            self._probes = (fleet, probes)
        return probes

    async def _first_signals(
        self, settings: Settings, wanted: set[EndpointKey], out: dict[EndpointKey, ScrapeResult]
    ) -> None:
        """Wait for the collectors to start (bounded), then at most one scrape timeout."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and any(w.heard_at is None for w in self._workers):
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + settings.timeout_s + 0.05
        while time.monotonic() < deadline:
            self._drain(out)
            if wanted <= out.keys():
                return
            await asyncio.sleep(0.01)

    def _drain(self, out: dict[EndpointKey, ScrapeResult]) -> None:
        n = 0
        while True:
            try:
                key, result = self._inbox.popleft()
            except IndexError:
                break
            earlier = out.get(key)
            out[key] = result if earlier is None else _later(earlier, result)
            n += 1
        if n:
            self.metrics.records.inc(n)

    def _export(self) -> None:
        m = self.metrics
        live = 0
        lag = 0.0
        backing_off = 0
        with self._lock:
            for w in self._workers:
                s, c = w.stats, w.counted
                if w.heard_at is not None and w.proc is not None and w.proc.poll() is None:
                    live += 1
                lag = max(lag, s.max_lag_s)
                backing_off += s.backing_off
                m.cpu.inc(max(0.0, s.cpu_s - c.cpu_s))
                m.stalled.inc(max(0.0, s.stalled_s - c.stalled_s))
                ok = (s.scrapes - s.unreachable - s.http_errors - s.unreadable) - (
                    c.scrapes - c.unreachable - c.http_errors - c.unreadable
                )
                m.scrapes.labels("ok").inc(max(0, ok))
                m.scrapes.labels("unreachable").inc(max(0, s.unreachable - c.unreachable))
                m.scrapes.labels("http_error").inc(max(0, s.http_errors - c.http_errors))
                m.scrapes.labels("unreadable").inc(max(0, s.unreadable - c.unreadable))
                m.pages.inc(max(0, s.pages - c.pages))
                m.page_bytes.inc(max(0, s.page_bytes - c.page_bytes))
                m.parse.inc(max(0.0, s.parse_s - c.parse_s))
                w.counted = s
        m.collectors.set(live)
        m.lag.set(lag)
        m.backing_off.set(backing_off)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def stop_all() -> None:
            for w in self._workers:
                self._stop(w)

        await asyncio.to_thread(stop_all)
        self.metrics.collectors.set(0)
