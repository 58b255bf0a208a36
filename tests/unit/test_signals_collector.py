"""The collector pool's verdict on itself: failing while a collector process is not reporting
(the weight loop counts the signals round as an error then); the latency histograms a
collector leaves out of its records, and the lifetimes it stamps on them; the reason class it
gives a scrape that read no load."""

from __future__ import annotations

import asyncio
import threading
import time

from controlplane.signals import collector_worker
from controlplane.signals.collector import SILENT_S, CollectorPool, _later, _Worker
from controlplane.signals.collector_worker import REFRESH_S, SentHistograms
from controlplane.signals.parse import ServerHistogram, ServerSample
from controlplane.signals.probe import Probe, ProbeResult
from controlplane.signals.store import ScrapeResult


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


# ---- latency histograms: sent when changed, stamped with their server's lifetime -------------

KEY = ("m", "127.0.0.1:8001")


def page(n: float, tpot: float | None = None, first: float | None = None) -> ServerSample:
    """A page whose TTFT histogram counted n requests (first of them under 0.1 s)."""
    ttft = ServerHistogram((0.1, 1.0), (n if first is None else first, n), n, n * 0.2)
    per_token = None if tpot is None else ServerHistogram((0.05,), (tpot,), tpot, tpot * 0.01)
    return ServerSample("vllm", running=1.0, ttft=ttft, tpot=per_token)


def test_histograms_go_whole_first_then_only_when_changed_and_whole_again_now_and_then() -> None:
    sent = SentHistograms()
    first = sent.changed_only(KEY, page(3, tpot=30), 0.0)
    assert first.ttft is not None and first.tpot is not None
    assert (first.ttft.count, first.tpot.count) == (3, 30)
    assert first.ttft.life and first.tpot.life and first.ttft.life != first.tpot.life
    assert first.running == 1.0  # the rest of the sample untouched
    same = sent.changed_only(KEY, page(3, tpot=30), 1.0)
    assert (same.ttft, same.tpot) == (None, None)
    more = sent.changed_only(KEY, page(5, tpot=30), 2.0)
    assert more.ttft is not None and more.tpot is None
    assert more.ttft.life == first.ttft.life  # the same lifetime
    again = sent.changed_only(KEY, page(5, tpot=30), REFRESH_S + 0.5)
    assert again.ttft is not None and again.tpot is not None  # whole, though unchanged
    assert (again.ttft.life, again.tpot.life) == (first.ttft.life, first.tpot.life)
    assert sent.changed_only(KEY, page(5, tpot=30), REFRESH_S + 1).ttft is None


def test_a_restarted_server_gets_a_new_lifetime_even_past_its_old_counts() -> None:
    sent = SentHistograms()
    before = sent.changed_only(KEY, page(3, first=0), 0.0).ttft
    # Restarted, then 5 requests, all fast: more than before, but not a continuation (the
    # fast bucket rose by 5, the count by 2).
    after = sent.changed_only(KEY, page(5), 1.0).ttft
    assert before is not None and after is not None and after.life != before.life
    assert sent.changed_only(KEY, page(4), 2.0).ttft.life not in (before.life, after.life)  # type: ignore[union-attr]


def test_an_endpoint_forgotten_or_a_collector_started_again_sends_whole_with_new_lifetimes() -> None:
    sent = SentHistograms()
    life = sent.changed_only(KEY, page(3), 0.0).ttft.life  # type: ignore[union-attr]
    sent.retain({("m", "127.0.0.1:9999")})
    back = sent.changed_only(KEY, page(3), 1.0).ttft
    assert back is not None and back.life != life
    other = SentHistograms().changed_only(KEY, page(3), 0.0).ttft
    assert other is not None and other.life not in (life, back.life)
    # A page without the histograms: nothing kept, nothing left out.
    plain = ServerSample("vllm", running=2.0)
    assert sent.changed_only(KEY, plain, 2.0) is plain
    assert sent.changed_only(KEY, page(3), 3.0).ttft is not None


