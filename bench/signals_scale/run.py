"""Signals at fleet scale: what observing the servers costs, and whether xDS feels it.

  .venv/bin/python bench/signals_scale/run.py                 # everything, ~5 minutes
  .venv/bin/python bench/signals_scale/run.py --streams 200   # a quicker look

One command, three parts, every ratio against a baseline measured in the same run:

1. Parsing a full-size vLLM /metrics page (the emulator's `sample_full_page`, ~40 KB, a
   dozen histograms): prometheus_client's full parse against `parse_metrics`, which
   parses only the families the policies read.
2. The xDS update spread (time from a snapshot's publication to the last of N simulated
   Envoy ADS clients receiving it; bench/xds_fanout's clients and servers) with the
   weight loop collecting from C x E endpoints, against the same server with signals off
   and against the floor server: (a) `--live` servers answering full pages plus hung
   ones (accept, never answer: every scrape times out); (b) every endpoint hung. Also the
   CPU of the control plane and its collector processes during the updates, in cores,
   and the collectors' CPU per endpoint-scrape.
3. The Prometheus source's CPU per round at 5,000 endpoints
   (`bench/signals_scale/prometheus_source.py`).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from controlplane.signals.parse import parse_metrics
from controlplane.sim.emulator_metrics import sample_full_page

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _fanout() -> ModuleType:
    """bench/xds_fanout/run.py (its servers and simulated clients), by path."""
    spec = importlib.util.spec_from_file_location("xds_fanout_run", HERE.parent / "xds_fanout" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fanout = _fanout()
Result = fanout.Result
run_one = fanout.run_one


def part_parse(reps: int) -> tuple[float, float]:
    page = sample_full_page("m", seed=1)
    families = sum(1 for _ in text_string_to_metric_families(page))

    def full() -> None:
        for f in text_string_to_metric_families(page):
            for _ in f.samples:
                pass

    def ours() -> None:
        parse_metrics(page, "m")

    def best_of(fn: object, n: int) -> float:
        runs = []
        for _ in range(5):
            t = time.process_time()
            for _ in range(n):
                fn()  # type: ignore[operator]
            runs.append((time.process_time() - t) / n)
        return min(runs)

    t_full = best_of(full, reps)
    t_ours = best_of(ours, reps * 5)
    print(f"page: {len(page.encode()) / 1024:.1f} KB, {families} families, {page.count(chr(10))} lines")
    print(
        f"  prometheus_client full parse   {t_full * 1000:7.3f} ms/page"
        f"  (1 core keeps up with {1 / t_full:.0f} pages/s)"
    )
    print(f"  parse_metrics (families read)  {t_ours * 1000:7.3f} ms/page  ({t_full / t_ours:.1f}x cheaper)")
    return t_full, t_ours


def part_collect(live: int, seconds: float, t_full: float) -> float:
    """A collector process against `live` servers with full pages: its CPU per scrape."""
    import asyncio

    from controlplane.fleet.model import Endpoint, Fleet, ListenerSpec, Model, Tier, Version
    from controlplane.obs.metrics import Metrics
    from controlplane.signals.collector import CollectorPool
    from controlplane.signals.scrape import scrape_targets

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "live.txt"
        proc = targets(live, 0, out)
        try:
            eps = []
            for a in out.read_text().split():
                host, _, port = a.rpartition(":")
                eps.append(Endpoint(host=host, port=int(port)))
            fleet = Fleet(
                listener=ListenerSpec(port=10000),
                tiers=(Tier("all", None),),
                models=(
                    Model(
                        name="m", tier="all", stable="v1", versions=(Version("v1", tuple(eps)),), params_b=8
                    ),
                ),
            )

            async def run() -> tuple[float, float, float]:
                pool = CollectorPool(fleet, Metrics(), workers=1)
                try:
                    keys = scrape_targets(fleet)
                    await pool.collect(fleet, keys, first=True)
                    await asyncio.sleep(2.0)
                    await pool.collect(fleet, keys)
                    s0 = pool._workers[0].stats
                    await asyncio.sleep(seconds)
                    await pool.collect(fleet, keys)
                    s1 = pool._workers[0].stats
                    n = max(1, s1.scrapes - s0.scrapes)
                    return (s1.cpu_s - s0.cpu_s) / n, (s1.parse_s - s0.parse_s) / n, n / seconds
                finally:
                    await pool.close()

            per, parse, rate = asyncio.run(run())
        finally:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(10)
    print(
        f"  one collector, {live} live servers: {rate:.0f} scrapes/s, {per * 1000:.3f} ms CPU per "
        f"endpoint-scrape (both requests, parse {parse * 1000:.3f} ms) = 1/{t_full / per:.1f} of a full "
        f"parse (target <= 1/8)"
    )
    return per


def targets(live: int, hung: int, out: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "targets.py"),
            "--live",
            str(live),
            "--hung",
            str(hung),
            "--out",
            str(out),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError(f"targets did not start: {line!r}")
    return p


def spread(r: Any) -> float:
    return max(r.conv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=1000, help="simulated Envoy ADS clients")
    ap.add_argument("--clusters", type=int, default=100)
    ap.add_argument("--endpoints", type=int, default=2000)
    ap.add_argument("--live", type=int, default=500, help="of the endpoints, live servers with full pages")
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4, help="client processes")
    ap.add_argument(
        "--settle", type=float, default=20.0, help="seconds of collection before the updates (CPU: 2nd half)"
    )
    ap.add_argument("--transport", default="sotw", choices=["sotw", "delta"])
    ap.add_argument("--skip-prometheus", action="store_true")
    a = ap.parse_args()

    print("== 1. parsing a full vLLM page")
    t_full, _ = part_parse(20)
    part_collect(300, 8.0, t_full)

    print(
        f"\n== 2. xDS update spread to {a.streams} proxies, {a.endpoints} endpoints in {a.clusters} clusters"
    )
    n, c, e = a.streams, a.clusters, a.endpoints
    rows: list[tuple[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        mixed = Path(tmp) / "mixed.txt"
        hung = Path(tmp) / "hung.txt"
        t1 = targets(a.live, e - a.live, mixed)
        t2 = targets(0, e, hung)
        try:
            common = (a.transport, n, c, e, a.updates, a.workers)
            settle = a.settle
            plan = [
                ("floor", "floor", ("--addresses", str(mixed)), 1.0),
                ("signals off", "ours", ("--addresses", str(mixed)), 1.0),
                (
                    f"{a.live} live + {e - a.live} hung",
                    "ours",
                    ("--addresses", str(mixed), "--signals"),
                    a.settle,
                ),
                (f"{e} hung", "ours", ("--addresses", str(hung), "--signals"), settle),
            ]
            for label, impl, args, settle in plan:
                r = run_one(impl, *common, server_args=args, settle_s=settle)
                rows.append((label, r))
                print(
                    f"  {label:<24} sync {r.sync_s:6.2f}s  spread {spread(r) * 1000:7.1f} ms  "
                    f"p50 {r.q(0.5) * 1000:6.1f} ms  cpu {r.window_cores:4.2f} cores",
                    flush=True,
                )
        finally:
            for t in (t1, t2):
                if t.stdin:
                    t.stdin.close()
                try:
                    t.wait(10)
                except subprocess.TimeoutExpired:
                    t.kill()
    by = dict(rows)
    off, floor = by["signals off"], by["floor"]
    mixed_r = rows[2][1]
    hung_r = rows[3][1]

    def med(r: Any) -> float:
        return float(statistics.median(r.spreads))

    print("\nratios (same run; spread = the last proxy's receipt, max and median over the updates):")
    print(
        f"  spread, {rows[2][0]} / signals off: max {spread(mixed_r) / spread(off):5.2f}x, "
        f"median {med(mixed_r) / med(off):5.2f}x  (target <= 1.3x)"
    )
    print(
        f"  spread, {rows[3][0]} / floor:           max {spread(hung_r) / spread(floor):5.2f}x, "
        f"median {med(hung_r) / med(floor):5.2f}x  (target <= 2x)"
    )
    print(
        f"  spread, signals off / floor:         max {spread(off) / spread(floor):5.2f}x, "
        f"median {med(off) / med(floor):5.2f}x"
    )
    print(
        f"  sync,   {rows[2][0]} / signals off: {mixed_r.sync_s / off.sync_s:5.2f}x; "
        f"{rows[3][0]} / signals off: {hung_r.sync_s / off.sync_s:5.2f}x"
    )
    print(
        f"  control plane CPU (xDS process + collectors, steady state): {rows[2][0]}: "
        f"{mixed_r.window_cores:.2f} cores; {rows[3][0]}: {hung_r.window_cores:.2f} cores (target <= 1)"
    )
    d = mixed_r.signals_delta
    if d and d[1] > 0:
        cpu, pages, scrapes = d[0], d[1], d[6]
        per_page = cpu / pages
        print(
            f"  collectors: {cpu:.2f} CPU s for {pages:.0f} pages ({scrapes:.0f} scrapes, "
            f"{d[2] / max(1.0, pages) / 1024:.1f} KB/page) in the window; "
            f"{per_page * 1000:.2f} ms CPU per page read, the hung servers' probes included; "
            f"{mixed_r.signals_after[4]:.0f} endpoints backing off, "
            f"scrape lag {mixed_r.signals_after[5] * 1000:.0f} ms"
        )
    print(
        f"  (spreads ms: floor {spread(floor) * 1000:.1f}, off {spread(off) * 1000:.1f}, "
        f"mixed {spread(mixed_r) * 1000:.1f}, hung {spread(hung_r) * 1000:.1f}; "
        f"p99 ms: {', '.join(f'{r.q(0.99) * 1000:.1f}' for _, r in rows)})"
    )

    if not a.skip_prometheus:
        print("\n== 3. Prometheus source, 5,000 endpoints")
        try:
            from prometheus_source import measure  # bench/signals_scale/prometheus_source.py
        except ImportError as ex:
            print(f"  skipped: {ex}")
        else:
            for k, v in measure(5000).items():
                print(f"  {k}: {v:.4g}")


if __name__ == "__main__":
    main()
