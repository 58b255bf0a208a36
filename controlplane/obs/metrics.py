"""Prometheus metrics of the control plane. Every name here is documented in docs/metrics.md."""

from __future__ import annotations

import time
from collections.abc import Callable, Set

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.metrics import MetricWrapperBase

from controlplane import __version__
from controlplane.obs.endpoint_metrics import EndpointRows
from controlplane.resources.types import TYPE_LABELS


class Metrics:
    """All metrics, on their own registry so that tests and several servers do not collide."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.streams = Gauge(
            "controlplane_xds_streams",
            "Connected xDS streams, by service (ads or one type) and transport (sotw, delta).",
            ["service", "transport"],
            registry=r,
        )
        self.pushes = Counter(
            "controlplane_xds_pushes_total",
            "xDS responses sent, by resource type and transport.",
            ["type", "transport"],
            registry=r,
        )
        self.push_bytes = Counter(
            "controlplane_xds_push_bytes_total",
            "Bytes of xDS responses sent, by resource type and transport.",
            ["type", "transport"],
            registry=r,
        )
        self.push_duration = Histogram(
            "controlplane_xds_push_duration_seconds",
            "Time to build and hand one xDS response to gRPC, by resource type.",
            ["type"],
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0),
            registry=r,
        )
        self.acks = Counter(
            "controlplane_xds_acks_total", "ACKs received, by resource type.", ["type"], registry=r
        )
        self.nacks = Counter(
            "controlplane_xds_nacks_total",
            "NACKs received (a proxy rejected config), by resource type.",
            ["type"],
            registry=r,
        )
        self.stale_nonces = Counter(
            "controlplane_xds_stale_nonces_total",
            "Requests carrying a nonce older than the latest response, ignored.",
            ["type"],
            registry=r,
        )
        self.convergence = Histogram(
            "controlplane_xds_convergence_seconds",
            "From a snapshot's creation to a proxy's ACK of it, by resource type.",
            ["type"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.snapshot_generation = Gauge(
            "controlplane_snapshot_generation",
            "Generation of the current snapshot (increases by one per published snapshot).",
            registry=r,
        )
        self.snapshot_resources = Gauge(
            "controlplane_snapshot_resources",
            "Resources in the current snapshot, by type.",
            ["type"],
            registry=r,
        )
        self.snapshot_build = Histogram(
            "controlplane_snapshot_build_seconds",
            "Time to translate the fleet and serialise a snapshot.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=r,
        )
        self.model_build_errors = Counter(
            "controlplane_snapshot_model_errors_total",
            "Snapshot builds in which a model's resources failed to build, by model ('(gateway)' "
            "for the shared gateway listener and routes): its last good resources stay in force "
            "(a model never built is left out), every other model updates as usual.",
            ["model"],
            registry=r,
        )
        self.serialisations = Counter(
            "controlplane_snapshot_resources_serialised_total",
            "Resources serialised into snapshots: once per resource version, whatever the streams.",
            registry=r,
        )
        self.config_reloads = Counter(
            "controlplane_config_reloads_total",
            "Fleet config loads, by result (success, invalid).",
            ["result"],
            registry=r,
        )
        self.config_last_success = Gauge(
            "controlplane_config_last_reload_success_timestamp_seconds",
            "Unix time of the last fleet config that loaded and was published.",
            registry=r,
        )
        self.config_valid = Gauge(
            "controlplane_config_valid",
            "1 if the config file on disk is valid and served; 0 if the last edit was refused.",
            registry=r,
        )
        self.version_traffic = Gauge(
            "controlplane_version_traffic_ratio",
            "Share (0-1) of the model's traffic the routes send to the version now: 1 for the "
            "stable version outside a rollout, the step's split during one, 0 for the others.",
            ["model", "version"],
            registry=r,
        )
        self.cluster_info = Gauge(
            "controlplane_cluster_info",
            "Always 1: maps the Envoy cluster name of a model version (envoy_cluster_name, as "
            "Envoy's stats label it) to its model and version, for joins in queries "
            "(`* on (envoy_cluster_name) group_left (model, version)`).",
            ["envoy_cluster_name", "model", "version"],
            registry=r,
        )
        self.slo_objective = Gauge(
            "controlplane_model_slo_objective",
            "The model's objective (0-1: the share of requests that must be good) for each "
            "indicator: availability, ttft, tpot (the fleet file's slo, else its tier's, else the "
            "defaults). The burn-rate alerts divide by 1 - this.",
            ["model", "sli"],
            registry=r,
        )
        self.slo_threshold = Gauge(
            "controlplane_model_slo_threshold_seconds",
            "The latency a good request stays under, for ttft and tpot; `le` is the same value "
            "spelt as the histogram bucket it selects in controlplane_model_time_*_seconds.",
            ["model", "sli", "le"],
            registry=r,
        )
        self.store_reachable = Gauge(
            "controlplane_store_reachable",
            "1 while the shared store (etcd, with --store) answered this replica's latest "
            "leader-election round (every ttl/3 s); 0 while it does not. Absent without --store.",
            registry=r,
        )
        self.balancing = BalancingMetrics(r)
        self.collectors = CollectorMetrics(r)
        self.prometheus_source = PrometheusSourceMetrics(r)
        self.rollouts = RolloutMetrics(r)
        self.autoscaling = AutoscalingMetrics(r)
        self.discovery = DiscoveryMetrics(r)
        self.hold = HoldMetrics(r)
        self.loops = LoopMetrics(r)
        self.build_info = Gauge(
            "controlplane_build_info",
            "Always 1; the labels say which build of the control plane runs.",
            ["version"],
            registry=r,
        )
        self.build_info.labels(__version__).set(1)
        self.event_loop_lag = Gauge(
            "controlplane_event_loop_lag_seconds",
            "The longest the asyncio event loop (xDS streams, rounds, the operator API) ran late "
            "over the last 15 s: how much later than asked a 0.25 s sleep woke up.",
            registry=r,
        )
        # process_* (CPU seconds, memory, file descriptors, start time) and python_*, as the
        # default registry has them: this registry is our own.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.proxies_nacked = Gauge(
            "controlplane_xds_proxies_nacked",
            "Connected proxies whose latest response of a type was rejected (NACKed).",
            ["type"],
            registry=r,
        )
        # Series at 0 from the start, so rate() and increase() see the first NACK too.
        for label in TYPE_LABELS.values():
            self.nacks.labels(label)
            self.proxies_nacked.labels(label).set(0)
        groups = (self, self.balancing, self.rollouts, self.autoscaling, self.discovery, self.hold)
        self._per_model: tuple[MetricWrapperBase, ...] = tuple(
            m
            for g in groups
            for m in vars(g).values()
            if isinstance(m, MetricWrapperBase) and "model" in m._labelnames
        )

    def retain_models(self, models: Set[str]) -> None:
        """Remove every series labelled with a model the fleet no longer has, in every family
        with a `model` label (gauges that would freeze at their last value, and counters). Label
        values that are not model names stay: "" and "(gateway)", "(unknown)"."""
        for metric in self._per_model:
            at = metric._labelnames.index("model")
            # prometheus_client has no public way to list a family's label sets.
            with metric._lock:
                keys = list(metric._metrics)
            for key in keys:
                model = key[at]
                if model and not model.startswith("(") and model not in models:
                    metric.remove(*key)


ENDPOINT_LABELS = ["model", "version", "endpoint"]

# The periodic loops whose liveness is exported (docs/metrics.md#liveness-and-the-process).
WEIGHTS = "weights"  # the weight loop: signals in, weights and per-endpoint gauges out
SIGNALS = "signals"  # the signal source, checked once per weight round
ROLLOUT = "rollout"  # the rollout and drain tick (the leader's only)
DISCOVERY = "discovery"  # drains of servers that left their discovery source, after each round
LOOPS = (WEIGHTS, SIGNALS, ROLLOUT, DISCOVERY)


class LoopMetrics:
    """Liveness of the periodic loops. A round that raises (or, for the signals, a source that
    does not deliver) counts as an error and leaves the last success where it was: a loop that
    stops succeeding shows as a last success older than its interval, whatever the other gauges
    it would have refreshed still say."""

    def __init__(self, r: CollectorRegistry, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.rounds = Counter(
            "controlplane_loop_rounds",
            "Rounds of a periodic loop (weights, signals, rollout, discovery), by result (ok, "
            "error: it raised, or the signal source did not deliver).",
            ["loop", "result"],
            registry=r,
        )
        self.last_success = Gauge(
            "controlplane_loop_last_success_timestamp_seconds",
            "Unix time at which the loop's latest successful round ended; absent while the loop "
            "does not run on this replica (a follower's rollout loop, signals turned off).",
            ["loop"],
            registry=r,
        )
        self.interval = Gauge(
            "controlplane_loop_interval_seconds",
            "How often the loop is meant to complete a round (its configured period); absent "
            "while the loop does not run on this replica.",
            ["loop"],
            registry=r,
        )
        # Series at 0 from the start, so rate() and increase() see the first error too.
        for loop in LOOPS:
            for result in ("ok", "error"):
                self.rounds.labels(loop, result)

    def succeeded(self, loop: str, interval_s: float) -> None:
        """A round of `loop` did its work."""
        self.rounds.labels(loop, "ok").inc()
        self.last_success.labels(loop).set(self.clock())
        self.interval.labels(loop).set(interval_s)

    def failed(self, loop: str, interval_s: float) -> None:
        """A round of `loop` raised or could not do its work: the last success stays."""
        self.rounds.labels(loop, "error").inc()
        self.interval.labels(loop).set(interval_s)

    def idle(self, loop: str) -> None:
        """`loop` does not run on this replica now: no last success to age, no interval."""
        self.last_success.remove(loop)
        self.interval.remove(loop)


class BalancingMetrics:
    """Per-endpoint loads and weights, per-model balance; registered on the Metrics registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry

        # Per endpoint: rendered from the weight loop's latest rows when read (cheap rounds).
        self.endpoints = EndpointRows()
        r.register(self.endpoints)
        self.balance_degree = Gauge(
            "controlplane_model_load_balance_degree",
            "L: standard deviation of the utilisation ((running + waiting) / capacity) of the ready "
            "endpoints of the model's stable version. 0 is perfectly even.",
            ["model"],
            registry=r,
        )
        self.saturation = Gauge(
            "controlplane_model_saturation",
            "Requests waiting per request running over the ready endpoints of the model's stable "
            "version; priority classes are shed at their shed_at.",
            ["model"],
            registry=r,
        )
        self.shed = Gauge(
            "controlplane_priority_class_shed",
            "1 while the priority class is shed (answered 429 with Retry-After) for the model.",
            ["model", "class"],
            registry=r,
        )
        self.scrape_round = Histogram(
            "controlplane_signals_scrape_round_seconds",
            "Time to scrape every endpoint once (bounded by the scrape timeout).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.weight_updates = Counter(
            "controlplane_weight_updates_total",
            "Weight changes handed to the reconciler, by model.",
            ["model"],
            registry=r,
        )
        self.weight_errors = Counter(
            "controlplane_weight_errors_total",
            "Weight updates of a cluster that failed (its weights in force stay; the other "
            "clusters update as usual), by model. The log line names the cause.",
            ["model"],
            registry=r,
        )
        self.lrs_streams = Gauge(
            "controlplane_lrs_streams", "Connected Envoy load-reporting (LRS) streams.", registry=r
        )
        self.lrs_clamped = Counter(
            "controlplane_lrs_reports_clamped_total",
            "Per-endpoint load reports with a count over a million a second (a bug or a lie), "
            "cut to that before use.",
            registry=r,
        )
        self.lrs_refused = Counter(
            "controlplane_lrs_reports_refused_total",
            "Load reports not used, by reason: no_xds_stream (the reporting node holds no xDS "
            "stream on this replica: anyone can open an LRS stream, only proxies we serve report).",
            ["reason"],
            registry=r,
        )
        self.out_of_sight = Gauge(
            "controlplane_endpoints_out_of_sight",
            "Endpoints whose health and metrics probes go unanswered (refused or timing out), by "
            "model and version, and whether they were held out or kept serving (fail static: the "
            "rest of their cluster cannot vouch that the control plane sees the fleet).",
            ["model", "version", "decision"],
            registry=r,
        )
        self.version_scrape_errors = Counter(
            "controlplane_version_scrape_errors",
            "Scrapes of the version's endpoints that read no load, by reason: unreachable (no HTTP "
            "answer), http_error (/metrics answered non-200), no_dialect (a page with none of the "
            "supported servers' metrics), unreadable (any other page refused), no_series (the "
            "Prometheus source has none for the endpoint). Every reason is present, 0 included.",
            ["model", "version", "reason"],
            registry=r,
        )
        self.sight_lost = Counter(
            "controlplane_loss_of_sight_episodes_total",
            "Times a cluster went into fail static: endpoints out of sight kept serving on their "
            "last verdict because the control plane cannot see enough of the cluster.",
            ["model", "version"],
            registry=r,
        )