def test_two_records_in_one_round_keep_the_earlier_histograms_the_later_left_out() -> None:
    sent = SentHistograms()
    a = ScrapeResult(health_status=200, sample=sent.changed_only(KEY, page(3, tpot=30), 0.0))
    b = ScrapeResult(health_status=200, sample=sent.changed_only(KEY, page(3, tpot=31), 0.5))
    assert b.sample is not None and b.sample.ttft is None
    both = _later(a, b)
    assert both.sample is not None and a.sample is not None
    assert both.sample.ttft is a.sample.ttft and both.sample.tpot is b.sample.tpot
    assert _later(a, a) is a
    failed = ScrapeResult(metrics_error="HTTP 500")
    assert _later(a, failed) is failed


class FakeProber:
    """Answers every probe with one ProbeResult."""

    def __init__(self, result: ProbeResult) -> None:
        self.result = result

    async def probe(
        self, address: str, probe: Probe, timeout_s: float, *, health_first: bool = False
    ) -> ProbeResult:
        return self.result


def records_of(result: ProbeResult) -> ScrapeResult:
    """What a collector process sends for one scrape answered with `result`."""

    async def one() -> ScrapeResult:
        w = collector_worker._Worker.__new__(collector_worker._Worker)
        collector_worker._Worker.__init__(w, None, 0)  # type: ignore[arg-type]  # never sends
        w.prober = FakeProber(result)  # type: ignore[assignment]
        await w._one(("m", "127.0.0.1:8000"), time.monotonic())
        [(_, r)] = w.outbox
        return r

    return asyncio.run(one())


def test_a_collector_says_why_a_scrape_read_no_load() -> None:
    refused = records_of(ProbeResult(None, "refused", None, None, "GET /metrics failed: refused"))
    assert refused.error_reason == "unreachable"
    assert records_of(ProbeResult(200, None, 404, b"no", None)).error_reason == "http_error"
    too_big = records_of(ProbeResult(200, None, 200, None, "page is over the 8388608 byte limit"))
    assert too_big.error_reason == "unreadable"
    other = records_of(ProbeResult(200, None, 200, b"node_cpu_seconds_total 1\n", None))
    assert other.error_reason == "no_dialect" and other.metrics_error is not None
    assert records_of(ProbeResult(200, None, 200, b"<html>", None)).error_reason == "unreadable"
    ok = records_of(ProbeResult(200, None, 200, b"vllm:num_requests_running 1\n", None))
    assert ok.error_reason is None and ok.metrics_error is None and ok.sample is not None


def test_a_collectors_record_carries_the_lora_adapters_across_the_process_boundary() -> None:
    import pickle

    from controlplane.signals.store import SignalStore
    from tests.unit.test_signals_parse import VLLM, lora

    page = (VLLM + lora("a", at="1") + lora("sql,chat", "x", at="2")).encode()
    record = records_of(ProbeResult(200, None, 200, page, None))
    # What the control plane unpickles (the worker sends records over a socket pair).
    record = pickle.loads(pickle.dumps(record))
    assert record.sample is not None
    assert (record.sample.lora_running, record.sample.lora_waiting, record.sample.max_lora) == (
        ("sql", "chat"),
        ("x",),
        2,
    )
    # Two records in one round: the later's adapters stand (a later page without the gauge:
    # unknown, not the earlier's).
    later = records_of(ProbeResult(200, None, 200, VLLM.encode(), None))
    newer, older = _later(record, later).sample, _later(later, record).sample
    assert newer is not None and newer.max_lora is None
    assert older is not None and older.lora_running == ("sql", "chat")
    store = SignalStore()
    store.record_scrape(("llama-3-8b", "127.0.0.1:8000"), record, now=1.0)
    load = store.load(("llama-3-8b", "127.0.0.1:8000"), 1.0, 1.0)
    assert (load.lora_running, load.lora_waiting, load.max_lora) == (("sql", "chat"), ("x",), 2)
