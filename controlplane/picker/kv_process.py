"""The precise index in a process of its own, at a low CPU priority (thin I/O shell).

A flood of KV events is CPU work: reading a batch and keying its blocks is microseconds a
block, 100,000 blocks a second half a core. Done in the picker's process, that work shares
the picks' interpreter and their loop, and raised their p99 by 2-5 ms on 2 cores however it
was sliced (docs/kv-events.md). So the picker starts, once the control plane names a
publisher, a child process (`python -m controlplane.picker.kv_process`) that:

- runs under SCHED_IDLE, every thread of it: the kernel gives it only CPU time no other
  process wants, and takes its core back at once for any process that wakes, a pick's
  included (at nice 19, a waking process may first wait out the child's time slice; one run
  of the flood bench each did not tell the two apart: docs/benchmarks.md). Where SCHED_IDLE
  is refused, it runs at nice KV_NICE. It ends when the picker does (PR_SET_PDEATHSIG, and
  a look at its parent);
- takes at most `--kv-index-cpu` of a core (CpuBudget, every thread's CPU time counted): past
  it, it stops reading events; a publisher faster than that falls behind, and what it reads
  too late is skipped (kv_events.KvSubscriptions._late);
- subscribes to the publishers the picker names (kv_events.KvSubscriptions, unchanged: gaps
  replayed or forgotten, restarts, reconnects, hostile messages refused), into the bounded
  index (kvcache/index.py), whose journal it applies every FLUSH_S to the key table the
  picker shares with it (kvcache/table.py: a memfd the picker makes, passed by `--table-fd`),
  and sends the picker what else it must know (each server's slot, block size, clears and
  publishing: kvcache/writer.py);
- sends its counters (kv_events.EVENT_FAMILIES) and each server's count of blocks every
  STATS_S, which the picker exports.

The picker's picks read the table (kvcache/mirror.KvMirror): a pick never waits on the child,
and the picker does no work per stored block. The messages it applies in steps, between picks
(Deciding), not during them. Where the machine has no memfd, the child sends the journal
itself as runs and the mirror keeps the keys in dicts. If the child dies, its table and the
mirror are dropped (its servers are scored by the approximate index until their events come
again), counted (`controlplane_picker_kv_process_restarts_total`), and a new child starts,
with a new table, after RESTART_BACKOFF_S (doubling, at most RESTART_BACKOFF_MAX_S),
re-reading every replay buffer from its start. If the picker falls behind, the child stops
reading events until it catches up (JOURNAL_HIGH): ZMQ then drops the publishers' messages (a
gap, as for any flood).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import mmap
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from controlplane import limits
from controlplane.kvcache.index import KvIndex
from controlplane.kvcache.mirror import RUN_KEYS, KvMirror, runs
from controlplane.kvcache.table import KeyTable, TableInvalid, capacity_for, table_bytes
from controlplane.kvcache.writer import TableWriter
from controlplane.obs import logging as logging_setup
from controlplane.picker.choose import PickerState
from controlplane.picker.kv_events import EVENT_FAMILIES, KvMetrics, KvSubscriptions, refresh_gauges

log = structlog.get_logger("controlplane.picker.kv_process")

KV_NICE = 19
FLUSH_S = 0.01  # the journal sent this often: the picks see a stored block this much later
STATS_S = 1.0
JOURNAL_HIGH = 65536  # changes not yet sent past which the child stops reading events
CPU_SHARE = limits.KV_INDEX_CPU  # the child's CPU time at most, in cores, every thread of it
CPU_WINDOW_S = 0.1
MESSAGE_BYTES_MAX = 1 << 22  # a message from the child larger than this is refused (never sent)
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
START_TIMEOUT_S = 30.0  # a child that has not said hello by then is killed and started again
PR_SET_PDEATHSIG = 1
# A step of the mirror waits at most this long for the picks being decided to be answered.
PICKS_FIRST_MAX_S = 0.002


class Deciding:
    """The picks being decided now (from their request's headers to their answer's sending).

    The mirror applies its steps between picks, not during them: a pick is a few turns of the
    event loop (the stream's message read, the choice, the answer written), and a step taken
    at each of those turns, though 0.1 ms alone, adds up in the pick's latency. A step waits
    until no pick is being decided, at most PICKS_FIRST_MAX_S: under picks that never pause,
    the mirror still advances (a step every 2 ms), and falls behind a flood rather than the
    picks (the index's process then stops reading events: a gap, as for any flood)."""

    def __init__(self) -> None:
        self.n = 0
        self._none = asyncio.Event()
        self._none.set()

    def start(self) -> None:
        self.n += 1
        self._none.clear()

    def end(self) -> None:
        self.n -= 1
        if self.n <= 0:
            self.n = 0
            self._none.set()

    async def none(self, most_s: float = PICKS_FIRST_MAX_S) -> None:
        """Return once no pick is being decided, or after `most_s`."""
        if self.n:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._none.wait(), most_s)


class EventFamilies(Collector):
    """EVENT_FAMILIES as the child last sent them (none before it has)."""

    def __init__(self) -> None:
        self.families: list[Any] = []

    def collect(self) -> Iterator[Metric]:
        for name, documentation, kind, samples in self.families:
            m = Metric(name, documentation, kind)
            for sample, labels, value in samples:
                m.add_sample(sample, labels, value)
            yield m

    def describe(self) -> Iterable[Metric]:
        return ()


class KvProcessMetrics:
    """The picker's side: the child's restarts, and its counters re-exported."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.restarts = Counter(
            "controlplane_picker_kv_process_restarts",
            "Times the precise index's process (KV events) ended and was started again: its "
            "servers were scored by the approximate index until their events came again",
            registry=r,
        )
        self.table_bytes = Gauge(
            "controlplane_picker_kv_table_bytes",
            "Shared memory of the table the precise index's process writes its keys into and "
            "the picker reads (0: no table, the picker keeps its own copy of the keys)",
            registry=r,
        )
        self.table_rebuilds = Gauge(
            "controlplane_picker_kv_table_rebuilds",
            "Rebuilds of the shared key table (its tombstones dropped) since the index's process started",
            registry=r,
        )
        self.torn_reads = Counter(
            "controlplane_picker_kv_table_torn_reads",
            "Picks whose read of the shared key table overlapped a rebuild: scored as if nothing were cached",
            registry=r,
        )
        self.families = EventFamilies()
        r.register(self.families)


def _snapshot(registry: CollectorRegistry) -> list[Any]:
    return [
        [m.name, m.documentation, m.type, [[s.name, s.labels, s.value] for s in m.samples]]
        for m in registry.collect()
        if m.name in EVENT_FAMILIES
    ]


class KvProcess:
    """The picker's handle on its index process; the same calls as KvSubscriptions."""

    def __init__(
        self,
        state: PickerState,
        metrics: KvMetrics,
        process_metrics: KvProcessMetrics,
        *,
        nice: int = KV_NICE,
        clock: Callable[[], float] = time.monotonic,
        deciding: Deciding | None = None,
        cpu_share: float = CPU_SHARE,
    ) -> None:
        if not isinstance(state.kv, KvMirror):
            raise TypeError("KvProcess keeps a KvMirror: set state.kv = KvMirror(max_blocks) first")
        self.state = state
        self.mirror: KvMirror = state.kv
        self.metrics = metrics
        self.process_metrics = process_metrics
        self.nice = nice
        self.cpu_share = cpu_share
        self.clock = clock
        self.deciding = deciding or Deciding()
        self.publishers: dict[str, tuple[str, str | None]] = {}
        self.ctx = zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._decoder = msgspec.msgpack.Decoder()

    def update(self, publishers: Mapping[str, tuple[str, str | None]]) -> None:
        """Follow `publishers` (server -> events endpoint, replay socket) and no other."""
        self.publishers = dict(publishers)
        if self._task is None and self.publishers:
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(self._publishers_message(), zmq.NOBLOCK)

    def refresh_gauges(self) -> None:
        refresh_gauges(self.state, self.metrics, self.clock())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def _publishers_message(self) -> bytes:
        return msgspec.msgpack.encode({"publishers": {s: list(w) for s, w in self.publishers.items()}})

    async def _run(self) -> None:
        backoff = RESTART_BACKOFF_S
        while True:
            started = self.clock()
            try:
                await self._one()
            except (OSError, zmq.ZMQError, msgspec.DecodeError, ValueError, TypeError, KeyError) as e:
                log.warning("kv index process failed", error=str(e)[:200])
            self.mirror.clear()
            self.mirror.index_size = None
            self.process_metrics.families.families = []  # its counters went with it
            self.process_metrics.restarts.inc()
            if self.clock() - started > RESTART_BACKOFF_MAX_S:
                backoff = RESTART_BACKOFF_S  # it ran a good while: a fresh failure, not a loop
            await asyncio.sleep(backoff)
            backoff = min(RESTART_BACKOFF_MAX_S, 2 * backoff)

    def _new_table(self) -> tuple[int, mmap.mmap, KeyTable] | None:
        """A shared key table for the next child (memory only: a memfd), or None where the
        machine has no memfd (the child then sends the keys, and the mirror keeps them)."""
        capacity = capacity_for(self.mirror.max_blocks)
        size = table_bytes(capacity)
        fd = -1
        try:
            fd = os.memfd_create("controlplane-kv-table", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size)
            return fd, mapped, KeyTable(mapped, create=True, capacity=capacity)
        except (AttributeError, OSError, TableInvalid) as e:
            if fd >= 0:
                os.close(fd)
            log.warning("no shared key table: the picker keeps its own copy of the keys", error=str(e)[:200])
            return None

    async def _one(self) -> None:
        """One child: started, fed the publishers, read until it ends (then killed for sure)."""
        workdir = tempfile.mkdtemp(prefix="controlplane-kv-")  # 0700: only this user connects
        sock = self.ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MESSAGE_BYTES_MAX)
        endpoint = f"ipc://{workdir}/index"
        proc = None
        shared = self._new_table()
        table_args = [] if shared is None else ["--table-fd", str(shared[0])]
        try:
            sock.bind(endpoint)
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "controlplane.picker.kv_process",
                "--parent",
                endpoint,
                "--max-blocks",
                str(self.mirror.max_blocks),
                "--nice",
                str(self.nice),
                "--cpu",
                str(self.cpu_share),
                "--log-format",
                logging_setup.CONFIGURED[0],
                "--log-level",
                logging_setup.CONFIGURED[1],
                *table_args,
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=() if shared is None else (shared[0],),
            )
            if not await sock.poll(int(START_TIMEOUT_S * 1000)):
                log.warning("kv index process did not start", pid=proc.pid)
                return
            hello = self._hello(self._decoder.decode(await sock.recv()))
            self._sock = sock
            if shared is not None and hello.get("table"):
                self.mirror.table = shared[2]
                self.process_metrics.table_bytes.set(len(shared[1]))
            await sock.send(self._publishers_message())
            log.info("kv index process started", pid=proc.pid, priority=str(hello.get("priority"))[:40])
            exited = asyncio.ensure_future(proc.wait())
            try:
                while not exited.done():
                    if not await sock.poll(1000):
                        continue
                    await self._take(self._decoder.decode(await sock.recv()))
            finally:
                exited.cancel()
            log.warning("kv index process ended", pid=proc.pid, returncode=proc.returncode)
        finally:
            self._sock = None
            self.mirror.table = None
            self.process_metrics.table_bytes.set(0)
            if shared is not None:
                os.close(shared[0])  # the memory goes with the child's and our last mapping
            sock.close(linger=0)
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)

    @staticmethod
    def _hello(message: object) -> dict[str, Any]:
        if not (isinstance(message, dict) and message.get("hello") == os.getpid()):
            raise ValueError(f"not the index process's hello: {str(message)[:100]}")
        return message

    async def _take(self, message: object) -> None:
        if not isinstance(message, dict):
            raise ValueError("a message from the index process that is not a map")
        if "runs" in message:
            for published in self.mirror.steps(message["runs"]):
                for server in published:
                    self.state.kv_pending.pop(server, None)  # it publishes: not stale
                await asyncio.sleep(0)  # the picks between steps
                await self.deciding.none()  # and not during them
        if "stats" in message:
            self.process_metrics.families.families = message["stats"]
            self.mirror.evicted = int(message.get("evicted", 0))
            self.mirror.index_size = int(message.get("size", 0))
            if isinstance(message.get("held"), dict):
                self.mirror.set_counts(message["held"])
            self.process_metrics.table_rebuilds.set(int(message.get("rebuilds", 0)))
            torn = self.mirror.torn_reads
            if torn:
                self.mirror.torn_reads = 0
                self.process_metrics.torn_reads.inc(torn)


