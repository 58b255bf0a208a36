"""The Prometheus signal source's CPU per round at fleet scale (issue 14: at most 100 ms of
control-plane CPU for 5,000 endpoints' signals per round).

A child process serves canned but realistic answers to the source's instant queries on
127.0.0.1 (what a Prometheus scraping N vLLM servers answers to `sum by (instance,
model_name) (...)`: one series per endpoint and query, sample times advancing every round,
about 30 latency buckets per endpoint where the histogram is asked). This process runs
the real `PrometheusSource` rounds and measures its own CPU (`time.process_time`) and wall
time per round; the server's CPU is not counted, as Prometheus's would not be.

Three fleets of N endpoints (models of 20 endpoints):
- steady: one version per model, so no latency histogram or success counter is asked (the
  normal case: only a rollout's analysis reads them);
- one rollout: one model with two versions (its 20 endpoints' histograms are asked);
- every model in a rollout: every endpoint's histogram (~30 series each), the worst case.

Baseline in the same run: `json.loads` of the same answer bodies, the floor for any
source that reads Prometheus's JSON in Python.

    .venv/bin/python bench/signals_scale/prometheus_source.py [--endpoints 5000] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import re
import socket
import statistics
import time
from typing import Any

from controlplane.fleet.model import (
    Endpoint,
    Fleet,
    ListenerSpec,
    Model,
    PrometheusSpec,
    SignalsSpec,
    Tier,
    Version,
)
from controlplane.obs.metrics import Metrics
from controlplane.signals.prometheus import BUCKETS, SAMPLE_TIME, PrometheusSource, build_queries
from controlplane.signals.store import EndpointKey, SignalStore

PER_MODEL = 20
# vLLM's request latency buckets (as the emulator's), plus +Inf: 30 series per endpoint.
LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(90.0, 120.0, 180.0, 240.0, 300.0, 480.0, 600.0, 960.0, 1200.0, 1920.0, 2400.0, 3600.0),
    *(5400.0, 7680.0),
)


def address(i: int) -> str:
    return f"127.{i // 65536 + 1}.{(i // 256) % 256}.{i % 256}:8000"


def model_of(i: int) -> str:
    return f"model-{i // PER_MODEL:04d}"


# ---- the canned Prometheus (child process) --------------------------------------------------


class CannedPrometheus:
    """Per-endpoint server state that advances by one scrape per round of queries."""

    def __init__(self, endpoints: int) -> None:
        rnd = random.Random(14)
        self.n = endpoints
        self.scraped = time.time() - 1.0
        self.running = [float(rnd.randint(0, 16)) for _ in range(endpoints)]
        self.waiting = [float(rnd.randint(0, 30)) for _ in range(endpoints)]
        self.kv = [round(rnd.uniform(0.05, 0.95), 4) for _ in range(endpoints)]
        self.count = [float(rnd.randint(1_000, 200_000)) for _ in range(endpoints)]
        self.latency = [c * rnd.uniform(2.0, 12.0) for c in self.count]
        self.tokens = [c * rnd.uniform(150, 400) for c in self.count]
        self.tpot = [t * rnd.uniform(0.01, 0.05) for t in self.tokens]
        self.asked_since_advance = 0

    def advance(self) -> None:
        """One more scrape of every server: counters grow, gauges move."""
        self.scraped += 1.0
        for i in range(self.n):
            done = float(i % 7 + 1)
            self.count[i] += done
            self.latency[i] += done * 6.5
            self.tokens[i] += done * 250
            self.tpot[i] += done * 250 * 0.03
            self.running[i] = float((int(self.running[i]) + i) % 17)

    def answer(self, query: str) -> bytes:
        now = round(time.time(), 3)
        name = self._name(query)
        only = re.search(r'=~"(.*)"\}\)$', query)  # an address filter: analysed endpoints only
        regex = re.compile(json.loads(f'"{only.group(1)}"')) if only else None
        items: list[dict[str, Any]] = []
        column = {
            SAMPLE_TIME: None,
            BUCKETS: None,
            "running": self.running,
            "waiting": self.waiting,
            "kv_use": self.kv,
            "latency_sum_s": self.latency,
            "latency_count": self.count,
            "successes": self.count,
            "token_latency_sum_s": self.tpot,
            "token_latency_count": self.tokens,
        }[name]
        for i in range(self.n):
            addr = address(i)
            if regex is not None and not regex.fullmatch(addr):
                continue
            if name == BUCKETS:
                count = self.count[i]
                for le in LATENCY_BUCKETS:
                    share = min(1.0, le / 30.0) ** 0.5
                    items.append(_item(addr, model_of(i), now, float(int(count * share)), le=repr(le)))
                items.append(_item(addr, model_of(i), now, count, le="+Inf"))
            else:
                v = self.scraped if column is None else column[i]
                items.append(_item(addr, model_of(i), now, v))
        body = {"status": "success", "data": {"resultType": "vector", "result": items}}
        return json.dumps(body, separators=(",", ":")).encode()

    @staticmethod
    def _name(query: str) -> str:
        if "timestamp(" in query:
            return SAMPLE_TIME
        if "_bucket" in query:
            return BUCKETS
        for name, metric in (
            ("running", "vllm:num_requests_running"),
            ("waiting", "vllm:num_requests_waiting"),
            ("kv_use", "vllm:kv_cache_usage_perc"),
            ("latency_sum_s", "vllm:e2e_request_latency_seconds_sum"),
            ("latency_count", "vllm:e2e_request_latency_seconds_count"),
            ("successes", "vllm:request_success_total"),
            ("token_latency_sum_s", "vllm:time_per_output_token_seconds_sum"),
            ("token_latency_count", "vllm:time_per_output_token_seconds_count"),
        ):
            if f"({metric})" in query or f"({metric}{{" in query:
                return name
        raise ValueError(f"unexpected query: {query[:200]}")


def _item(addr: str, model: str, now: float, value: float, **labels: str) -> dict[str, Any]:
    metric = dict(sorted({"instance": addr, "model_name": model, **labels}.items()))  # as Prometheus
    return {"metric": metric, "value": [now, repr(value)]}


def _serve(endpoints: int, port: int, ready: Any) -> None:
    from aiohttp import web

    canned = CannedPrometheus(endpoints)

    async def advance(request: web.Request) -> web.Response:
        canned.advance()
        return web.Response(text="ok")

    async def query(request: web.Request) -> web.Response:
        text = request.query.get("query") or str((await request.post()).get("query", ""))
        return web.Response(body=canned.answer(text), content_type="application/json")

    async def main() -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/api/v1/query", query)
        app.router.add_post("/advance", advance)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


# ---- the measurement (this process) ---------------------------------------------------------


def fleet_of(endpoints: int, url: str, rollouts: str) -> Fleet:
    """Models of PER_MODEL endpoints; `rollouts`: none, one or all models with two versions."""
    models = []
    for first in range(0, endpoints, PER_MODEL):
        eps = tuple(
            Endpoint(address(i).rsplit(":", 1)[0], 8000)
            for i in range(first, min(endpoints, first + PER_MODEL))
        )
        two = rollouts == "all" or (rollouts == "one" and first == 0)
        versions = (
            (Version("v1", eps[: len(eps) // 2]), Version("v2", eps[len(eps) // 2 :]))
            if two
            else (Version("v1", eps),)
        )
        models.append(Model(name=model_of(first), tier="small", stable="v1", versions=versions, params_b=8))
    return Fleet(
        listener=ListenerSpec(port=10000),
        tiers=(Tier("small", 15.0),),
        models=tuple(models),
        signals=SignalsSpec(
            source="prometheus",
            stale_after_s=30.0,
            stale_full_s=60.0,
            prometheus=PrometheusSpec(url=url, interval_s=1.0, timeout_s=10.0),
        ),
    )


def _targets(fleet: Fleet) -> list[EndpointKey]:
    return [(m.name, ep.address) for m in fleet.models for v in m.versions for ep in v.endpoints]


async def _rounds(url: str, fleet: Fleet, rounds: int) -> dict[str, float]:
    import aiohttp

    targets = _targets(fleet)
    tick = [0.0]
    source = PrometheusSource(fleet, Metrics(), clock=lambda: tick[0])
    store = SignalStore()
    cpu: list[float] = []
    wall: list[float] = []
    fold: list[float] = []
    delivered: list[int] = []
    floor: list[float] = []
    queries = build_queries("instance", [])
    try:
        async with aiohttp.ClientSession() as admin:
            for r in range(rounds + 1):
                async with admin.post(f"{url}/advance") as resp:
                    assert resp.status == 200
                tick[0] += fleet.signals.prometheus.interval_s if fleet.signals.prometheus else 1.0
                c0, w0 = time.process_time(), time.perf_counter()
                results = await source.collect(fleet, targets)
                c1, w1 = time.process_time(), time.perf_counter()
                now = time.monotonic()
                for key, result in results.items():
                    store.record_scrape(key, result, now)
                c2 = time.process_time()
                if r == 0:
                    continue  # the first round opens connections and warms caches
                cpu.append(c1 - c0)
                wall.append(w1 - w0)
                fold.append(c2 - c1)
                delivered.append(sum(1 for x in results.values() if x.sample is not None))
            # The floor: decoding the same answers' bodies, nothing else.
            bodies = []
            for q in (
                *queries,
                *[q for q in build_queries("instance", _buckets(fleet)) if q.name == BUCKETS],
            ):
                async with admin.post(f"{url}/api/v1/query", data={"query": q.promql}) as resp:
                    bodies.append(await resp.read())
            for _ in range(3):
                c0 = time.process_time()
                for body in bodies:
                    json.loads(body)
                floor.append(time.process_time() - c0)
    finally:
        await source.close()
    assert source.failed_rounds == 0, "the canned Prometheus failed a round"
    return {
        "cpu_ms_per_round": 1000 * sum(cpu) / len(cpu),
        "cpu_ms_per_round_median": 1000 * statistics.median(cpu),
        "cpu_ms_per_round_min": 1000 * min(cpu),
        "cpu_ms_per_round_max": 1000 * max(cpu),
        "wall_ms_per_round": 1000 * sum(wall) / len(wall),
        "store_fold_cpu_ms_per_round": 1000 * sum(fold) / len(fold),
        "json_floor_cpu_ms": 1000 * min(floor),
        "samples_per_round": sum(delivered) / len(delivered),
    }


def _buckets(fleet: Fleet) -> list[str]:
    from controlplane.signals.prometheus import analysed_addresses

    return analysed_addresses(fleet)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(endpoints: int = 5000, rounds: int = 20, worst_case_rounds: int = 3) -> dict[str, float]:
    """CPU and wall per round of the Prometheus source for `endpoints` endpoints: steady
    (no histogram asked), with one model in a rollout, and with every model in one."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    ready = ctx.Event()
    server = ctx.Process(target=_serve, args=(endpoints, port, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the canned Prometheus did not start")
        url = f"http://127.0.0.1:{port}"
        out: dict[str, float] = {"endpoints": float(endpoints), "rounds": float(rounds)}
        for label, rollouts, n in (
            ("", "none", rounds),
            ("one_rollout_", "one", rounds),
            ("all_rollouts_", "all", worst_case_rounds),
        ):
            figures = asyncio.run(_rounds(url, fleet_of(endpoints, url, rollouts), n))
            out.update({f"{label}{k}": v for k, v in figures.items()})
        out["cpu_ms_per_round_vs_json_floor"] = out["cpu_ms_per_round"] / out["json_floor_cpu_ms"]
        return out
    finally:
        server.terminate()
        server.join(10)
        if server.is_alive():
            server.kill()
            server.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--worst-case-rounds", type=int, default=3)
    args = parser.parse_args()
    figures = measure(args.endpoints, args.rounds, args.worst_case_rounds)
    width = max(map(len, figures))
    for key, value in figures.items():
        print(f"{key:<{width}}  {value:10.2f}")
    target = 100.0 * args.endpoints / 5000
    verdict = "within" if figures["cpu_ms_per_round"] <= target else "OVER"
    print(
        f"\nsteady round: {figures['cpu_ms_per_round']:.1f} ms CPU (median "
        f"{figures['cpu_ms_per_round_median']:.1f}) for {args.endpoints} endpoints ({verdict} the "
        f"{target:.0f} ms target); {figures['cpu_ms_per_round_vs_json_floor']:.2f}x json.loads of the "
        "same answers, measured in the same run (the machine's noise cancels in the ratio)"
    )


if __name__ == "__main__":
    main()
