"""Autoscaling through the real stack, on a surge trace: reactive, reactive + predictive, and
a fixed fleet sized for the mean load.

Per policy: the control plane with the `emulator` provider (it starts and stops
`controlplane emulate` servers with a real cold start, following desired replicas), a real
Envoy, and the trace replayed open loop from its own process (`tracegen.py`). The trace is
the simulation's (controlplane/sim/scalesim.py) compressed in time: a season of `--season`
seconds, a daily rise to 5x, one 5x burst in the last season; the last season is measured.

Printed per policy: p90 latency over the predictable surge, over the burst and over the
measured season; requests held (answered after waiting for a server), failed; GPU-seconds
(emulated servers x time alive, warming included, from the provider's start and stop log
lines); ratios against reactive-only measured in the same run.

    .venv/bin/python bench/autoscaling/real.py [--season 120] [--policies reactive,predictive,none]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE.parent / "lb_quality"))

from real import Stack, free_port, start_proxied  # noqa: E402

from controlplane.sim.scalesim import Trace  # noqa: E402

MODEL = "bench-8b"
DECODE_MS = 20.0


def fleet_yaml(listener: int, args: argparse.Namespace, policy: str, fixed: int) -> str:
    scaling = {
        "min": fixed if policy == "none" else 1,
        "max": fixed if policy == "none" else args.max,
        "target_per_replica": args.target,
        "stable_window": f"{args.stable_window:g}s",
        "panic_window": f"{args.panic_window:g}s",
        "predictive": policy == "predictive",
        "season": f"{args.season:g}s",
        "forecast_bucket": f"{args.bucket:g}s",
        "cold_start": f"{args.cold_start:g}s",
    }
    return json.dumps(
        {
            "listener": {"port": listener},
            "autoscaling": {
                "provider": "emulator",
                "emulator": {
                    "cold_start": f"{args.cold_start:g}s",
                    "slots": args.slots,
                    "decode_ms_per_token": DECODE_MS,
                },
            },
            "tiers": {"small": {"max_params_b": 15, "timeout": "300s", "autoscaling": scaling}},
            "models": {MODEL: {"params_b": 8, "stable": "v1", "versions": {"v1": {"endpoints": []}}}},
        }
    )


def metric(port: int, name: str, extra: str = "") -> float | None:
    """A series of the model from the control plane's /metrics (`extra`: another label, as text)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") and f'model="{MODEL}"' in line and extra in line:
                return float(line.rsplit(" ", 1)[1])
    return None


def gpu_seconds(log: Path, start: float, end: float) -> tuple[float, int]:
    """Emulated servers x seconds alive within [start, end] (unix), and the most alive at once."""
    began: dict[str, float] = {}
    spans: list[tuple[float, float]] = []
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        if e.get("event") not in ("emulated server started", "emulated server stopped"):
            continue
        t = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        if e["event"] == "emulated server started":
            began[e["address"]] = t
        elif e["address"] in began:
            spans.append((began.pop(e["address"]), t))
    spans += [(t, end) for t in began.values()]
    total = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    alive = peak = 0
    for _, d in edges:
        alive += d
        peak = max(peak, alive)
    return total, peak


