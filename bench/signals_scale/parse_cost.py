"""What reading the servers' TTFT/TPOT histograms costs: parse, hand-over and merge.

  .venv/bin/python bench/signals_scale/parse_cost.py [--baseline-rev d215b31]

Three parts, each against a baseline measured in the same run:

1. Parsing a full-size vLLM page (the emulator's `sample_full_page`, 33 KB, 13 histograms)
   with `parse_metrics` as it is now (the families read include the TTFT and TPOT histograms,
   ~60 more lines) against `parse_metrics` at `--baseline-rev` (loaded with `git show`, read
   only): the parser before them. Eight pages of one server (same lines, other values),
   parsed in turn as a collector parses a server's successive scrapes ("steady"), and with
   the line-head cache emptied before each page ("cold": a server's first page, or a fleet
   with more distinct heads than the cache holds). prometheus_client's whole-page parse is
   printed for scale.
2. The collector -> control plane records: pickled bytes per record (as the socket pair
   carries them, batched as a collector's 50 ms flush) without the histograms (before),
   with both histograms changed, and with both unchanged (left out); the unpickling time per
   record (the control plane's reader thread), and what that is at 2,000 endpoints/s.
3. The weight loop's cost per endpoint of queueing the histograms (`ModelLatency.observe`),
   and the fold at a /metrics read, at 2,000 busy endpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import types
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from controlplane.fleet import parse_fleet
from controlplane.signals import parse
from controlplane.signals.collector_worker import SentHistograms, Stats
from controlplane.signals.model_latency import ModelLatency
from controlplane.signals.parse import ServerHistogram, ServerSample
from controlplane.signals.store import ScrapeResult
from controlplane.sim.emulator_metrics import sample_full_page

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.revisions import module_at

BASELINE_REV = "d215b31"  # the last commit before the TTFT/TPOT histograms were read


def baseline_parser(rev: str) -> types.ModuleType:
    return module_at(rev, "controlplane/signals/parse.py", "parse_baseline")


def best_per_page(fn: Callable[[str], Any], pages: list[str], reps: int, rounds: int = 7) -> float:
    """The best of `rounds` runs of `reps` passes over the pages, per page (CPU seconds)."""
    best = float("inf")
    for _ in range(rounds):
        t = time.process_time()
        for _ in range(reps):
            for page in pages:
                fn(page)
        best = min(best, (time.process_time() - t) / (reps * len(pages)))
    return best


def part_parse(rev: str, reps: int) -> None:
    pages = [sample_full_page("m", seed=s) for s in range(1, 9)]
    old = baseline_parser(rev)
    old_lines = len(old._select(pages[0])[0])
    new_lines = len(parse._select(pages[0])[0])

    def full(page: str) -> None:
        for f in text_string_to_metric_families(page):
            for _ in f.samples:
                pass

    def cold(page: str) -> None:
        parse._HEADS.clear()
        parse.parse_metrics(page, "m")

    # Interleaved, so a busy moment of this shared machine hits every variant alike; the
    # ratios are taken per pass (the variants timed back to back), their median printed.
    results: dict[str, float] = {}
    ratios: dict[str, list[float]] = {"steady": [], "cold": []}
    variants: list[tuple[str, Callable[[str], Any], int]] = [
        ("baseline", lambda p: old.parse_metrics(p, "m"), reps),
        ("steady", lambda p: parse.parse_metrics(p, "m"), reps),
        ("cold", cold, reps),
        ("full", full, max(1, reps // 10)),
    ]
    for _ in range(7):
        times = {name: best_per_page(fn, pages, n, rounds=1) for name, fn, n in variants}
        for name, t in times.items():
            results[name] = min(results.get(name, float("inf")), t)
        for name, got in ratios.items():
            got.append(times[name] / times["baseline"])
    base = results["baseline"]
    print(f"page: {len(pages[0].encode()) / 1024:.1f} KB; lines read: {old_lines} before, {new_lines} now")
    print(f"  prometheus_client, whole page      {results['full'] * 1e3:7.3f} ms/page (best pass)")
    print(f"  parse_metrics at {rev:<12}      {base * 1e3:7.3f} ms/page   (baseline)")
    for name, what in (("steady", "steady"), ("cold", "cold heads")):
        r = sorted(ratios[name])
        print(
            f"  parse_metrics now, {what:<15} {results[name] * 1e3:7.3f} ms/page   "
            f"{statistics.median(r):.2f}x the baseline (passes: {r[0]:.2f}-{r[-1]:.2f})"
        )


def part_ipc(endpoints: int) -> None:
    pages = [sample_full_page("m", seed=s) for s in range(1, 9)]
    batch_n = 50  # a collector's 50 ms flush at 1,000 endpoints/s
    # One parse per record, as in a collector: distinct objects (pickle would send a repeated
    # one once), sharing only what the parser shares (the bounds tuples).
    samples = [parse.parse_metrics(pages[i % 8], "m") for i in range(batch_n)]

    def batch_of(make: Callable[[int], Any]) -> list[tuple[tuple[str, str], ScrapeResult]]:
        return [
            (("m", f"127.0.0.1:{9000 + i}"), ScrapeResult(health_status=200, sample=make(i)))
            for i in range(batch_n)
        ]

    without = batch_of(lambda i: dataclasses.replace(samples[i], ttft=None, tpot=None))
    changed = batch_of(lambda i: samples[i])
    sent = SentHistograms()
    for i in range(batch_n):
        sent.changed_only(("m", f"127.0.0.1:{9000 + i}"), samples[i], 0.0)
    unchanged = batch_of(lambda i: sent.changed_only(("m", f"127.0.0.1:{9000 + i}"), samples[i], 1.0))
    assert all(r.sample is not None and r.sample.ttft is None for _, r in unchanged)
    print(f"records of {batch_n} endpoints per batch (pickled as the collectors send them, with Stats):")
    rows = []
    for name, batch in (
        ("no histograms (before)", without),
        ("both changed", changed),
        ("both unchanged", unchanged),
    ):
        data = bytes(ForkingPickler.dumps(("results", (batch, Stats()))))
        t0 = time.process_time()
        n = 0
        while time.process_time() - t0 < 0.5:
            ForkingPickler.loads(data)
            n += 1
        per = (time.process_time() - t0) / n / batch_n
        rows.append((name, len(data) / batch_n, per))
    base_bytes, base_t = rows[0][1], rows[0][2]
    for name, size, per in rows:
        print(
            f"  {name:<24} {size:7.0f} B/record ({size / base_bytes:.2f}x)  "
            f"unpickle {per * 1e6:5.1f} us/record ({per / base_t:.2f}x)  "
            f"at {endpoints} endpoints/s: {size * endpoints / 1e6:5.2f} MB/s, "
            f"{per * endpoints * 1e3:5.1f} ms CPU/s"
        )


def part_merge(endpoints: int) -> None:
    addresses = [f"127.0.0.1:{9000 + i}" for i in range(endpoints)]
    text = "listener: {port: 10000}\ntiers:\n  small: {timeout: 30s}\nmodels:\n"
    for m in range(endpoints // 20):
        eps = ", ".join(repr(a) for a in addresses[m * 20 : (m + 1) * 20])
        text += f"  m{m}:\n    params_b: 8\n    stable: v1\n    versions:\n      v1:\n"
        text += f"        endpoints: [{eps}]\n"
    fleet = parse_fleet(text)
    base = parse.parse_metrics(sample_full_page("m", seed=1), "m")
    keys = [(f"m{i // 20}", a) for i, a in enumerate(addresses)]

    def round_sample(r: int, life: int) -> ServerSample:
        """Round r's page of a busy server: every count grown, bounds a tuple of its own (as
        after unpickling: records of different batches never share one)."""

        def grown(h: ServerHistogram | None) -> ServerHistogram:
            assert h is not None
            k = 1.0 + r / 10
            return ServerHistogram(
                tuple(list(h.bounds)), tuple(c * k for c in h.counts), h.count * k, (h.sum or 0.0) * k, life
            )

        return dataclasses.replace(base, ttft=grown(base.ttft), tpot=grown(base.tpot))

    def run(life: int) -> tuple[float, float]:
        """(loop seconds per round, seconds per /metrics read's fold)."""
        lat = ModelLatency()
        lat.observe(fleet, [(k, round_sample(0, life)) for k in keys])
        lat.fold()
        rounds, loop_s, fold_s = 8, 0.0, 0.0
        for r in range(1, rounds + 1):
            sample = round_sample(r, life)
            batch = [(k, sample) for k in keys]
            t = time.process_time()
            lat.observe(fleet, batch)
            loop_s += time.process_time() - t
            if r % 4 == 0:  # a /metrics read every few rounds
                t = time.process_time()
                lat.fold()
                fold_s += time.process_time() - t
        return loop_s / rounds, fold_s / (rounds // 4)

    for life, what in ((7, "from the collectors (lifetime ids)"), (0, "without lifetime ids (inline)")):
        loop, fold = run(life)
        print(
            f"  {what:<36} weight loop {loop * 1e3:5.1f} ms per round ({loop / endpoints * 1e6:.2f} us "
            f"per endpoint); a /metrics read's fold after 4 rounds {fold * 1e3:5.1f} ms (reader's thread)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision of the parser to compare with")
    ap.add_argument("--reps", type=int, default=60, help="passes over the 8 pages per timing")
    ap.add_argument("--endpoints", type=int, default=2000)
    a = ap.parse_args()
    print("== 1. parsing a full vLLM page")
    part_parse(a.baseline_rev, a.reps)
    print("\n== 2. records from the collectors")
    part_ipc(a.endpoints)
    print(
        f"\n== 3. merging in the control plane: {a.endpoints} endpoints, both histograms changed each round"
    )
    part_merge(a.endpoints)


if __name__ == "__main__":
    main()
