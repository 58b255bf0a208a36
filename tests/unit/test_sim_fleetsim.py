from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from controlplane.sim.fleetsim import (
    BALANCERS,
    Bursts,
    Scraper,
    Workload,
    capacity_rps,
    make_requests,
    simulate,
    static_weights,
)
from controlplane.sim.pickers import EdfSchedule, LeastRequest, ServerView, full_scan_pick
from controlplane.sim.service import BatchingServer, ServerSpec

WORKLOAD = Workload()
HOMOGENEOUS = [ServerSpec(slots=4, speed=1.0)] * 4
TWO_CLASS = [ServerSpec(slots=4, speed=1.0)] * 3 + [ServerSpec(slots=4, speed=0.35)] * 3
THREE_CLASS = (
    [ServerSpec(slots=16, speed=1.0)] * 2
    + [ServerSpec(slots=8, speed=0.5)] * 3
    + [ServerSpec(slots=8, speed=0.25)] * 4
)


def p90(fleet: list[ServerSpec], load: float, balancer: str, seed: int = 1, duration: float = 400.0) -> float:
    requests = make_requests(load * capacity_rps(fleet, WORKLOAD), duration, WORKLOAD, 4, seed)
    return simulate(fleet, requests, balancer, seed=seed, warmup_s=30).percentile(90)


# --- the sidecar balancers -------------------------------------------------------------


def test_edf_splits_picks_in_proportion_to_weights_when_idle() -> None:
    lb = LeastRequest([0, 0], random.Random(1))
    lb.set_weights([3, 1])
    assert lb.weighted
    picks = Counter(lb.pick() for _ in range(400))  # nothing in flight: active stays 0
    assert picks[0] == pytest.approx(300, abs=1)
    assert picks[1] == pytest.approx(100, abs=1)


def test_edf_effective_weight_divides_by_active_plus_one() -> None:
    active = [3, 0]  # host 0 has 3 in flight: effective weight 3 / 4 against 1 / 1
    lb = LeastRequest(active, random.Random(2))
    lb.set_weights([3, 1])  # rebuilt with the counts at push time, as Envoy does
    picks = Counter(lb.pick() for _ in range(700))
    assert picks[1] > picks[0]
    assert picks[0] / picks[1] == pytest.approx(0.75, abs=0.02)


def test_edf_keeps_a_host_at_the_deadline_it_was_given_when_picked() -> None:
    active = [0, 0]
    lb = LeastRequest(active, random.Random(3))
    lb.set_weights([2, 1])
    while lb.pick() != 0:
        pass  # host 0 re-entered the schedule with weight 2 / (0 + 1): next turn in 0.5
    active[0] = 9
    assert 0 in [lb.pick(), lb.pick()]  # the load that came since does not delay that turn
    # ... but that pick re-inserted it with 2 / (9 + 1): next turn in 5. Its requests
    # finishing now does not bring that turn forward (Envoy recomputes only on re-insertion).
    active[0] = 0
    assert [lb.pick() for _ in range(4)] == [1, 1, 1, 1]


def test_edf_prepicks_match_picking_one_by_one() -> None:
    weights = [1.0, math.sqrt(2) / 3, math.pi / 7]
    fresh = EdfSchedule.with_picks([0, 1, 2], weights, 0)
    for _ in range(1234):
        fresh.pick_and_add(weights.__getitem__)
    jumped = EdfSchedule.with_picks([0, 1, 2], weights, 1234)
    assert [fresh.pick_and_add(weights.__getitem__) for _ in range(50)] == [
        jumped.pick_and_add(weights.__getitem__) for _ in range(50)
    ]


def test_full_scan_picks_the_least_loaded_and_breaks_ties_uniformly() -> None:
    active = [5, 0, 0, 3]
    lb = LeastRequest(active, random.Random(4))
    lb.set_weights([7, 7, 7, 7])  # equal weights: the full scan the control plane configures
    assert not lb.weighted
    picks = Counter(lb.pick() for _ in range(4000))
    assert set(picks) == {1, 2}  # never a loaded host while an idle one is there
    assert picks[1] / 4000 == pytest.approx(0.5, abs=0.05)  # ties uniformly


