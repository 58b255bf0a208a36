"""The weight loop's shell over a real reconciler and a signal source swapped at its seam:
its liveness (rounds counted, last success), the series it leaves when the fleet shrinks, the
figures never read (no series) and the scrape errors counted per version by reason."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest
from prometheus_client import generate_latest

from controlplane.balancing.controller import WeightController
from controlplane.fleet.loader import parse_fleet
from controlplane.fleet.model import Fleet
from controlplane.obs.metrics import Metrics
from controlplane.signals.parse import ServerSample
from controlplane.signals.store import EndpointKey, ScrapeResult
from controlplane.xds.cache import SnapshotCache
from controlplane.xds.reconciler import Reconciler

MODEL_B = """
  b:
    params_b: 8
    stable: v1
    versions:
      v1: {endpoints: ["127.0.0.21:8000"]}
"""
FLEET = """
listener: {port: 10000}
tiers: {small: {max_params_b: 15}}
signals: {interval: 2s}
priority_classes:
  premium: {}
  batch: {shed_at: 0.5}
default_priority_class: premium
models:
  a:
    params_b: 8
    stable: v1
    versions:
      v1: {endpoints: ["127.0.0.11:8000", "127.0.0.12:8000"]}
"""


class Source:
    """A signal source at the seam the weight loop drives (signals/source.py)."""

    def __init__(self) -> None:
        self.failing: str | None = None
        self.raises: Exception | None = None
        self.results: dict[EndpointKey, ScrapeResult] = {}

    def matches(self, fleet: Fleet) -> bool:
        return True

    async def collect(
        self, fleet: Fleet, targets: Sequence[EndpointKey], *, first: bool = False
    ) -> Mapping[EndpointKey, ScrapeResult]:
        if self.raises is not None:
            raise self.raises
        return {k: r for k, r in self.results.items() if k in targets}

    async def close(self) -> None:
        pass


def busy(running: float, waiting: float) -> ScrapeResult:
    return ScrapeResult(health_status=200, sample=ServerSample("vllm", running=running, waiting=waiting))


def controller(fleet: str = FLEET) -> tuple[WeightController, Source, Metrics]:
    metrics = Metrics()
    reconciler = Reconciler(SnapshotCache(), metrics)
    reconciler.set_fleet(parse_fleet(fleet))
    weights = WeightController(reconciler, metrics, collectors=0)
    source = Source()
    weights._source = source
    return weights, source, metrics


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def rounds(metrics: Metrics, loop: str, result: str) -> float | None:
    return value(metrics, "controlplane_loop_rounds_total", loop=loop, result=result)


def test_a_failing_round_is_counted_and_leaves_the_last_success_where_it_was() -> None:
    async def body() -> None:
        weights, _, metrics = controller()
        await weights.one_round()
        assert rounds(metrics, "weights", "ok") == 1 and rounds(metrics, "weights", "error") == 0
        last = value(metrics, "controlplane_loop_last_success_timestamp_seconds", loop="weights")
        assert last is not None
        assert value(metrics, "controlplane_loop_interval_seconds", loop="weights") == 2.0

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug in the weigher")

        weights.weigher.update = broken  # type: ignore[method-assign,assignment]
        await asyncio.sleep(0.01)
        await weights.one_round()
        await weights.one_round()
        assert rounds(metrics, "weights", "error") == 2 and rounds(metrics, "weights", "ok") == 1
        assert value(metrics, "controlplane_loop_last_success_timestamp_seconds", loop="weights") == last
        # The interval stays, so the alert can tell the last success is too old.
        assert value(metrics, "controlplane_loop_interval_seconds", loop="weights") == 2.0

    asyncio.run(body())


def test_the_signal_source_is_judged_every_round() -> None:
    async def body() -> None:
        weights, source, metrics = controller()
        await weights.one_round()
        assert rounds(metrics, "signals", "ok") == 1
        last = value(metrics, "controlplane_loop_last_success_timestamp_seconds", loop="signals")
        # A source that answers but does not deliver (a collector down, Prometheus failing):
        # the weights still update from what is known, the signals count as failing.
        source.failing = "collector processes not reporting: 1 (of 2)"
        await weights.one_round()
        assert rounds(metrics, "signals", "error") == 1 and rounds(metrics, "weights", "ok") == 2
        # A source that raises fails the round of both.
        source.raises = OSError("socket closed")
        await weights.one_round()
        assert rounds(metrics, "signals", "error") == 2 and rounds(metrics, "weights", "error") == 1
        assert value(metrics, "controlplane_loop_last_success_timestamp_seconds", loop="signals") == last

    asyncio.run(body())


def test_signals_turned_off_leave_no_liveness_series_to_age() -> None:
    async def body() -> None:
        weights, _, metrics = controller()
        await weights.one_round()
        assert value(metrics, "controlplane_loop_interval_seconds", loop="signals") == 2.0
        off = FLEET.replace("signals: {interval: 2s}", "signals: {interval: 2s, enabled: false}")
        weights.reconciler.set_fleet(parse_fleet(off))
        await weights.one_round()
        assert value(metrics, "controlplane_loop_interval_seconds", loop="signals") is None
        assert value(metrics, "controlplane_loop_last_success_timestamp_seconds", loop="signals") is None
        assert rounds(metrics, "weights", "ok") == 2

    asyncio.run(body())


def test_a_model_removed_from_the_fleet_leaves_no_series() -> None:
    async def body() -> None:
        weights, source, metrics = controller(FLEET + MODEL_B)
        # b is saturated (its batch class shed); a is not.
        source.results = {
            ("a", "127.0.0.11:8000"): busy(2, 0),
            ("a", "127.0.0.12:8000"): busy(2, 0),
            ("b", "127.0.0.21:8000"): busy(2, 4),
        }
        await weights.one_round()
        await weights.one_round()
        # Series other rooms keep for the model: a rollout, discovery, the holding service.
        metrics.rollouts.phase.labels("b", "Completed").set(1)
        metrics.rollouts.transitions.labels("b", "Completed").inc()
        metrics.discovery.failures.labels("b", "v1").inc()
        metrics.hold.outcomes.labels("b", "forwarded").inc()
        metrics.hold.outcomes.labels("(unknown)", "unknown_model").inc()
        page = generate_latest(metrics.registry).decode()
        assert value(metrics, "controlplane_priority_class_shed", model="b", **{"class": "batch"}) == 1
        assert value(metrics, "controlplane_model_saturation", model="b") == 2
        assert 'controlplane_endpoint_weight{endpoint="127.0.0.21:8000",model="b"' in page

        weights.reconciler.set_fleet(parse_fleet(FLEET))
        await weights.one_round()
        page = generate_latest(metrics.registry).decode()
        assert 'model="b"' not in page
        # a's series and what is not a model stay.
        assert value(metrics, "controlplane_priority_class_shed", model="a", **{"class": "batch"}) == 0
        assert value(metrics, "controlplane_model_saturation", model="a") == 0
        assert 'model="(unknown)"' in page

    asyncio.run(body())


@pytest.mark.parametrize("held", [0, 2])
def test_held_requests_of_a_removed_model_never_read_negative(held: int) -> None:
    from controlplane.hold.service import HoldingService

    metrics = Metrics()
    hold = HoldingService(dict, lambda model: 10, lambda model: 1.0, metrics.hold)
    for _ in range(held + 1):
        assert hold._take("b", 10)
    hold._release("b")
    metrics.retain_models({"a"})  # b left the fleet while requests were held
    for _ in range(held):
        hold._release("b")
    assert value(metrics, "controlplane_held_requests", model="b") in (None, 0)


NODE_EXPORTER = "# TYPE node_cpu_seconds_total counter\nnode_cpu_seconds_total 12.5\n"


def test_a_figure_never_read_has_no_series_rather_than_a_zero() -> None:
    async def body() -> None:
        weights, source, metrics = controller()
        source.results = {
            ("a", "127.0.0.11:8000"): busy(2, 0),  # no KV gauge on its page
            ("a", "127.0.0.12:8000"): ScrapeResult(health_status=200, metrics_text=NODE_EXPORTER),
        }
        await weights.one_round()
        one = {"model": "a", "version": "v1", "endpoint": "127.0.0.11:8000"}
        other = {**one, "endpoint": "127.0.0.12:8000"}
        assert value(metrics, "controlplane_endpoint_running", **one) == 2
        assert value(metrics, "controlplane_endpoint_waiting", **one) == 0
        for name in ("running", "waiting", "kv_cache_usage_ratio", "latency_seconds", "error_ratio"):
            assert value(metrics, f"controlplane_endpoint_{name}", **other) is None, name
        for name in ("kv_cache_usage_ratio", "latency_seconds", "error_ratio"):
            assert value(metrics, f"controlplane_endpoint_{name}", **one) is None, name
        assert "NaN" not in generate_latest(metrics.registry).decode()
        # What is known still shows for both.
        assert value(metrics, "controlplane_endpoint_weight", **other) is not None
        assert value(metrics, "controlplane_endpoint_scrape_errors_total", **other) == 1

    asyncio.run(body())


def test_scrape_errors_count_per_version_by_reason_and_never_go_down() -> None:
    async def body() -> None:
        weights, source, metrics = controller()

        def errors(reason: str) -> float | None:
            return value(
                metrics, "controlplane_version_scrape_errors_total", model="a", version="v1", reason=reason
            )

        source.results = {
            ("a", "127.0.0.11:8000"): ScrapeResult(health_status=200, metrics_text=NODE_EXPORTER),
            ("a", "127.0.0.12:8000"): ScrapeResult(
                health_status=503, metrics_error="GET /metrics answered HTTP 503", error_reason="http_error"
            ),
        }
        await weights.one_round()
        assert (errors("no_dialect"), errors("http_error")) == (1, 1)
        # Every reason is there from the start, at 0.
        assert (errors("unreachable"), errors("unreadable"), errors("no_series")) == (0, 0, 0)
        await weights.one_round()
        assert (errors("no_dialect"), errors("http_error")) == (2, 2)
        # An endpoint leaving takes nothing back from its version's count.
        weights.reconciler.set_fleet(parse_fleet(FLEET.replace(', "127.0.0.12:8000"', "")))
        await weights.one_round()
        assert (errors("no_dialect"), errors("http_error")) == (3, 2)
        # A page read again: no new error.
        source.results = {("a", "127.0.0.11:8000"): busy(1, 0)}
        await weights.one_round()
        assert errors("no_dialect") == 3

    asyncio.run(body())


def test_a_joined_server_whose_page_answers_but_health_does_not_is_held_until_seen_ready() -> None:
    """A server added after the first round is held out until a health probe has seen it
    ready: its /metrics answering while the health probe times out (a loading server on a
    loaded machine, a CI run) is heard, not seen ready; it was put in service on that."""

    async def body() -> None:
        weights, source, _ = controller()
        old = {("a", "127.0.0.11:8000"): busy(0, 0), ("a", "127.0.0.12:8000"): busy(0, 0)}
        source.results = dict(old)
        await weights.one_round()
        new = ("a", "127.0.0.13:8000")
        weights.reconciler.set_fleet(
            parse_fleet(FLEET.replace('"127.0.0.12:8000"]', '"127.0.0.12:8000", "127.0.0.13:8000"]'))
        )
        idle = ServerSample("vllm", running=0, waiting=0)
        page_only = ScrapeResult(health_error="timeout after 0.25 s", sample=idle, reached=True)
        source.results = {**old, new: page_only}
        for _ in range(3):
            await weights.one_round()
            assert weights.reconciler.weights["a@v1"].get(new[1], 0) == 0, weights.reconciler.weights
        source.results = {**old, new: ScrapeResult(health_status=503, sample=idle)}
        await weights.one_round()
        assert weights.reconciler.weights["a@v1"].get(new[1], 0) == 0
        source.results = {**old, new: busy(0, 0)}
        await weights.one_round()
        assert weights.reconciler.weights["a@v1"][new[1]] > 0
        # Seen ready once, a health probe unanswered later is no verdict: it keeps serving.
        source.results = {**old, new: page_only}
        await weights.one_round()
        assert weights.reconciler.weights["a@v1"][new[1]] > 0

    asyncio.run(body())


THREE = FLEET.replace('"127.0.0.12:8000"]', '"127.0.0.12:8000", "127.0.0.13:8000"]')
A1, A2, A3 = (("a", f"127.0.0.1{i}:8000") for i in (1, 2, 3))


def weight(weights: WeightController, key: EndpointKey) -> int:
    return weights.reconciler.weights["a@v1"].get(key[1], 0)


def test_a_first_round_server_not_heard_is_held_while_the_rest_of_its_cluster_is_seen_ready() -> None:
    """The first snapshot waits one scrape timeout for first signals; on a loaded machine a
    loading server may not have answered by then. It is held out (not served on the benefit
    of the doubt) while the others of its cluster are seen ready and it is at most half."""

    async def body() -> None:
        weights, source, _ = controller(THREE)
        source.results = {A1: busy(0, 0), A2: busy(0, 0)}  # A3 not heard in time
        await weights.one_round()
        assert weight(weights, A3) == 0 and weight(weights, A1) > 0 and weight(weights, A2) > 0
        source.results[A3] = ScrapeResult(health_status=503)  # loading
        await weights.one_round()
        assert weight(weights, A3) == 0
        source.results[A3] = busy(0, 0)
        await weights.one_round()
        assert weight(weights, A3) > 0

    asyncio.run(body())


def test_first_round_servers_not_heard_keep_the_benefit_of_the_doubt_when_they_are_most() -> None:
    """A control plane started into a fleet it mostly cannot see (a partition, a firewalled
    probe path) must not pile every request onto the few it sees; one that sees nothing
    holds nothing."""

    async def body() -> None:
        weights, source, _ = controller(THREE)
        source.results = {A1: busy(0, 0)}  # two of three not heard
        await weights.one_round()
        assert all(weight(weights, k) > 0 for k in (A1, A2, A3))
        weights, source, _ = controller(THREE)  # nothing heard at all
        await weights.one_round()
        assert all(weight(weights, k) > 0 for k in (A1, A2, A3))
        # One heard not ready does not count among the doubted: the other unheard one is
        # alone in the doubt, at most half, and held.
        weights, source, _ = controller(THREE)
        source.results = {A1: busy(0, 0), A2: ScrapeResult(health_status=503)}
        await weights.one_round()
        assert weight(weights, A1) > 0 and weight(weights, A2) == 0 and weight(weights, A3) == 0

    asyncio.run(body())


def test_servers_that_join_later_are_held_however_many_until_seen_ready() -> None:
    """Only servers there from the first round are let in as a majority of their cluster: two
    joining a one-server version, heard only through their pages, are both held."""

    async def body() -> None:
        weights, source, _ = controller(FLEET.replace(', "127.0.0.12:8000"]', "]"))
        source.results = {A1: busy(0, 0)}
        await weights.one_round()
        weights.reconciler.set_fleet(parse_fleet(THREE))
        idle = ServerSample("vllm", running=0, waiting=0)
        page_only = ScrapeResult(health_error="timeout after 0.25 s", sample=idle, reached=True)
        source.results = {A1: busy(0, 0), A2: page_only, A3: page_only}
        await weights.one_round()
        assert weight(weights, A1) > 0 and weight(weights, A2) == 0 and weight(weights, A3) == 0
        source.results[A2] = busy(0, 0)
        await weights.one_round()
        assert weight(weights, A2) > 0 and weight(weights, A3) == 0

    asyncio.run(body())
