"""Discrete-event simulation of a fleet of inference servers behind K sidecars (pure, seeded).

Servers are `BatchingServer`s (continuous batching, FIFO wait for a slot). Requests
arrive open-loop (Poisson, optionally in bursts) at a random sidecar. A balancer decides
where each goes:

- sidecar balancers (`round_robin`, `random`, `least_request`, `capacity_lr`, and the
  controller-driven `adaptive` or `policy:<name>`) see only their own sidecar's requests
  in flight, as Envoy does (`controlplane.sim.pickers`);
- `picker` looks at every server's true state for every request (an endpoint picker);
- `central_queue` holds requests in one global FIFO and hands each to a free slot,
  fastest server first: the reference no balancer that routes on arrival can beat by much.

Controller-driven balancers get their weights the way production does: every
`period_s` a scrape samples each server (running, waiting, KV use; mean latency and time
per output token of the requests finished since the last scrape, smoothed), the weights
computed from it with the real policy and smoothing code (`controlplane.balancing.policies`)
reach every sidecar `signal_delay_s` later, and each sidecar rebuilds its schedule when
they changed.

The same seed gives the same requests to every balancer (common random numbers), so
balancers are compared on identical traffic.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from controlplane.balancing.policies import POLICIES, PolicyConfig, SmoothingConfig, smooth
from controlplane.signals.load import EndpointLoad
from controlplane.sim.pickers import LeastRequest, RandomPick, RoundRobin, ServerView, full_scan_pick
from controlplane.sim.service import BatchingServer, Completed, ServerSpec

BALANCERS = (
    "round_robin",
    "random",
    "least_request",
    "capacity_lr",
    "adaptive",
    "picker",
    "central_queue",
)


@dataclass(frozen=True)
class Workload:
    """Request sizes: prompt and output tokens, each lognormal and clipped."""

    prompt_median: float = 400.0
    prompt_sigma: float = 1.0
    prompt_max: int = 8000
    output_median: float = 150.0
    output_sigma: float = 1.0
    output_min: int = 10
    output_max: int = 2000

    def sample(self, rng: random.Random) -> tuple[int, int]:
        prompt = min(
            self.prompt_max,
            max(1, round(rng.lognormvariate(math.log(self.prompt_median), self.prompt_sigma))),
        )
        out = round(rng.lognormvariate(math.log(self.output_median), self.output_sigma))
        return prompt, min(self.output_max, max(self.output_min, out))

    def mean_tokens(self) -> tuple[float, float]:
        """Mean prompt and output tokens (closed form for the clipped lognormals)."""
        return (
            _clipped_lognormal_mean(self.prompt_median, self.prompt_sigma, 1, self.prompt_max),
            _clipped_lognormal_mean(self.output_median, self.output_sigma, self.output_min, self.output_max),
        )

    def mean_service_s(self, spec: ServerSpec) -> float:
        """Mean time a request holds a slot of a server of this spec, with no wait."""
        prompt, out = self.mean_tokens()
        return (prompt * spec.prefill_s_per_token + out * spec.decode_s_per_token) / spec.speed


def _clipped_lognormal_mean(median: float, sigma: float, lo: float, hi: float) -> float:
    mu = math.log(median)
    if sigma == 0.0:  # a fixed size
        return min(hi, max(lo, median))

    def cdf(z: float) -> float:
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    inside = math.exp(mu + sigma**2 / 2) * (cdf(b - sigma) - cdf(a - sigma))
    return lo * cdf(a) + inside + hi * (1.0 - cdf(b))


@dataclass(frozen=True)
class Bursts:
    """Square-wave load: `high` x the mean rate for the first `high_fraction` of every
    period, `low` x for the rest (choose them so the mean factor is 1)."""

    period_s: float = 60.0
    high: float = 1.4
    low: float = 0.6
    high_fraction: float = 0.5

    def factor(self, t: float) -> float:
        return self.high if (t % self.period_s) < self.high_fraction * self.period_s else self.low


@dataclass(frozen=True)
class Request:
    arrival: float
    prompt_tokens: int
    output_tokens: int
    sidecar: int


def capacity_rps(fleet: Sequence[ServerSpec], workload: Workload) -> float:
    """Requests per second the fleet completes with every slot busy."""
    return sum(s.slots / workload.mean_service_s(s) for s in fleet)


def make_requests(
    rate_rps: float,
    duration_s: float,
    workload: Workload,
    sidecars: int,
    seed: int,
    bursts: Bursts | None = None,
) -> list[Request]:
    """Open-loop Poisson arrivals (thinned to the burst shape) over `duration_s`."""
    rng = random.Random(seed)
    peak = rate_rps * (max(bursts.high, bursts.low) if bursts else 1.0)
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return out
        keep = rng.random()
        prompt, output = workload.sample(rng)
        sidecar = rng.randrange(sidecars)
        if bursts is None or keep * peak < rate_rps * bursts.factor(t):
            out.append(Request(t, prompt, output, sidecar))


@dataclass(frozen=True)
class ControllerConfig:
    """The control loop: scrape, policy, smoothing, push (the policy is the balancer's)."""

    period_s: float = 1.0
    signal_delay_s: float = 0.5  # weights reach the sidecars this long after the scrape
    latency_alpha: float = 0.3  # EWMA of the per-interval means, as signals.store does
    token_latency: bool = True  # False: servers that do not report the time per output token
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    smoothing: SmoothingConfig | None = field(default_factory=SmoothingConfig)


@dataclass(frozen=True)
class RunResult:
    balancer: str
    latencies: list[float]  # of the measured requests, in arrival order
    waits: list[float]  # time from arrival to the start of service, same order
    slo_s: float
    served: list[int]  # measured requests per server
    weighted_picks: float  # fraction of sidecar picks made with the EDF schedule
    pushes: int  # weight changes pushed (per sidecar)

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile (q in 0-100) of the measured latencies."""
        xs = sorted(self.latencies)
        if not xs:
            return math.nan
        return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]

    @property
    def within_slo(self) -> float:
        """Fraction of measured requests that finished within the SLO."""
        if not self.latencies:
            return math.nan
        return sum(1 for x in self.latencies if x <= self.slo_s) / len(self.latencies)


_SERVER, _SCRAPE, _PUSH = 0, 1, 2


def static_weights(capacities: Sequence[float], max_weight: int = 100) -> list[int]:
    """Integer weights proportional to capacity, the largest `max_weight`, none below 1."""
    top = max(capacities)
    return [max(1, round(c / top * max_weight)) for c in capacities]


class Scraper:
    """What a metrics scraper sees of each server: gauges now, and means over the
    requests finished since the previous scrape, smoothed (EWMA)."""

    def __init__(self, n: int, alpha: float, token_latency: bool = True) -> None:
        self._alpha = alpha
        self._token_latency = token_latency
        self._latency_sum = [0.0] * n
        self._count = [0] * n
        self._decode_s = [0.0] * n
        self._tokens = [0] * n
        self.latency: list[float | None] = [None] * n
        self.token_latency: list[float | None] = [None] * n

    def finished(self, i: int, c: Completed) -> None:
        self._latency_sum[i] += c.latency_s  # as the server measures it: from its own receipt
        self._count[i] += 1
        self._decode_s[i] += c.finished - c.first_token
        self._tokens[i] += c.output_tokens

    def _ewma(self, prev: float | None, x: float) -> float:
        return x if prev is None else prev + self._alpha * (x - prev)

    def sample(
        self, servers: Sequence[BatchingServer], capacities: Sequence[float], age_s: float
    ) -> list[EndpointLoad]:
        """Close the interval; servers must have been advanced to the scrape time."""
        loads = []
        for i, s in enumerate(servers):
            if self._count[i]:
                self.latency[i] = self._ewma(self.latency[i], self._latency_sum[i] / self._count[i])
            if self._tokens[i] and self._token_latency:
                self.token_latency[i] = self._ewma(self.token_latency[i], self._decode_s[i] / self._tokens[i])
            self._latency_sum[i], self._count[i], self._decode_s[i], self._tokens[i] = 0.0, 0, 0.0, 0
            loads.append(
                EndpointLoad(
                    address=f"s{i}",
                    running=float(len(s.running)),
                    waiting=float(len(s.waiting)),
                    kv_use=s.kv_use,
                    latency_s=self.latency[i],
                    token_latency_s=self.token_latency[i],
                    age_s=age_s,
                    capacity=capacities[i],
                )
            )
        return loads


class _Run:
    """One simulation: the event loop and the state it moves."""

    def __init__(
        self,
        fleet: Sequence[ServerSpec],
        requests: Sequence[Request],
        balancer: str,
        sidecars: int,
        seed: int,
        controller: ControllerConfig | None,
        workload: Workload,
    ) -> None:
        n = len(fleet)
        self.fleet = fleet
        self.requests = requests
        self.servers = [BatchingServer(s) for s in fleet]
        self.capacities = [s.slots * s.speed for s in fleet]
        self.active = [[0] * n for _ in range(sidecars)]
        rngs = [random.Random(seed * 1_000_003 + k) for k in range(sidecars)]
        self.policy = "adaptive" if balancer == "adaptive" else balancer.removeprefix("policy:")
        self.controlled = balancer == "adaptive" or balancer.startswith("policy:")
        if self.controlled and self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}")
        if not self.controlled and balancer not in BALANCERS:
            raise ValueError(f"unknown balancer {balancer!r}")
        self.ctl = controller or ControllerConfig()
        self.scraper = Scraper(n, self.ctl.latency_alpha, self.ctl.token_latency)

        self.simple: list[RoundRobin | RandomPick] = []
        self.lbs: list[LeastRequest] = []
        if balancer == "round_robin":
            self.simple = [RoundRobin(n, rngs[k]) for k in range(sidecars)]
        elif balancer == "random":
            self.simple = [RandomPick(n, rngs[k]) for k in range(sidecars)]
        elif balancer in ("least_request", "capacity_lr") or self.controlled:
            self.lbs = [LeastRequest(self.active[k], rngs[k]) for k in range(sidecars)]
            if balancer != "least_request":
                # capacity_lr's static weights; and what the controlled ones start from
                # before the first push (the fleet config declares capacity)
                for lb in self.lbs:
                    lb.set_weights(static_weights(self.capacities))
        self.picker = balancer == "picker"
        self.central = balancer == "central_queue"
        self.queue: deque[int] = deque()  # the central queue
        self.fastest_first = sorted(range(n), key=lambda i: (-fleet[i].speed, i))
        self.service_s = [workload.mean_service_s(s) for s in fleet]

        total = len(requests)
        self.latency = [math.nan] * total
        self.wait = [math.nan] * total
        self.served_by = [-1] * total
        self.heap: list[tuple[float, int, int, int, int]] = []  # time, seq, kind, server, version
        self.version = [0] * n
        self.seq = 0
        self.outstanding = 0
        self.weighted_picks = 0
        self.sidecar_picks = 0
        self.weights = static_weights(self.capacities)  # last computed, before smoothing applies
        self.pending: deque[list[int]] = deque()  # computed, not yet delivered
        self.pushes = 0

    def _event(self, t: float, kind: int, server: int = -1, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, server, version))

    def _reschedule(self, i: int) -> None:
        self.version[i] += 1
        t = self.servers[i].next_event()
        if t is not None:
            self._event(t, _SERVER, i, self.version[i])

    def _finished(self, i: int, done: list[Completed]) -> None:
        for c in done:
            rid = c.request_id
            r = self.requests[rid]
            self.active[r.sidecar][i] -= 1
            self.latency[rid] = c.finished - r.arrival  # not c.submitted: the central queue submits late
            self.wait[rid] = c.started - r.arrival
            self.scraper.finished(i, c)
            self.outstanding -= 1
            if self.central and self.queue:
                self._start(self.queue.popleft(), i, c.finished)

    def _start(self, rid: int, i: int, now: float) -> None:
        r = self.requests[rid]
        self.active[r.sidecar][i] += 1
        self.served_by[rid] = i
        self._finished(i, self.servers[i].submit(rid, r.prompt_tokens, r.output_tokens, now))
        self._reschedule(i)

    def _route(self, r: Request) -> int:
        """The server for a new request, or -1 to hold it in the central queue."""
        if self.central:
            return next(
                (i for i in self.fastest_first if len(self.servers[i].running) < self.fleet[i].slots), -1
            )
        if self.picker:
            views = [
                ServerView(len(s.running), len(s.waiting), s.spec.slots, self.service_s[i])
                for i, s in enumerate(self.servers)
            ]
            return full_scan_pick(views)
        self.sidecar_picks += 1
        if self.simple:
            return self.simple[r.sidecar].pick()
        lb = self.lbs[r.sidecar]
        self.weighted_picks += lb.weighted
        return lb.pick()

    def _scrape(self, now: float) -> None:
        for i, s in enumerate(self.servers):
            self._finished(i, s.advance(now))
            self._reschedule(i)
        loads = self.scraper.sample(self.servers, self.capacities, self.ctl.signal_delay_s)
        target = POLICIES[self.policy](loads, self.ctl.policy_config)
        previous = {f"s{i}": w for i, w in enumerate(self.weights)}
        new = smooth(previous, target, self.ctl.smoothing) if self.ctl.smoothing else target
        self.weights = [new[f"s{i}"] for i in range(len(self.servers))]
        self.pending.append(self.weights)

    def _deliver(self) -> None:
        weights = self.pending.popleft()
        if weights != self.lbs[0].weights:
            self.pushes += 1
        for lb in self.lbs:
            lb.set_weights(weights)

    def run(self) -> None:
        if self.controlled:
            self._event(self.ctl.period_s, _SCRAPE)
        next_req, total = 0, len(self.requests)
        while next_req < total or self.outstanding > 0:
            arrival = self.requests[next_req].arrival if next_req < total else math.inf
            if self.heap and self.heap[0][0] <= arrival:
                t, _, kind, i, version = heapq.heappop(self.heap)
                if kind == _SERVER:
                    if version == self.version[i]:
                        self._finished(i, self.servers[i].advance(t))
                        self._reschedule(i)
                elif kind == _SCRAPE:
                    self._scrape(t)
                    self._event(t + self.ctl.signal_delay_s, _PUSH)
                    if next_req < total or self.outstanding > 0:
                        self._event(t + self.ctl.period_s, _SCRAPE)
                else:
                    self._deliver()
                continue
            r = self.requests[next_req]
            self.outstanding += 1
            target = self._route(r)
            if target < 0:
                self.queue.append(next_req)
            else:
                self._start(next_req, target, r.arrival)
            next_req += 1


def simulate(
    fleet: Sequence[ServerSpec],
    requests: Sequence[Request],
    balancer: str,
    *,
    sidecars: int = 4,
    seed: int = 0,
    controller: ControllerConfig | None = None,
    workload: Workload | None = None,
    warmup_s: float = 0.0,
    slo_s: float = math.inf,
) -> RunResult:
    """Run `requests` through the fleet with one balancer until every request finished.

    `balancer` is one of BALANCERS, or `policy:<name>` for any policy in
    controlplane.balancing.policies.POLICIES driven by the controller (`adaptive` is
    `policy:adaptive`). `seed` drives the balancers' own randomness only."""
    run = _Run(fleet, requests, balancer, sidecars, seed, controller, workload or Workload())
    run.run()
    measured = [k for k, r in enumerate(requests) if r.arrival >= warmup_s]
    served = [0] * len(fleet)
    for k in measured:
        served[run.served_by[k]] += 1
    return RunResult(
        balancer=balancer,
        latencies=[run.latency[k] for k in measured],
        waits=[run.wait[k] for k in measured],
        slo_s=slo_s,
        served=served,
        weighted_picks=run.weighted_picks / run.sidecar_picks if run.sidecar_picks else 0.0,
        pushes=run.pushes,
    )