def run_policy(policy: str, trace: Trace, args: argparse.Namespace, fixed: int) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix=f"autoscale-{policy}-"))
    stack = Stack(workdir)
    try:
        listener, admin = free_port(), free_port()
        config = workdir / "fleet.yaml"
        config.write_text(fleet_yaml(listener, args, policy, fixed))
        serve_args = ["--admin-listen", f"127.0.0.1:{admin}", "--log-format", "json"]
        metrics = start_proxied(stack, workdir, config, listener, f"bench-{policy}", serve_args)
        want = fixed if policy == "none" else 1
        deadline = time.monotonic() + 60
        while (metric(metrics, "controlplane_model_ready_replicas") or 0) < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{want} replicas not ready within 60 s")
            time.sleep(0.5)
        fields = {k: getattr(trace, k) for k in trace.__dataclass_fields__}
        load = subprocess.run(
            [
                sys.executable,
                str(HERE / "tracegen.py"),
                "--target",
                f"127.0.0.1:{listener}",
                "--model",
                MODEL,
                "--trace",
                json.dumps(fields),
                "--decode-s",
                str(DECODE_MS / 1000),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        lines = [json.loads(x) for x in load.stdout.splitlines() if x.strip()]
        start_wall = lines[0]["start_wall"]
        records = lines[1:]
        end = trace.seasons * trace.season_s
        gpu, peak = gpu_seconds(
            workdir / "controlplane.log", start_wall + trace.measured_from(), start_wall + end
        )
        held = metric(metrics, "controlplane_hold_requests_total", 'outcome="forwarded"')
        return {"records": records, "gpu_s": gpu, "peak": peak, "held": held, "workdir": str(workdir)}
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def p90(records: list[dict[str, object]], start: float, end: float) -> float:
    xs = sorted(float(r["latency"]) for r in records if start <= float(r["sent"]) < end)  # type: ignore[arg-type]
    return xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)] if xs else math.nan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--policies", default="reactive,predictive,none", help="comma-separated (default %(default)s)"
    )
    p.add_argument("--season", type=float, default=120.0, help="season, s (default %(default)s)")
    p.add_argument(
        "--seasons", type=int, default=3, help="seasons; the last is measured (default %(default)s)"
    )
    p.add_argument("--bucket", type=float, default=2.0, help="forecast bucket, s (default %(default)s)")
    p.add_argument(
        "--cold-start", type=float, default=6.0, help="emulated cold start, s (default %(default)s)"
    )
    p.add_argument("--slots", type=int, default=4, help="slots per server (default %(default)s)")
    p.add_argument("--target", type=float, default=3.0, help="target_per_replica (default %(default)s)")
    p.add_argument("--max", type=int, default=24, help="max replicas (default %(default)s)")
    p.add_argument("--stable-window", type=float, default=12.0, help="s (default %(default)s)")
    p.add_argument("--panic-window", type=float, default=2.0, help="s (default %(default)s)")
    p.add_argument("--base-rps", type=float, default=10.0, help="night rate (default %(default)s)")
    p.add_argument("--work", type=float, default=0.8, help="mean service time, s (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep each run's work directory and logs")
    args = p.parse_args(argv)
    trace = Trace(
        season_s=args.season,
        seasons=args.seasons,
        base_rps=args.base_rps,
        rise_s=args.cold_start,
        burst_s=args.cold_start,
        work_s=args.work,
        surge_tail_s=2 * args.cold_start,
        seed=args.seed,
    )
    mean_rate = sum(trace.rate(t) for t in range(int(trace.season_s))) / trace.season_s
    fixed = math.ceil(mean_rate * trace.work_s / args.target)
    results = {}
    for policy in args.policies.split(","):
        started = time.monotonic()
        results[policy] = run_policy(policy, trace, args, fixed)
        print(f"{policy}: ran in {time.monotonic() - started:.0f}s", file=sys.stderr)
    s0, s1 = trace.surge()
    b0, b1 = trace.burst()
    m, end = trace.measured_from(), trace.seasons * trace.season_s
    base = results.get("reactive")
    print(
        f"season {args.season:g}s x {args.seasons} (last measured), cold start {args.cold_start:g}s, "
        f"{args.slots} slots, target {args.target:g}, none = {fixed} fixed servers"
    )
    print(
        f"{'policy':12} {'surge p90':>9} {'burst p90':>9} {'all p90':>8} {'requests':>8} {'failed':>6} "
        f"{'held':>6} {'GPU-s':>7} {'peak':>4} {'surge p90 / reactive':>20} {'GPU-s / reactive':>16}"
    )
    for name, r in results.items():
        rec = r["records"]  # type: ignore[index]
        measured = [x for x in rec if m <= x["sent"] < end]  # type: ignore[union-attr]
        failed = sum(1 for x in measured if x["status"] != 200)  # type: ignore[index]
        sp = p90(rec, s0, s1)  # type: ignore[arg-type]
        ratio = f"{sp / p90(base['records'], s0, s1):20.2f}" if base else f"{'-':>20}"  # type: ignore[arg-type,index]
        gratio = f"{r['gpu_s'] / base['gpu_s']:16.2f}" if base else f"{'-':>16}"  # type: ignore[operator,index]
        print(
            f"{name:12} {sp:9.2f} {p90(rec, b0, b1):9.2f} {p90(rec, m, end):8.2f} {len(measured):8d} "  # type: ignore[arg-type]
            f"{failed:6d} {r['held'] or 0:6.0f} {r['gpu_s']:7.0f} {r['peak']:4d} {ratio} {gratio}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