def test_p2c_picks_the_less_loaded_of_two_samples() -> None:
    active = [5, 0]
    lb = LeastRequest(active, random.Random(4), choice_count=2)
    lb.set_weights([7, 7])  # equal weights, whatever their value: power of two choices
    assert not lb.weighted
    picks = Counter(lb.pick() for _ in range(4000))
    # with replacement: the loaded host only when both samples are it (1 in 4)
    assert picks[0] / 4000 == pytest.approx(0.25, abs=0.03)


def test_p2c_reads_the_counts_at_each_pick() -> None:
    active = [0, 9, 9]
    lb = LeastRequest(active, random.Random(5), choice_count=2)
    picks = Counter(lb.pick() for _ in range(3000))
    assert picks[0] / 3000 == pytest.approx(5 / 9, abs=0.03)  # unless both samples miss it
    active[0] = 20
    picks = Counter(lb.pick() for _ in range(3000))
    assert picks[0] / 3000 == pytest.approx(1 / 9, abs=0.03)  # only when both samples are it


def test_weight_zero_holds_an_endpoint_out() -> None:
    lb = LeastRequest([0, 0, 0], random.Random(6))
    lb.set_weights([0, 5, 5])
    assert 0 not in {lb.pick() for _ in range(200)}
    lb.set_weights([0, 5, 1])
    assert 0 not in {lb.pick() for _ in range(200)}


def test_the_full_scan_prefers_the_fastest_free_slot_then_the_shortest_wait() -> None:
    fast_full = ServerView(running=4, waiting=0, slots=4, service_s=1.0)
    slow_free = ServerView(running=0, waiting=0, slots=4, service_s=3.0)
    fast_free = ServerView(running=3, waiting=0, slots=4, service_s=1.0)
    assert full_scan_pick([fast_full, slow_free, fast_free]) == 2
    assert full_scan_pick([fast_full, slow_free]) == 1
    long_queue = ServerView(running=4, waiting=8, slots=4, service_s=1.0)  # 3 s to finish
    slow_queue = ServerView(running=4, waiting=1, slots=4, service_s=3.0)  # 4.5 s
    assert full_scan_pick([slow_queue, long_queue]) == 1


# --- the workload ----------------------------------------------------------------------


def test_mean_service_matches_the_sampled_sizes() -> None:
    rng = random.Random(7)
    spec = ServerSpec()
    sizes = [WORKLOAD.sample(rng) for _ in range(40_000)]
    sampled = sum(p * spec.prefill_s_per_token + o * spec.decode_s_per_token for p, o in sizes) / len(sizes)
    assert WORKLOAD.mean_service_s(spec) == pytest.approx(sampled, rel=0.03)
    outputs = sorted(o for _, o in sizes)
    assert outputs[0] >= 10 and outputs[-1] >= 1000  # costs differ by ~100x


def test_arrivals_follow_the_rate_and_the_bursts() -> None:
    steady = make_requests(10.0, 600.0, WORKLOAD, 4, seed=8)
    assert len(steady) == pytest.approx(6000, rel=0.05)
    assert {r.sidecar for r in steady} == {0, 1, 2, 3}
    bursty = make_requests(10.0, 600.0, WORKLOAD, 4, seed=8, bursts=Bursts(period_s=60, high=1.5, low=0.5))
    high = sum(1 for r in bursty if r.arrival % 60 < 30)
    assert len(bursty) == pytest.approx(6000, rel=0.05)
    assert high / (len(bursty) - high) == pytest.approx(3.0, rel=0.15)


# --- whole runs ------------------------------------------------------------------------


