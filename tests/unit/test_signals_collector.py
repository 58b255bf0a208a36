"""The collector pool's verdict on itself: failing while a collector process is not reporting
(the weight loop counts the signals round as an error then)."""

from __future__ import annotations

import threading
import time

from controlplane.signals.collector import SILENT_S, CollectorPool, _Worker


class Proc:
    def __init__(self, code: int | None = None) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


def pool_of(*workers: _Worker) -> CollectorPool:
    # Without starting processes: only the bookkeeping `failing` reads.
    pool = CollectorPool.__new__(CollectorPool)
    pool._lock = threading.Lock()
    pool._workers = list(workers)
    pool.n = len(workers)
    return pool


def worker(index: int, proc: Proc | None, heard_ago: float | None) -> _Worker:
    w = _Worker(index)
    w.proc = proc  # type: ignore[assignment]
    w.heard_at = None if heard_ago is None else time.monotonic() - heard_ago
    return w


def test_every_collector_reporting_is_not_failing() -> None:
    assert pool_of(worker(0, Proc(), 0.05), worker(1, Proc(), 0.2)).failing is None


def test_a_collector_exited_starting_or_silent_makes_the_source_fail() -> None:
    for down in (worker(1, Proc(code=-9), 0.05), worker(1, Proc(), None), worker(1, Proc(), SILENT_S + 1)):
        failing = pool_of(worker(0, Proc(), 0.05), down).failing
        assert failing == "collector processes not reporting: 1 (of 2)"