PHASES = ("Progressing", "Paused", "Completed", "Aborted")


class RolloutMetrics:
    """Rollouts, drains and the operator API; registered on the Metrics registry."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.phase = Gauge(
            "controlplane_rollout_phase",
            "1 for the phase the model's latest rollout is in (Progressing, Paused, Completed, "
            "Aborted), 0 for the others.",
            ["model", "phase"],
            registry=r,
        )
        self.version_weight = Gauge(
            "controlplane_rollout_version_weight_ratio",
            "Share (0-1) of the model's traffic routed to each version of its latest rollout.",
            ["model", "version"],
            registry=r,
        )
        self.step = Gauge(
            "controlplane_rollout_step",
            "The step (1-based; 0 while waiting for every proxy) of the model's latest rollout.",
            ["model"],
            registry=r,
        )
        self.transitions = Counter(
            "controlplane_rollout_transitions_total",
            "Rollout transitions recorded in the audit trail, by model and the phase entered.",
            ["model", "phase"],
            registry=r,
        )
        self.aborts = Counter(
            "controlplane_rollout_aborts_total",
            "Rollouts aborted, by model and cause (analysis, operator, file).",
            ["model", "cause"],
            registry=r,
        )
        self.analysis_error_ratio = Gauge(
            "controlplane_rollout_analysis_error_ratio",
            "Share (0-1) of failed requests of the canary and of the stable version of a running "
            "rollout since its step began: what the step's analysis judges (role canary or stable).",
            ["model", "version", "role"],
            registry=r,
        )
        self.analysis_p99 = Gauge(
            "controlplane_rollout_analysis_p99_seconds",
            "p99 request latency of the canary and of the stable version of a running rollout since "
            "its step began, from the servers' histograms: what the step's analysis compares.",
            ["model", "version", "role"],
            registry=r,
        )
        self.analysis_requests = Gauge(
            "controlplane_rollout_analysis_requests",
            "Requests the canary and the stable version of a running rollout served since its step "
            "began (the step's analysis needs min_requests on the canary).",
            ["model", "version", "role"],
            registry=r,
        )
        self.draining = Gauge(
            "controlplane_endpoints_draining",
            "Endpoints in each drain state (draining: DRAINING in EDS; drained: removed).",
            ["state"],
            registry=r,
        )
        self.leader = Gauge(
            "controlplane_leader",
            "1 while this replica drives rollouts and drains (always, with one replica; with "
            "several on etcd, the holder of the leader lease). Only the leader exports the rollout "
            "and drain series (controlplane_rollout_*, controlplane_endpoints_draining).",
            registry=r,
        )
        self.leader_changes = Counter(
            "controlplane_leader_changes_total",
            "Times this replica gained or lost the leader lease (several replicas on etcd).",
            registry=r,
        )
        self.admin_requests = Counter(
            "controlplane_admin_requests_total",
            "Operator API calls, by method and gRPC status code.",
            ["method", "code"],
            registry=r,
        )


class DiscoveryMetrics:
    """Endpoint sources (controlplane/discovery/, docs/discovery.md)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.endpoints = Gauge(
            "controlplane_discovery_endpoints",
            "Endpoints the version's discovery source gave at its last answer taken (what is "
            "served, draining ones that left aside).",
            ["model", "version"],
            registry=r,
        )
        self.healthy = Gauge(
            "controlplane_discovery_source_healthy",
            "1 when the version's discovery source's latest answer was taken; 0 while it fails "
            "(errors, an unreachable API server) or answers empty within its hold: the last known "
            "endpoints are served meanwhile.",
            ["model", "version"],
            registry=r,
        )
        self.failures = Counter(
            "controlplane_discovery_failures_total",
            "Answers of the version's discovery source that could not be trusted (timeouts, "
            "SERVFAIL, no nameserver answering, API errors).",
            ["model", "version"],
            registry=r,
        )