def test_a_seed_gives_the_same_run_and_another_seed_another() -> None:
    requests = make_requests(8.0, 200.0, WORKLOAD, 4, seed=9)
    for balancer in ("least_request", "adaptive", "random"):
        one = simulate(TWO_CLASS, requests, balancer, seed=9)
        two = simulate(TWO_CLASS, requests, balancer, seed=9)
        assert one.latencies == two.latencies and one.served == two.served
    assert simulate(TWO_CLASS, requests, "random", seed=10).latencies != one.latencies


def test_every_request_finishes_and_is_counted_once() -> None:
    requests = make_requests(6.0, 200.0, WORKLOAD, 3, seed=11)
    for balancer in BALANCERS:
        r = simulate(TWO_CLASS, requests, balancer, sidecars=3, seed=11)
        assert len(r.latencies) == len(requests) == sum(r.served)
        assert all(lat > 0 and w >= 0 for lat, w in zip(r.latencies, r.waits, strict=True))


def test_the_central_queue_is_at_least_as_good_as_routing_on_arrival() -> None:
    central = p90(HOMOGENEOUS, 0.85, "central_queue")
    for balancer in ("round_robin", "random", "least_request", "adaptive"):
        assert central <= p90(HOMOGENEOUS, 0.85, balancer)


def test_round_robin_is_far_worse_than_the_picker_on_a_heterogeneous_fleet() -> None:
    # the slow servers get a third of their capacity's worth too many requests and queue
    assert p90(TWO_CLASS, 0.85, "round_robin") > 3 * p90(TWO_CLASS, 0.85, "picker")


def test_adaptive_beats_capacity_weights_on_three_gpu_classes() -> None:
    adaptive = p90(THREE_CLASS, 0.85, "adaptive")
    assert adaptive < 0.85 * p90(THREE_CLASS, 0.85, "capacity_lr")
    assert adaptive < 1.25 * p90(THREE_CLASS, 0.85, "picker")


def test_the_controller_pushes_weights_from_any_policy() -> None:
    requests = make_requests(8.0, 100.0, WORKLOAD, 4, seed=12)
    r = simulate(TWO_CLASS, requests, "policy:least_connections", seed=12)
    assert r.pushes > 10 and r.weighted_picks > 0.5
    with pytest.raises(ValueError, match="unknown"):
        simulate(TWO_CLASS, requests, "policy:nope")
    with pytest.raises(ValueError, match="unknown"):
        simulate(TWO_CLASS, requests, "fastest")


def test_the_scraper_reports_gauges_now_and_means_of_the_interval() -> None:
    spec = ServerSpec(slots=1, speed=0.5, prefill_s_per_token=0.0, decode_s_per_token=0.01)
    server = BatchingServer(spec)
    server.submit(1, prompt_tokens=0, output_tokens=100, now=0.0)  # 2 s at speed 0.5
    server.submit(2, prompt_tokens=0, output_tokens=100, now=0.0)  # waits 2 s, then 2 s
    with_tpot, without = Scraper(1, alpha=0.5), Scraper(1, alpha=0.5, token_latency=False)
    for c in server.advance(3.0):
        with_tpot.finished(0, c)
        without.finished(0, c)
    [load] = with_tpot.sample([server], [0.5], age_s=0.5)
    assert (load.running, load.waiting, load.capacity, load.age_s) == (1.0, 0.0, 0.5, 0.5)
    assert load.latency_s == pytest.approx(2.0)
    assert load.token_latency_s == pytest.approx(0.02)
    [load] = without.sample([server], [0.5], age_s=0.5)
    assert load.latency_s == pytest.approx(2.0) and load.token_latency_s is None
    for c in server.advance(5.0):
        with_tpot.finished(0, c)  # 4 s: its 2 s in the server's queue count
    [load] = with_tpot.sample([server], [0.5], age_s=0.5)
    assert load.latency_s == pytest.approx(2.0 + 0.5 * (4.0 - 2.0))  # EWMA


def test_static_weights_follow_capacity() -> None:
    assert static_weights([8.0, 2.8, 0.01]) == [100, 35, 1]
