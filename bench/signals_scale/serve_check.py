"""`controlplane serve` itself, as a user runs it: N proxies, E unreachable endpoints.

  .venv/bin/python bench/signals_scale/serve_check.py                  # 1,000 proxies, 2,000 hung
  .venv/bin/python bench/signals_scale/serve_check.py --streams 200

Starts the real `controlplane serve` on a fleet file of C models x E/C endpoints that all
hang (they accept connections and never answer), connects N simulated Envoy ADS clients
(bench/xds_fanout/clients.py), and reports how long until every client has its initial
config; then edits the fleet file K times (one endpoint added to, then removed from, a
model) and reports, per edit, the time from the file write to the last client receiving
the new assignment. Then the same with `signals: {enabled: false}` in the same run.
Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def _fanout() -> ModuleType:
    spec = importlib.util.spec_from_file_location("xds_fanout_run", HERE.parent / "xds_fanout" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fanout = _fanout()


def fleet_yaml(addresses: list[str], models: int, signals: bool, port: int, extra: str | None = None) -> str:
    per = len(addresses) // models
    lines = [
        f"listener: {{port: {port}}}",
        "tiers: {all: {}}",
        "signals: {interval: 1s, timeout: 500ms}" if signals else "signals: {enabled: false}",
        "models:",
    ]
    for m in range(models):
        eps = addresses[m * per : (m + 1) * per]
        if m == 0 and extra:
            eps = [*eps, extra]
        versions = f"{{v1: {{endpoints: [{', '.join(eps)}]}}}}"
        lines.append(f"  m{m}: {{params_b: 8, stable: v1, versions: {versions}}}")
    return "\n".join(lines) + "\n"


def quiet(cq: queue.Queue[str], seconds: float, limit: float) -> None:
    """Wait until no client line has arrived for `seconds` (at most `limit`)."""
    end = time.monotonic() + limit
    last = time.monotonic()
    while time.monotonic() < end and time.monotonic() - last < seconds:
        try:
            cq.get(timeout=0.1)
            last = time.monotonic()
        except queue.Empty:
            pass


def run(signals: bool, addresses: list[str], a: argparse.Namespace, tmp: Path) -> tuple[float, list[float]]:
    state = tmp / ("state-on" if signals else "state-off")
    config = tmp / "fleet.yaml"
    port = fanout.free_port()
    base = fleet_yaml(addresses, a.models, signals, port)
    config.write_text(base)
    xds = fanout.free_port()
    cp = subprocess.Popen(
        [
            str(BIN / "controlplane"),
            "serve",
            "--config",
            str(config),
            "--xds-listen",
            f"127.0.0.1:{xds}",
            "--metrics-listen",
            f"127.0.0.1:{fanout.free_port()}",
            "--admin-listen",
            f"127.0.0.1:{fanout.free_port()}",
            "--state-dir",
            str(state),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    clients: list[subprocess.Popen[str]] = []
    cq: queue.Queue[str] = queue.Queue()
    try:
        launched = time.monotonic()
        while True:  # until it listens (it serves xDS once the first snapshot is built)
            try:
                socket.create_connection(("127.0.0.1", xds), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() - launched > 60:
                    raise RuntimeError("controlplane serve did not listen within 60 s") from None
                time.sleep(0.05)
        print(f"  listening {time.monotonic() - launched:.2f}s after the launch", flush=True)
        started = time.monotonic()
        per = [a.streams // a.workers + (1 if i < a.streams % a.workers else 0) for i in range(a.workers)]
        for i, k in enumerate(per):
            p = subprocess.Popen(
                [
                    sys.executable,
                    str(HERE.parent / "xds_fanout" / "clients.py"),
                    *("--target", f"127.0.0.1:{xds}", "--streams", str(k), "--worker", f"w{i}"),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            clients.append(p)
            fanout.Lines(p, cq)
        synced = fanout.collect(cq, "sync", a.streams, 120 + a.streams * 0.1)
        times = sorted(float(x[2]) - started for x in synced)
        sync_s = times[-1]
        print(
            f"  signals {'on' if signals else 'off'}: initial sync p10 {times[len(times) // 10]:.2f}s, "
            f"p50 {times[len(times) // 2]:.2f}s, p90 {times[len(times) * 9 // 10]:.2f}s, max {sync_s:.2f}s",
            flush=True,
        )
        quiet(cq, 2.0, 60.0)
        edits: list[float] = []
        for k in range(a.edits):
            while not cq.empty():
                cq.get_nowait()
            extra = f"127.0.0.1:{fanout.free_port()}" if k % 2 == 0 else None
            written = time.monotonic()
            config.write_text(fleet_yaml(addresses, a.models, signals, port, extra))
            got = fanout.collect(cq, "eds", a.streams, 60)
            edits.append(max(float(x[2]) for x in got) - written)
            quiet(cq, 1.5, 30.0)
        return sync_s, edits
    finally:
        for p in clients:
            if p.stdin:
                p.stdin.close()
        for p in clients:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        os.killpg(cp.pid, signal.SIGTERM)
        try:
            cp.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(cp.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--endpoints", type=int, default=2000)
    ap.add_argument("--models", type=int, default=100)
    ap.add_argument("--edits", type=int, default=6)
    ap.add_argument("--workers", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = tmp / "hung.txt"
        targets = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "targets.py"),
                "--live",
                "0",
                "--hung",
                str(a.endpoints),
                "--out",
                str(out),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert targets.stdout is not None and targets.stdout.readline().strip() == "ready"
            addresses = out.read_text().split()
            results = {}
            for signals in (False, True):
                results[signals] = run(signals, addresses, a, tmp)
                sync_s, edits = results[signals]
                print(
                    f"signals {'on ' if signals else 'off'}: {a.streams} proxies synced in {sync_s:.2f}s; "
                    f"edit -> last proxy: p50 {statistics.median(edits) * 1000:.0f} ms, "
                    f"max {max(edits) * 1000:.0f} ms ({', '.join(f'{e * 1000:.0f}' for e in edits)})",
                    flush=True,
                )
        finally:
            if targets.stdin:
                targets.stdin.close()
            targets.wait(10)
    (s_off, e_off), (s_on, e_on) = results[False], results[True]
    print(
        f"ratios on/off ({a.endpoints} unreachable endpoints): sync {s_on / s_off:.2f}x, "
        f"edit p50 {statistics.median(e_on) / statistics.median(e_off):.2f}x, "
        f"max {max(e_on) / max(e_off):.2f}x"
    )


if __name__ == "__main__":
    main()