class AutoscalingMetrics:
    """Desired replicas per model and version (controlplane/autoscaling/, docs/autoscaling.md)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.desired = Gauge(
            "controlplane_model_desired_replicas",
            "Replicas the model wants (KPA windows over its demand, bounded by min and max); what "
            "KEDA's external scaler and an HPA on a Prometheus adapter read.",
            ["model"],
            registry=r,
        )
        self.version_desired = Gauge(
            "controlplane_version_desired_replicas",
            "Replicas one version of the model wants, from its own servers' demand (a rollout's "
            "canary and stable scale apart).",
            ["model", "version"],
            registry=r,
        )
        self.demand = Gauge(
            "controlplane_model_demand",
            "Requests running or waiting on the model's servers, plus requests held for it, at the "
            "last round.",
            ["model"],
            registry=r,
        )
        self.ready = Gauge(
            "controlplane_model_ready_replicas",
            "The model's servers that are ready and have weight (serving), at the last round.",
            ["model"],
            registry=r,
        )
        self.target = Gauge(
            "controlplane_model_target_per_replica",
            "The demand one replica is meant to carry: autoscaling.target_per_replica, else the "
            "servers' slots x target_utilization, else 8.",
            ["model"],
            registry=r,
        )
        self.panic = Gauge(
            "controlplane_model_autoscaler_panic",
            "1 while the model's autoscaler is in panic mode (following the short window, never "
            "scaling down).",
            ["model"],
            registry=r,
        )
        self.forecast = Gauge(
            "controlplane_model_forecast_demand",
            "Predictive pre-warm: the highest demand forecast for the model from now to its cold "
            "start ahead (arrival-rate forecast x observed time per request); absent while no "
            "forecast is trusted or predictive is off.",
            ["model"],
            registry=r,
        )
        self.forecast_error = Gauge(
            "controlplane_model_forecast_error",
            "Predictive pre-warm: each method's mean absolute backtest error (requests/s) at the "
            "last refit; the chosen method beat `naive` (the last value) by 10%.",
            ["model", "method"],
            registry=r,
        )
        self.cold_start = Gauge(
            "controlplane_model_cold_start_seconds",
            "Predictive pre-warm's lead: the 90th percentile of the model's observed cold starts "
            "(a server joined or started until first ready), else its configured cold_start.",
            ["model"],
            registry=r,
        )


class HoldMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.held = Gauge(
            "controlplane_held_requests",
            "Requests waiting in the holding service for the model's first ready server.",
            ["model"],
            registry=r,
        )
        self.outcomes = Counter(
            "controlplane_hold_requests_total",
            "Requests the holding service took, by model and outcome: forwarded (to a server once "
            "ready), full (429: hold_max reached), timeout (503: no server ready within the route "
            "timeout), unknown_model, upstream_error (503: servers refused or answered 503 until the "
            "timeout).",
            ["model", "outcome"],
            registry=r,
        )
        self.wait = Histogram(
            "controlplane_hold_wait_seconds",
            "How long forwarded requests waited for a ready server.",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )


PROMETHEUS_OUTCOMES = ("success", "error", "http_error", "unreachable", "timeout", "invalid")


class PrometheusSourceMetrics:
    """The `prometheus` signal source's queries (signals/prometheus.py)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.queries = Counter(
            "controlplane_signals_prometheus_queries_total",
            "Instant queries sent to Prometheus, by query (the family read) and outcome (success, "
            "error: Prometheus answered status error; http_error, unreachable, timeout, invalid: "
            "an answer that is not the expected JSON).",
            ["query", "outcome"],
            registry=r,
        )
        self.query_seconds = Histogram(
            "controlplane_signals_prometheus_query_seconds",
            "Time from sending one instant query to Prometheus to its answer read and decoded.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.series_matched = Gauge(
            "controlplane_signals_prometheus_series_matched",
            "Series in the latest complete round of answers that counted for a fleet endpoint.",
            registry=r,
        )
        self.series_unmatched = Gauge(
            "controlplane_signals_prometheus_series_unmatched",
            "Series in the latest complete round of answers that named no fleet endpoint (another "
            "address, or another model's series).",
            registry=r,
        )
        self.endpoints_without_series = Gauge(
            "controlplane_signals_prometheus_endpoints_without_series",
            "Fleet endpoints for which the latest complete round found no series (Prometheus does not "
            "scrape them, cannot reach them, or labels them otherwise); their signals fade.",
            registry=r,
        )


