"""xDS fan-out benchmark: our server against the floor, measured in the same run.

  .venv/bin/python bench/xds_fanout/run.py            # N=100,1000 x C=10,1000, SotW and delta
  .venv/bin/python bench/xds_fanout/run.py --full     # adds N=5000
  .venv/bin/python bench/xds_fanout/run.py --streams 1000 --clusters 10 --transports sotw

For every size it starts a server process (ours: the real XdsServer and Reconciler; floor:
the minimal serialise-once server from DESIGN.md), then N simulated Envoy ADS clients in
W separate processes. It reports: initial sync time for all N; for one cluster's weight
change, the time from the snapshot's publication to each client's receipt and ACK of the
update (p50, p99, max); bytes per client for the update; server CPU seconds per push;
server RSS per idle stream. Then the ratios ours/floor.
"""

from __future__ import annotations

import argparse
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import cpu_seconds, rss_bytes, tree_cpu_seconds  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Lines:
    """Reads a process's stdout lines into a queue from a thread."""

    def __init__(self, proc: subprocess.Popen[str], q: queue.Queue[str]) -> None:
        self.thread = threading.Thread(target=self._pump, args=(proc, q), daemon=True)
        self.thread.start()

    @staticmethod
    def _pump(proc: subprocess.Popen[str], q: queue.Queue[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            q.put(line.strip())


@dataclass
class Result:
    impl: str
    transport: str
    streams: int
    clusters: int
    sync_s: float = 0.0
    conv: list[float] = field(default_factory=list)
    update_bytes: list[int] = field(default_factory=list)
    cpu_per_push: list[float] = field(default_factory=list)
    rss_per_stream: float = 0.0
    burst_pushes: float | None = None
    burst_s: float = 0.0
    burst_snapshots: int = 0
    rebuild_ms: float | None = None
    spreads: list[float] = field(default_factory=list)  # per update: the last client's receipt
    window_cores: float = 0.0  # CPU of the server and its processes during the updates, in cores
    signals_before: list[float] = field(default_factory=list)
    signals_after: list[float] = field(default_factory=list)
    signals_delta: list[float] = field(default_factory=list)

    def q(self, p: float) -> float:
        if not self.conv:
            return float("nan")
        s = sorted(self.conv)
        return s[min(len(s) - 1, int(p * len(s)))]


def wait_for(q: queue.Queue[str], prefix: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no '{prefix}' line within {timeout}s")
        line = q.get(timeout=left)
        if line.startswith(prefix):
            return line


def collect(q: queue.Queue[str], prefix: str, n: int, timeout: float) -> list[list[str]]:
    out = []
    end = time.monotonic() + timeout
    while len(out) < n:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"only {len(out)}/{n} '{prefix}' lines within {timeout}s")
        try:
            line = q.get(timeout=left)
        except queue.Empty:
            raise TimeoutError(f"only {len(out)}/{n} '{prefix}' lines within {timeout}s") from None
        if line.startswith(prefix):
            out.append(line.split())
    return out


def run_one(
    impl: str,
    transport: str,
    n: int,
    c: int,
    endpoints: int,
    updates: int,
    workers: int,
    server_args: tuple[str, ...] = (),
    settle_s: float = 1.0,
) -> Result:
    """One server (with `server_args`) and N clients. `settle_s`: wait after the initial
    sync before the updates (the signals benchmark lets collection reach steady state)."""
    res = Result(impl, transport, n, c)
    port = free_port()
    delta = transport == "delta"
    server = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "server.py"),
            "--impl",
            impl,
            "--port",
            str(port),
            "--clusters",
            str(c),
            "--endpoints",
            str(endpoints),
            *(["--delta"] if delta else []),
            *server_args,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the server's own logs (one line per stream opened/closed)
        text=True,
    )
    sq: queue.Queue[str] = queue.Queue()
    Lines(server, sq)
    cq: queue.Queue[str] = queue.Queue()
    clients: list[subprocess.Popen[str]] = []
    assert server.stdin is not None

    def send(cmd: str) -> None:
        assert server.stdin is not None
        server.stdin.write(cmd + "\n")
        server.stdin.flush()

    def settled_pushes() -> int:
        # Pushes are counted as their writes complete: wait until the count stops moving.
        count, stable_since = -1, time.monotonic()
        while time.monotonic() - stable_since < 1.0:
            send("pushes")
            now = int(wait_for(sq, "pushes", 10).split()[1])
            if now != count:
                count, stable_since = now, time.monotonic()
            time.sleep(0.2)
        return count

    try:
        wait_for(sq, "ready", 60)
        time.sleep(0.3)
        rss0 = rss_bytes(server.pid)
        started = time.monotonic()
        per = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
        for i, k in enumerate(per):
            if k == 0:
                continue
            p = subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "clients.py"),
                    "--target",
                    f"127.0.0.1:{port}",
                    "--streams",
                    str(k),
                    "--worker",
                    f"w{i}",
                    *(["--delta"] if delta else []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            clients.append(p)
            Lines(p, cq)
        try:
            synced = collect(cq, "sync", n, 60 + n * 0.1)
        except TimeoutError:
            if impl == "ours":
                send("status")
                print(wait_for(sq, "status", 10), flush=True)
            raise
        res.sync_s = max(float(x[2]) for x in synced) - started
        signals = "--signals" in server_args
        if signals:
            # Steady state: the second half of the settling time, collection running.
            time.sleep(settle_s / 2)
            cpu0, t0 = tree_cpu_seconds(server.pid), time.monotonic()
            send("signals")
            res.signals_before = [float(x) for x in wait_for(sq, "signals", 10).split()[1:]]
            time.sleep(settle_s / 2)
            res.window_cores = (tree_cpu_seconds(server.pid) - cpu0) / (time.monotonic() - t0)
            send("signals")
            res.signals_after = [float(x) for x in wait_for(sq, "signals", 10).split()[1:]]
            res.signals_delta = [a - b for a, b in zip(res.signals_after, res.signals_before, strict=True)]
        else:
            time.sleep(settle_s)
        res.rss_per_stream = (rss_bytes(server.pid) - rss0) / n
        window_cpu0, window_t0 = tree_cpu_seconds(server.pid), time.monotonic()
        for u in range(updates):
            while not sq.empty():
                sq.get_nowait()
            while not cq.empty():
                cq.get_nowait()  # EDS lines of earlier pushes (signals) are not this update's
            cpu0 = cpu_seconds(server.pid)
            send(f"update {u * 37 % c} {u + 1}")
            published = float(wait_for(sq, "published", 30).split()[2])
            got = collect(cq, "eds", n, 30 + n * 0.02)
            time.sleep(0.2)
            res.cpu_per_push.append(cpu_seconds(server.pid) - cpu0)
            res.conv += [float(x[2]) - published for x in got]
            res.spreads.append(max(float(x[2]) for x in got) - published)
            res.update_bytes += [int(x[3]) for x in got]
        if not signals:
            res.window_cores = (tree_cpu_seconds(server.pid) - window_cpu0) / (time.monotonic() - window_t0)
        if impl == "ours" and not server_args:
            time.sleep(2.0)  # let the server go idle (pushes are counted when their write completes)
            while not sq.empty():
                sq.get_nowait()
            before = settled_pushes()
            send("burst 100 1")
            end = time.monotonic() + 3.0
            while (left := end - time.monotonic()) > 0:
                try:
                    line = sq.get(timeout=left)
                except queue.Empty:
                    break
                if line.startswith("burst_done"):
                    res.burst_s = float(line.split()[1])
                elif line.startswith("published"):
                    res.burst_snapshots += 1
            while not cq.empty():
                cq.get_nowait()
            res.burst_pushes = (settled_pushes() - before) / n
            send("rebuild 3 999")
            res.rebuild_ms = float(wait_for(sq, "rebuilt", 10).split()[1]) * 1000
    finally:
        for p in clients:
            if p.stdin:
                p.stdin.close()
        for p in [*clients, server]:
            try:
                if p is server and server.stdin:
                    server.stdin.close()
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return res


def show(results: list[Result]) -> None:
    print()
    print(
        f"{'impl':<6} {'xds':<5} {'N':>5} {'C':>5} {'sync s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'max ms':>7} {'B/client':>9} {'cpu/push s':>10} {'KB/stream':>9} "
        f"{'burst pushes/snapshots/time':>28} {'rebuild ms':>10}"
    )
    for r in results:
        burst = (
            f"{r.burst_pushes:.2f}/{r.burst_snapshots}/{r.burst_s * 1000:.0f}ms"
            if r.burst_pushes is not None
            else "-"
        )
        rebuild = f"{r.rebuild_ms:.1f}" if r.rebuild_ms is not None else "-"
        print(
            f"{r.impl:<6} {r.transport:<5} {r.streams:>5} {r.clusters:>5} {r.sync_s:>7.2f} "
            f"{r.q(0.5) * 1000:>7.1f} {r.q(0.99) * 1000:>7.1f} {max(r.conv) * 1000:>7.1f} "
            f"{statistics.mean(r.update_bytes):>9.0f} {statistics.mean(r.cpu_per_push):>10.3f} "
            f"{r.rss_per_stream / 1024:>9.1f} {burst:>28} {rebuild:>10}"
        )
    print()
    print("ratios ours/floor (spread = max convergence; same run, same machine):")
    floor = {(r.transport, r.streams, r.clusters): r for r in results if r.impl == "floor"}
    for r in results:
        f = floor.get((r.transport, r.streams, r.clusters))
        if r.impl != "ours" or f is None:
            continue
        print(
            f"  {r.transport:<5} N={r.streams:<5} C={r.clusters:<5} "
            f"spread {max(r.conv) / max(f.conv):5.2f}x  "
            f"p99 {r.q(0.99) / f.q(0.99):5.2f}x  sync {r.sync_s / f.sync_s:5.2f}x  "
            f"cpu/push {statistics.mean(r.cpu_per_push) / max(1e-9, statistics.mean(f.cpu_per_push)):5.2f}x  "
            f"memory/stream +{(r.rss_per_stream - f.rss_per_stream) / 1024:.1f} KB"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="also N=5000")
    p.add_argument("--streams", type=int, nargs="*", help="override N values")
    p.add_argument("--clusters", type=int, nargs="*", help="override C values")
    p.add_argument("--transports", nargs="*", default=["sotw", "delta"])
    p.add_argument("--endpoints", type=int, default=10_000)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--workers", type=int, default=4)
    a = p.parse_args()
    ns = a.streams or ([100, 1000, 5000] if a.full else [100, 1000])
    cs = a.clusters or [10, 1000]
    results = []
    for transport in a.transports:
        for c in cs:
            for n in ns:
                for impl in ("floor", "ours"):
                    r = run_one(impl, transport, n, c, a.endpoints, a.updates, a.workers)
                    results.append(r)
                    print(
                        f"done {impl} {transport} N={n} C={c}: sync {r.sync_s:.2f}s "
                        f"spread {max(r.conv) * 1000:.1f}ms",
                        flush=True,
                    )
    show(results)


if __name__ == "__main__":
    main()
