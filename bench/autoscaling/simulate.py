"""Autoscaling on a surge trace, simulated: no autoscaling, reactive, reactive + predictive.

The trace (controlplane/sim/scalesim.py): Poisson arrivals following a daily shape (quiet
nights, a rise to 5x at mid-day) that repeats every season, plus one sudden 5x burst in the
measured (last) season at a time no season before had one. The scalers are the control
plane's own (KPA windows, forecasts chosen by backtest); the servers are the emulator's
service model. Every policy gets the same requests (same seed).

Printed per policy and seed: p90 latency over the predictable surge (the daily rise and the
minute after it), over the burst, and over the whole measured season; requests held,
refused and unfinished; GPU-seconds (replicas x time, warming included); and ratios against
reactive-only measured in the same run. "none" runs a fixed fleet sized for the season's
mean load and one sized for its peak.

    .venv/bin/python bench/autoscaling/simulate.py [--seeds 3] [--cold-start 30]
"""

from __future__ import annotations

import argparse
import math
import statistics

from controlplane.fleet.model import ScalingPolicy
from controlplane.sim.scalesim import Result, Trace, simulate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="traces to run (seeds 1..N; default %(default)s)")
    p.add_argument("--season", type=float, default=600.0, help="season length, s (default %(default)s)")
    p.add_argument(
        "--seasons", type=int, default=4, help="seasons; the last is measured (default %(default)s)"
    )
    p.add_argument(
        "--cold-start", type=float, default=30.0, help="replica cold start, s (default %(default)s)"
    )
    p.add_argument(
        "--slots", type=int, default=4, help="concurrent requests per replica (default %(default)s)"
    )
    p.add_argument("--target", type=float, default=3.0, help="target_per_replica (default %(default)s)")
    args = p.parse_args(argv)

    policy = ScalingPolicy(min_replicas=1, max_replicas=50, target_per_replica=args.target)
    rows: dict[str, list[Result]] = {}
    for seed in range(1, args.seeds + 1):
        trace = Trace(season_s=args.season, seasons=args.seasons, seed=seed)
        work = trace.work_s
        mean_rate = statistics.fmean(trace.rate(t) for t in range(int(trace.season_s)))
        peak_rate = trace.base_rps * trace.peak
        sized = {
            "none (mean)": math.ceil(mean_rate * work / args.target),
            "none (peak)": math.ceil(peak_rate * work / args.target),
        }
        runs = {
            **{
                k: simulate(
                    trace, "none", policy, fixed_replicas=n, slots=args.slots, cold_start_s=args.cold_start
                )
                for k, n in sized.items()
            },
            "reactive": simulate(trace, "reactive", policy, slots=args.slots, cold_start_s=args.cold_start),
            "reactive + predictive": simulate(
                trace, "predictive", policy, slots=args.slots, cold_start_s=args.cold_start
            ),
        }
        s0, s1 = trace.surge()
        b0, b1 = trace.burst()
        m = trace.measured_from()
        base = runs["reactive"]
        print(
            f"\nseed {seed}: season {trace.season_s:g}s x {trace.seasons} (last measured), cold start "
            f"{args.cold_start:g}s, {args.slots} slots, target {args.target:g}; fixed fleets {sized}"
        )
        print(
            f"{'policy':24} {'surge p90':>10} {'burst p90':>10} {'all p90':>8} {'held':>5} {'refused':>7} "
            f"{'unfinished':>10} {'GPU-s':>7} {'surge p90 / reactive':>21} {'GPU-s / reactive':>17}"
        )
        for name, r in runs.items():
            rows.setdefault(name, []).append(r)
            print(
                f"{name:24} {r.p90(s0, s1):10.1f} {r.p90(b0, b1):10.1f} {r.p90(m):8.1f} {r.held:5d} "
                f"{r.refused:7d} {r.unfinished:10d} {r.gpu_s:7.0f} {r.p90(s0, s1) / base.p90(s0, s1):21.2f} "
                f"{r.gpu_s / base.gpu_s:17.2f}"
            )
    if args.seeds > 1:
        print("\nmean over seeds of the ratios against reactive-only:")
        base_runs = rows["reactive"]
        for name, rs in rows.items():
            surge = statistics.fmean(
                r.p90(*Trace(season_s=args.season, seasons=args.seasons, seed=i + 1).surge())
                / b.p90(*Trace(season_s=args.season, seasons=args.seasons, seed=i + 1).surge())
                for i, (r, b) in enumerate(zip(rs, base_runs, strict=True))
            )
            gpu = statistics.fmean(r.gpu_s / b.gpu_s for r, b in zip(rs, base_runs, strict=True))
            print(f"  {name:24} surge p90 x{surge:.2f}  GPU-seconds x{gpu:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
