"""Load-balancing quality, simulated: latency and goodput of each balancer on a GPU fleet.

Run: .venv/bin/python bench/lb_quality/simulate.py [--quick] [--fleet NAME ...] [--load X ...]

A discrete-event simulation (controlplane.sim.fleetsim) of inference servers behind K
sidecars. The same requests (open-loop Poisson, lognormal prompt and output sizes) go
through every balancer:

  round_robin    per sidecar
  random         uniform
  least_request  Envoy least request, equal weights: a full scan (as configured), own view
  capacity_lr    Envoy least request, static weights = slots x speed (EDF), own view
  adaptive       Envoy least request with the weights the control plane pushes: every
                 period a scrape (signal_delay old when applied) -> policies.adaptive ->
                 policies.smooth -> every sidecar
  picker         per-request full scan of every server's true state (endpoint picker)
  central_queue  one global FIFO feeding free slots, fastest server first (reference)

Load is a fraction of the fleet's capacity (sum of slots x speed over the mean service
time). Figures: p50/p90/p99 end-to-end latency, the fraction of requests within the SLO
(slo-factor x the unloaded mean service time on a speed-1.0 GPU) and that goodput in
requests/s, and p90 ratios against the balancers measured in the same run. Latencies of
all seeds are pooled. Nothing passes or fails: read the ratios.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from controlplane.balancing.policies import PolicyConfig, SmoothingConfig
from controlplane.sim.fleetsim import (
    BALANCERS,
    Bursts,
    ControllerConfig,
    RunResult,
    Workload,
    capacity_rps,
    make_requests,
    simulate,
)
from controlplane.sim.service import ServerSpec


def _gpu(slots: int, speed: float) -> ServerSpec:
    # KV sized so a full batch of average requests uses about 40% of it.
    return ServerSpec(slots=slots, speed=speed, kv_capacity_tokens=2000 * slots)


def _bench_gpu(speed: float) -> ServerSpec:
    """A server as bench/lb_quality/real.py runs it: `controlplane emulate --slots 4
    --decode-ms-per-token 10 --prefill-ms-per-token 0.5`."""
    return ServerSpec(slots=4, speed=speed, prefill_s_per_token=0.0005, decode_s_per_token=0.01)


DEFAULT_WORK = Workload()
# bench/lb_quality/real.py's requests: a 32-token prompt, lognormal output (median 24,
# clipped to 1..400): mean service 0.375 s at speed 1, 13x shorter than the default.
REAL_BENCH_WORK = Workload(
    prompt_median=32.0, prompt_sigma=0.0, output_median=24.0, output_sigma=0.9, output_min=1, output_max=400
)


@dataclass(frozen=True)
class Fleet:
    servers: tuple[ServerSpec, ...]
    bursts: Bursts | None = None
    about: str = ""
    workload: Workload = DEFAULT_WORK


FLEETS: dict[str, Fleet] = {
    "homogeneous": Fleet(tuple([_gpu(8, 1.0)] * 8), about="8 x (8 slots, speed 1.0)"),
    "two_class": Fleet(
        tuple([_gpu(8, 1.0)] * 4 + [_gpu(8, 0.35)] * 4),
        about="4 x (8 slots, 1.0) + 4 x (8 slots, 0.35)",
    ),
    "three_class": Fleet(
        tuple([_gpu(16, 1.0)] * 2 + [_gpu(8, 0.5)] * 3 + [_gpu(8, 0.25)] * 4),
        about="2 x (16 slots, 1.0) + 3 x (8, 0.5) + 4 x (8, 0.25)",
    ),
    "two_class_bursts": Fleet(
        tuple([_gpu(8, 1.0)] * 4 + [_gpu(8, 0.35)] * 4),
        bursts=Bursts(period_s=60.0, high=1.4, low=0.6),
        about="two_class; arrivals alternate 30 s at 1.4x and 30 s at 0.6x the mean rate",
    ),
    "real_bench_homogeneous": Fleet(
        tuple([_bench_gpu(1.0)] * 8),
        about="real.py --per-class 4 --slow-speed 1.0: 8 x (4 slots, 1.0), mean service 0.375 s",
        workload=REAL_BENCH_WORK,
    ),
    "real_bench": Fleet(
        tuple([_bench_gpu(1.0)] * 4 + [_bench_gpu(0.35)] * 4),
        about="the fleet and requests of bench/lb_quality/real.py --per-class 4: 4 x (4 slots, 1.0) "
        "+ 4 x (4 slots, 0.35), mean service 0.375 s at speed 1 (not in the default matrix)",
        workload=REAL_BENCH_WORK,
    ),
}
DEFAULT_FLEETS = ("homogeneous", "two_class", "three_class", "two_class_bursts")
LOADS = (0.5, 0.7, 0.85, 0.95)


@dataclass(frozen=True)
class Point:
    fleet: str
    load: float
    seed: int


@dataclass(frozen=True)
class Options:
    balancers: tuple[str, ...]
    sidecars: int
    duration_s: float
    warmup_s: float
    slo_factor: float
    controller: ControllerConfig


def run_point(point: Point, opt: Options) -> tuple[Point, dict[str, RunResult]]:
    """Every balancer on the same requests (one fleet, load and seed)."""
    fleet = FLEETS[point.fleet]
    workload = fleet.workload
    rate = point.load * capacity_rps(fleet.servers, workload)
    requests = make_requests(rate, opt.duration_s, workload, opt.sidecars, point.seed, fleet.bursts)
    out = {
        b: simulate(
            fleet.servers,
            requests,
            b,
            sidecars=opt.sidecars,
            seed=point.seed,
            controller=opt.controller,
            workload=workload,
            warmup_s=opt.warmup_s,
            slo_s=opt.slo_factor * workload.mean_service_s(fleet.servers[0]),
        )
        for b in opt.balancers
    }
    return point, out


@dataclass
class Pooled:
    latencies: list[float]
    slo_s: float
    weighted_picks: float
    pushes: float

    def q(self, pct: float) -> float:
        xs = self.latencies
        return xs[min(len(xs) - 1, max(0, math.ceil(pct / 100 * len(xs)) - 1))] if xs else math.nan


def pool(results: list[RunResult]) -> Pooled:
    lat = sorted(x for r in results for x in r.latencies)
    return Pooled(
        lat,
        results[0].slo_s,
        sum(r.weighted_picks for r in results) / len(results),
        sum(r.pushes for r in results) / len(results),
    )


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and math.isfinite(b) and math.isfinite(a) else "-"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=(__doc__.split("\n\n", 1)[1]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="one seed, 400 s, 85%% load only (a few seconds)")
    p.add_argument("--fleet", action="append", choices=sorted(FLEETS), help="repeatable; default: all")
    p.add_argument(
        "--load",
        action="append",
        type=float,
        help="fraction of capacity, repeatable; default: 0.5 0.7 0.85 0.95",
    )
    p.add_argument(
        "--balancer",
        action="append",
        help=f"repeatable; default: {' '.join(BALANCERS)}; also policy:NAME for any policy in POLICIES",
    )
    p.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per point, latencies pooled (default 3)")
    p.add_argument("--sidecars", type=int, default=4, help="Envoy sidecars, each with its own view (4)")
    p.add_argument(
        "--duration", type=float, default=1200.0, help="simulated seconds of arrivals per seed (1200)"
    )
    p.add_argument(
        "--warmup", type=float, default=60.0, help="requests arriving earlier are not measured (60 s)"
    )
    p.add_argument("--period", type=float, default=1.0, help="controller update period, s (1.0)")
    p.add_argument("--delay", type=float, default=0.5, help="age of the scraped signals when applied, s")
    p.add_argument("--slo-factor", type=float, default=3.0, help="SLO = this x unloaded mean service time")
    p.add_argument("--no-smoothing", action="store_true", help="push the policy's weights unsmoothed")
    p.add_argument(
        "--speed-exponent",
        type=float,
        default=PolicyConfig().speed_exponent,
        help="adaptive's preference for fast GPUs by time per output token (0: none)",
    )
    p.add_argument(
        "--no-token-latency",
        action="store_true",
        help="servers do not report the time per output token (adaptive falls back to e2e latency)",
    )
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    a = p.parse_args()

    fleets = a.fleet or list(DEFAULT_FLEETS)
    loads = a.load or ([0.85] if a.quick else list(LOADS))
    seeds = [a.seed] if a.quick else [a.seed + k for k in range(a.seeds)]
    duration = 400.0 if a.quick else a.duration
    balancers = tuple(a.balancer or BALANCERS)
    unloaded = Workload().mean_service_s(ServerSpec(speed=1.0))
    opt = Options(
        balancers=balancers,
        sidecars=a.sidecars,
        duration_s=duration,
        warmup_s=min(a.warmup, duration / 4),
        slo_factor=a.slo_factor,
        controller=ControllerConfig(
            period_s=a.period,
            signal_delay_s=a.delay,
            policy_config=PolicyConfig(speed_exponent=a.speed_exponent),
            smoothing=None if a.no_smoothing else SmoothingConfig(),
            token_latency=not a.no_token_latency,
        ),
    )
    points = [Point(f, ld, s) for f in fleets for ld in loads for s in seeds]
    print(
        f"# {len(points)} points x {len(balancers)} balancers; {a.sidecars} sidecars; "
        f"{duration:.0f} s per seed, seeds {seeds}; update every {a.period} s with signals "
        f"{a.delay} s old; mean service {unloaded:.2f} s at speed 1.0 (real_bench: 0.375 s), "
        f"SLO {a.slo_factor:g} x that",
        flush=True,
    )
    started = time.monotonic()
    results: dict[tuple[str, float], dict[str, list[RunResult]]] = {}
    if a.jobs > 1 and len(points) > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            done = list(ex.map(run_point, points, [opt] * len(points)))
    else:
        done = [run_point(pt, opt) for pt in points]
    for pt, out in done:
        cell = results.setdefault((pt.fleet, pt.load), {b: [] for b in balancers})
        for b, r in out.items():
            cell[b].append(r)
    elapsed = time.monotonic() - started

    report(results, fleets, loads, duration, (duration - opt.warmup_s) * len(seeds))
    print(f"\n# {elapsed:.1f} s wall, {a.jobs} jobs")


Cell = dict[str, list[RunResult]]  # balancer -> one result per seed


def report(
    results: dict[tuple[str, float], Cell],
    fleets: list[str],
    loads: list[float],
    duration: float,
    measured_s: float,
) -> None:
    """A table per fleet, then the adaptive policy's ratios against the baselines."""
    summary: list[str] = []
    for f in fleets:
        print(f"\n## {f}: {FLEETS[f].about}\n")
        print("| load | balancer | p50 s | p90 s | p99 s | in SLO | goodput rps | p90 vs: picker | RR | LR |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for ld in loads:
            cell = results[(f, ld)]
            pooled = {b: pool(rs) for b, rs in cell.items()}
            p90 = {b: pr.q(90) for b, pr in pooled.items()}
            pk, rr, lr = (p90.get(k, math.nan) for k in ("picker", "round_robin", "least_request"))
            for b, pr in pooled.items():
                within = sum(1 for x in pr.latencies if x <= pr.slo_s)
                name = b
                if b == "adaptive":
                    per_min = pr.pushes / (duration / 60)
                    name += f" (EDF {pr.weighted_picks:.0%} of picks, {per_min:.0f} pushes/min)"
                print(
                    f"| {ld:.2f} | {name} | {pr.q(50):.2f} | {p90[b]:.2f} | {pr.q(99):.2f} | "
                    f"{within / len(pr.latencies):.3f} | {within / measured_s:.2f} | "
                    f"{ratio(p90[b], pk)} | {ratio(p90[b], rr)} | {ratio(p90[b], lr)} |"
                )
            if "adaptive" in cell and "picker" in cell:
                per_seed = [
                    a.percentile(90) / p.percentile(90)
                    for a, p in zip(cell["adaptive"], cell["picker"], strict=True)
                ]
                ad = p90["adaptive"]
                summary.append(
                    f"| {f} | {ld:.2f} | {ratio(ad, pk)} ({min(per_seed):.2f}-{max(per_seed):.2f}) | "
                    f"{ratio(ad, rr)} | {ratio(ad, lr)} | {ratio(p90.get('capacity_lr', math.nan), pk)} |"
                )
    if summary:
        print("\n## adaptive p90 against the baselines (in brackets: per-seed range of the picker ratio)\n")
        print("| fleet | load | vs picker | vs round robin | vs equal-weight LR | capacity LR vs picker |")
        print("|---|---|---|---|---|---|")
        print("\n".join(summary))


if __name__ == "__main__":
    main()