# ---- the child ---------------------------------------------------------------------------------


class CpuBudget:
    """At most `share` of a core of this process's CPU time (every thread: process_time), as a
    bucket: it fills at `share` CPU seconds a second, holds at most share x CPU_WINDOW_S (idle
    time banks no more than that), and the CPU used drains it. `due` is how long to wait for it
    to be empty no more: a step longer than the window is paid for in full, however long."""

    def __init__(
        self,
        share: float,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self.share = share
        self.clock, self.cpu = clock, cpu
        self.credit = share * CPU_WINDOW_S  # CPU seconds it may still use at once
        self._last, self._at = clock(), cpu()

    def due(self) -> float:
        """Seconds to wait now (0: within the budget)."""
        now, used = self.clock(), self.cpu()
        earned = min(self.share * CPU_WINDOW_S, self.credit + self.share * (now - self._last))
        self.credit = earned - (used - self._at)
        self._last, self._at = now, used
        return max(0.0, -self.credit / self.share)


class _Subscriptions(KvSubscriptions):
    """KvSubscriptions that stop reading events while the picker has JOURNAL_HIGH changes unsent,
    and while the process is past its CPU budget."""

    def __init__(self, *args: Any, drained: asyncio.Event, cpu: CpuBudget, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drained = drained
        self.cpu = cpu

    async def _budget(self) -> None:
        journal = self.index.journal
        while journal is not None and len(journal) > JOURNAL_HIGH:
            self.drained.clear()
            await self.drained.wait()
        due = self.cpu.due()
        if due > 0:
            self._paused(self.clock(), due)
            await asyncio.sleep(due)
        await super()._budget()


def _attach_table(fd: int) -> TableWriter:
    mapped = mmap.mmap(fd, os.fstat(fd).st_size)
    os.close(fd)
    return TableWriter(KeyTable(mapped))


async def child(
    parent: str,
    max_blocks: int,
    priority: str = "normal",
    table_fd: int | None = None,
    cpu_share: float = CPU_SHARE,
) -> None:
    ppid = os.getppid()
    writer = None if table_fd is None else _attach_table(table_fd)
    journal: list[tuple[int, str, int]] = []  # the index's changes not yet sent
    # Plain dicts, not Sharded: no pick waits on this process's loop while a dict resizes.
    index = KvIndex(max_blocks=max_blocks, journal=journal, sharded=False)
    state = PickerState(kv=index)
    registry = CollectorRegistry()
    metrics = KvMetrics(registry)
    drained = asyncio.Event()
    # Its own loop's time is all the events': no share of it kept for picks (bigger steps); its
    # CPU is held to cpu_share of a core.
    cpu = CpuBudget(cpu_share)
    subs = _Subscriptions(
        state, metrics, busy_share=1.0, step_pause_s=0.0, step_blocks=256, drained=drained, cpu=cpu
    )
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MESSAGE_BYTES_MAX)
    sock.connect(parent)
    decoder = msgspec.msgpack.Decoder()
    await sock.send(
        msgspec.msgpack.encode({"hello": ppid, "priority": priority, "table": writer is not None})
    )

    async def control() -> None:
        while True:
            message = decoder.decode(await sock.recv())
            if isinstance(message, dict) and isinstance(message.get("publishers"), dict):
                named = {
                    str(s): (str(w[0]), None if w[1] is None else str(w[1]))
                    for s, w in message["publishers"].items()
                }
                state.kv_publishers = set(named)
                subs.update(named)
                log.debug("kv index process following", publishers=len(named))

    async def flush() -> None:
        stats_at, connected = 0.0, 0
        while True:
            await asyncio.sleep(FLUSH_S)
            if journal:
                pending = runs(journal)
                journal.clear()
                if writer is not None:  # the keys into the shared table; the rest told
                    pending = writer.apply(pending)
                    if writer.table.full():
                        writer.rebuild({s: st.blocks.values() for s, st in index.streams.items()})
                message: list[Any] = []
                keys = 0
                for run in pending:
                    message.append(run)
                    keys += len(run[2])
                    if keys >= RUN_KEYS:
                        await sock.send(msgspec.msgpack.encode({"runs": message}))
                        message, keys = [], 0
                if message:
                    await sock.send(msgspec.msgpack.encode({"runs": message}))
            drained.set()
            now = time.monotonic()
            if now - stats_at >= STATS_S or len(subs.connected) != connected:
                stats_at, connected = now, len(subs.connected)  # a publisher reached: said at once
                stats: dict[str, Any] = {
                    "stats": _snapshot(registry),
                    "evicted": index.evicted,
                    "size": index.size,
                }
                if writer is not None:
                    stats["held"] = writer.held_counts()
                    stats["rebuilds"] = writer.table.rebuilds
                await sock.send(msgspec.msgpack.encode(stats))
            if os.getppid() != ppid:
                return  # the picker is gone

    try:
        tasks = [asyncio.ensure_future(control()), asyncio.ensure_future(flush())]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()
    finally:
        await subs.close()
        sock.close(linger=0)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _threads() -> list[int]:
    """This process's threads (Linux: each has its own policy and nice value, and a thread
    takes its creator's; its imports may have started some already: numpy's BLAS pool)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no /proc: the calling thread only


def _lower_priority(idle: bool, nice: int) -> str:
    """SCHED_IDLE for every thread if `idle` and the kernel allows it, else `nice` added to
    each: what was set. Threads started later take it from the one that starts them."""
    if idle:
        try:
            for tid in _threads():
                with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        except (OSError, AttributeError):
            pass  # not Linux, or refused (a seccomp profile): nice instead
    if nice:
        for tid in _threads():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        return f"nice {nice}"
    return "normal"


def _cores(text: str) -> float:
    """--cpu: a share of cores, as the picker's --kv-index-cpu allows (0.01 to 64)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.01 <= value <= 64:  # NaN fails it too
        raise argparse.ArgumentTypeError(f"must be between 0.01 and 64, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The picker's precise-index process (started by the picker).")
    p.add_argument("--parent", required=True, help="the picker's ZMQ endpoint (ipc://...)")
    p.add_argument("--max-blocks", type=int, required=True, help="the index's bound (--kv-index-blocks)")
    p.add_argument(
        "--idle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run under SCHED_IDLE (default: %(default)s); --no-idle, or where it is refused: --nice",
    )
    p.add_argument("--nice", type=int, default=KV_NICE, help="added to this process's nice value")
    p.add_argument(
        "--cpu",
        type=_cores,
        default=CPU_SHARE,
        help="the most CPU time this process takes, in cores (--kv-index-cpu; default: %(default)s)",
    )
    p.add_argument(
        "--table-fd",
        type=int,
        default=None,
        help="a memfd holding the shared key table (kvcache/table.py) to write the keys into",
    )
    p.add_argument("--log-format", choices=("json", "console"), default="console")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    logging_setup.configure_logging(a.log_format, a.log_level)
    _die_with_parent()
    priority = _lower_priority(a.idle, a.nice)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(child(a.parent, a.max_blocks, priority, a.table_fd, a.cpu))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