class CollectorMetrics:
    """The `scrape` signal source's collector processes (signals/collector.py): the
    observer observed."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.cpu = Counter(
            "controlplane_signals_collector_cpu_seconds",
            "CPU seconds used by the collector processes (scraping and parsing, outside xDS).",
            registry=r,
        )
        self.scrapes = Counter(
            "controlplane_signals_scrapes",
            "Endpoint scrapes by outcome: ok, unreachable (no HTTP answer), http_error "
            "(/metrics answered non-200), unreadable (a page that does not parse).",
            ["outcome"],
            registry=r,
        )
        self.pages = Counter("controlplane_signals_pages", "Metrics pages read.", registry=r)
        self.page_bytes = Counter(
            "controlplane_signals_page_bytes", "Bytes of metrics pages read.", registry=r
        )
        self.parse = Counter(
            "controlplane_signals_parse_seconds",
            "Seconds spent parsing metrics pages (the families read only) in the collectors.",
            registry=r,
        )
        self.stalled = Counter(
            "controlplane_signals_collector_stalled_seconds",
            "Seconds the collector processes' event loops stood still (short of CPU, or the "
            "machine frozen); scrape timeouts count only the time they ran.",
            registry=r,
        )
        self.lag = Gauge(
            "controlplane_signals_scrape_lag_seconds",
            "The latest a scrape started after its due time since the last round (0: on time; "
            "grows when collectors are short of CPU or of concurrency).",
            registry=r,
        )
        self.backing_off = Gauge(
            "controlplane_signals_endpoints_backing_off",
            "Endpoints unreachable for longer than the hold-out threshold, probed less often "
            "(up to every 30 s, jittered) until they answer.",
            registry=r,
        )
        self.collectors = Gauge(
            "controlplane_signals_collectors", "Collector processes running and reporting.", registry=r
        )
        self.restarts = Counter(
            "controlplane_signals_collector_restarts",
            "Collector processes started again after dying or going silent.",
            ["reason"],
            registry=r,
        )
        self.records = Counter(
            "controlplane_signals_records", "Load records received from the collectors.", registry=r
        )
