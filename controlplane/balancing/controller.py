"""The weight loop (thin I/O shell): take signals, fold into the store, weigh, hand on.

Every `signals.interval` of the fleet file: what the signal source observed since the
last round (`signals/source.py`: collector processes scraping the servers, or
Prometheus; never a scrape in this process), then every cluster's weights are recomputed
from the store (signals plus Envoy load reports) and only changed clusters go to the
reconciler, which debounces them into a snapshot. Per-endpoint gauges are refreshed each
round, series of models that left the fleet removed, and the loop's liveness (and the signal
source's) counted: `controlplane_loop_rounds_total`, `..._last_success_timestamp_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping

import structlog

from controlplane.autoscaling.autoscaler import MODEL, Autoscaler
from controlplane.autoscaling.kpa import Decision
from controlplane.balancing.readiness import held_out
from controlplane.balancing.shedding import saturation, shed_classes
from controlplane.balancing.weigher import Weigher, load_balance_degree, relative_capacity
from controlplane.fleet.model import Endpoint, Fleet, Model, ScalingPolicy
from controlplane.flow.demand import PickerQueues, combined
from controlplane.obs.endpoint_metrics import EndpointRow
from controlplane.obs.metrics import SIGNALS, WEIGHTS, Metrics
from controlplane.resources.names import cluster_name
from controlplane.signals.load import EndpointLoad
from controlplane.signals.model_latency import ModelLatency
from controlplane.signals.scrape import scrape_targets
from controlplane.signals.source import SignalSource, make_source
from controlplane.signals.store import SCRAPE_ERROR_REASONS, EndpointSignals, SignalStore
from controlplane.xds.reconciler import Reconciler

log = structlog.get_logger("controlplane.balancing")


class WeightController:
    """Owns the signal store, the scraper and the weigher; drives them once per interval."""

    def __init__(
        self,
        reconciler: Reconciler,
        metrics: Metrics,
        store: SignalStore | None = None,
        collectors: int | None = None,
    ) -> None:
        self.reconciler = reconciler
        self.collectors = collectors  # collector processes (None: sized to the cores; 0: inline)
        self.metrics = metrics
        self.store = store or SignalStore()
        self.weigher = Weigher()
        # Per model version TTFT and TPOT histograms, merged from the servers' own when read.
        self.model_latency = ModelLatency(metrics.registry)
        self.autoscaler = Autoscaler()
        self.held: Callable[[], Mapping[str, float]] | None = None  # requests held per model
        # Requests waiting in the pickers' flow-control queues, as they report them: demand too.
        self.picker_queues = PickerQueues(time.monotonic)
        self._scaling_exported: set[tuple[str, str]] = set()
        self._desired: dict[str, int] = {}  # model -> desired replicas last exported
        self._wake = asyncio.Event()  # set: start the next round now
        self._first_round: dict[tuple[str, str], int] = {}  # endpoint -> the round it joined in
        # Servers that joined a running control plane, until first ready: when they joined, and
        # whether they were seen not ready (then join-to-ready is a cold start, for pre-warm).
        self._warming: dict[tuple[str, str], tuple[float, bool]] = {}
        self._completed_seen: dict[tuple[str, str], float] = {}  # endpoint -> completed, last round
        self._forecast_methods: dict[str, set[str]] = {}  # model -> forecast_error series exported
        self._round = asyncio.Event()  # set (and replaced) when a round ends
        self._source: SignalSource | None = None
        self._ready: dict[tuple[str, str], bool] = {}
        self._was_ready: set[tuple[str, str]] = set()  # endpoints ready at least once since they joined
        self._models_exported: set[str] = set()
        self._fail_static: set[str] = set()  # clusters keeping endpoints out of sight in service
        self._sight_exported: set[tuple[str, str]] = set()
        # (model, version, address) -> its signals and their scrape errors by reason already
        # counted for the version (a new EndpointSignals, after the endpoint left and came back,
        # counts from 0 again)
        self._scrape_errors_counted: dict[tuple[str, str, str], tuple[EndpointSignals, dict[str, int]]] = {}
        self._versions_exported: set[tuple[str, str]] = set()
        self.rounds = 0

    async def _source_for(self, fleet: Fleet) -> SignalSource:
        """The signal source for the fleet's settings; a new one (the old closed) when they change."""
        cur = self._source
        if cur is None or not cur.matches(fleet):
            if cur is not None:
                await cur.close()
            cur = self._source = make_source(fleet, self.metrics, self.collectors)
        return cur

    async def close(self) -> None:
        if self._source is not None:
            await self._source.close()
            self._source = None

    async def tick(self, *, first: bool = False) -> None:
        """One round: take what the source observed, recompute weights, push changes, export
        metrics. `first`: at start, wait up to one collection timeout for first signals."""
        fleet = self.reconciler.fleet
        if fleet is None:
            return
        targets = scrape_targets(fleet)
        self.store.retain(set(targets))
        loops = self.metrics.loops
        if fleet.signals.enabled:
            started = time.perf_counter()
            try:
                source = await self._source_for(fleet)
                results = await source.collect(fleet, targets, first=first)
            except Exception:
                loops.failed(SIGNALS, fleet.signals.interval_s)
                raise
            if source.failing is None:
                loops.succeeded(SIGNALS, fleet.signals.interval_s)
            else:
                loops.failed(SIGNALS, fleet.signals.interval_s)
            self.metrics.balancing.scrape_round.observe(time.perf_counter() - started)
            now = time.monotonic()
            for key, result in results.items():
                self.store.record_scrape(key, result, now)
            # Servers' TTFT/TPOT histograms, merged per version when /metrics is read: O(1) here.
            self.model_latency.observe(fleet, ((k, self.store.sample(k)) for k in results))
        else:
            loops.idle(SIGNALS)
            if self._source is not None:
                await self.close()
        fleet = self.reconciler.fleet or fleet  # the file may have changed while we collected
        now = time.monotonic()
        capacity: dict[tuple[str, str], float] = {}
        for m in fleet.models:
            for v in m.versions:
                rel = relative_capacity(
                    {ep.address: fleet.declared_capacity(ep) for ep in v.endpoints},
                    {ep.address: self.store.learnt_throughput((m.name, ep.address)) for ep in v.endpoints},
                )
                capacity.update({(m.name, a): c for a, c in rel.items()})
        # Servers no probe has seen ready yet are held out while their cluster has one that is
        # (balancing/readiness.py: the rule, and its exceptions, for whom and why).
        targets_now = set(scrape_targets(fleet)) if fleet.signals.enabled else set()
        for key in targets_now:
            if key not in self._first_round:
                self._first_round[key] = self.rounds
                if self.rounds > 0:
                    self._warming[key] = (now, False)
        for key in [k for k in self._first_round if k not in targets_now]:
            del self._first_round[key]
        self._observe_cold_starts(targets_now, now)
        seen = {k for k in targets_now if self.store.seen_ready(k)}
        # Each version's keys, when any server is still to be seen ready; the probes' word now
        # (a whole load each) is read only where the rule looks at it.
        clusters = (
            [[(m.name, ep.address) for ep in v.endpoints] for m in fleet.models for v in m.versions]
            if len(seen) < len(targets_now)
            else []
        )
        doubt = {k for keys in clusters if not seen.issuperset(keys) for k in keys}
        held = held_out(
            clusters,
            seen_ready=seen,
            ready={k for k in doubt if self.store.load(k, 1.0, now).ready},
            first_round={k for k, joined in self._first_round.items() if joined == 0},
        )

        def load_of(m: Model, ep: Endpoint) -> EndpointLoad:
            key = (m.name, ep.address)
            load = self.store.load(key, capacity.get(key, 1.0), now)
            return dataclasses.replace(load, ready=False) if key in held else load

        changed = self.weigher.update(fleet, load_of)
        for cname, why in self.weigher.errors.items():
            log.error(
                "weights not updated for a cluster; its weights in force stay", cluster=cname, error=why
            )
            self.metrics.balancing.weight_errors.labels(cname.rpartition("@")[0]).inc()
        for cname, weights in changed.items():
            self.reconciler.set_weights(cname, weights)
            self.metrics.balancing.weight_updates.labels(cname.rpartition("@")[0]).inc()
        self._shed(fleet)
        self._autoscale(fleet, now)
        self._log_readiness()
        self._watch_sight()
        self._export(fleet, now)
        # Series of models the fleet no longer has, whichever room exported them.
        self.metrics.retain_models({m.name for m in fleet.models})
        self.model_latency.retain(fleet)
        self.rounds += 1

    def _observe_cold_starts(self, targets: set[tuple[str, str]], now: float) -> None:
        """A joined server seen not ready, then ready: its model's cold start (the lead of
        predictive pre-warm). One ready at its first answer tells nothing and is dropped."""
        for key, (joined, seen_loading) in list(self._warming.items()):
            if key not in targets:
                del self._warming[key]
            elif self.store.heard(key):
                if not self.store.load(key, 1.0, now).ready:
                    self._warming[key] = (joined, True)
                    continue
                if seen_loading:
                    self.autoscaler.forecaster.cold_starts.observe(key[0], now - joined)
                del self._warming[key]

    def _export_forecast(self, policy: ScalingPolicy | None, model: str, d: Decision) -> None:
        """Predictive pre-warm's gauges for one model: present only while it is on."""
        a = self.metrics.autoscaling
        f = self.autoscaler.forecaster
        if policy is None or not policy.predictive:
            self._forget_forecast(model)
            return
        a.cold_start.labels(model).set(f.cold_starts.lead(model, policy.cold_start_s)[0])
        if d.predicted_demand is not None:
            a.forecast.labels(model).set(d.predicted_demand)
        else:
            with contextlib.suppress(KeyError):
                a.forecast.remove(model)
        fit = f.fits.get(model)
        errors = dict(fit.errors) if fit is not None else {}
        for method, err in errors.items():
            a.forecast_error.labels(model, method).set(err)
        for method in self._forecast_methods.get(model, set()) - errors.keys():
            a.forecast_error.remove(model, method)
        self._forecast_methods[model] = set(errors)

    def _forget_forecast(self, model: str) -> None:
        a = self.metrics.autoscaling
        for g in (a.cold_start, a.forecast):
            with contextlib.suppress(KeyError):
                g.remove(model)
        for method in self._forecast_methods.pop(model, set()):
            a.forecast_error.remove(model, method)

    def _completed_since_last_round(self, fleet: Fleet) -> dict[str, float]:
        """Requests each model's servers finished since the last round (its arrivals, for
        predictive pre-warm); a server's first round counts nothing."""
        out: dict[str, float] = {}
        seen: dict[tuple[str, str], float] = {}
        for m in fleet.models:
            for v in m.versions:
                for ep in v.endpoints:
                    key = (m.name, ep.address)
                    total = seen[key] = self.store.completed(key)
                    prev = self._completed_seen.get(key)
                    if prev is not None and total >= prev:
                        out[m.name] = out.get(m.name, 0.0) + total - prev
        self._completed_seen = seen
        return out

    def _autoscale(self, fleet: Fleet, now: float) -> None:
        """Desired replicas per model and version from this round's loads (autoscaling/)."""
        decisions = self.autoscaler.update(
            fleet,
            self.weigher.views.values(),
            now,
            slots=lambda model, address: self.store.slots((model, address)),
            held=combined(self.held, self.picker_queues.demand)(),
            wall=time.time(),
            completed=self._completed_since_last_round(fleet),
        )
        a = self.metrics.autoscaling
        exported: set[tuple[str, str]] = set()
        models = {m.name: m for m in fleet.models}
        for (model, version), d in decisions.items():
            exported.add((model, version))
            if version == MODEL:
                before = self._desired.get(model)
                if before is not None and before != d.desired:
                    log.info(
                        "desired replicas changed",
                        model=model,
                        desired=d.desired,
                        was=before,
                        ready=d.ready,
                        demand=round(d.demand, 1),
                        reason=d.reason,
                    )
                self._desired[model] = d.desired
                a.desired.labels(model).set(d.desired)
                a.demand.labels(model).set(d.demand)
                a.ready.labels(model).set(d.ready)
                a.target.labels(model).set(d.target)
                a.panic.labels(model).set(1 if d.panicking else 0)
                m = models.get(model)
                self._export_forecast(fleet.scaling_of(m) if m is not None else None, model, d)
            else:
                a.version_desired.labels(model, version).set(d.desired)
        for model, version in self._scaling_exported - exported:
            if version == MODEL:
                self._desired.pop(model, None)
                for g in (a.desired, a.demand, a.ready, a.target, a.panic):
                    g.remove(model)
                self._forget_forecast(model)
            else:
                a.version_desired.remove(model, version)
        self._scaling_exported = exported

    def _shed(self, fleet: Fleet) -> None:
        """Decide, per model, which priority classes its stable version's saturation sheds."""
        b = self.metrics.balancing
        for m in fleet.models:
            view = self.weigher.views.get(cluster_name(m.name, m.stable))
            if view is None:
                continue
            level = saturation(view.loads)
            b.saturation.labels(m.name).set(level)
            before = self.reconciler.shed.get(m.name, frozenset())
            after = shed_classes(fleet.priority_classes, level, before)
            if after != before:
                log.warning(
                    "priority classes shed" if after > before else "priority classes admitted again",
                    model=m.name,
                    saturation=round(level, 3),
                    shed=sorted(after),
                )
            self.reconciler.set_shed(m.name, after)
            for c in fleet.priority_classes:
                b.shed.labels(m.name, c.name).set(1 if c.name in after else 0)

    def _log_readiness(self) -> None:
        seen: set[tuple[str, str]] = set()
        for view in self.weigher.views.values():
            for load in view.loads:
                key = (view.model, load.address)
                seen.add(key)
                was = self._ready.get(key)
                if (was is None and not load.ready) or (was is not None and was != load.ready):
                    sig = self.store.endpoints.get(key)
                    log.info(
                        "endpoint ready" if load.ready else "endpoint held out",
                        model=view.model,
                        version=view.version,
                        endpoint=load.address,
                        reason=None if load.ready or sig is None else sig.last_error or "health check",
                    )
                self._ready[key] = load.ready
                if load.ready:
                    self._was_ready.add(key)
        # An endpoint that leaves and joins again starts warming again.
        self._was_ready &= seen
        self._ready = {k: v for k, v in self._ready.items() if k in seen}

    def _watch_sight(self) -> None:
        """Count and log each cluster's entry into fail static (and its end); export how many
        endpoints are out of sight, held out or kept."""
        b = self.metrics.balancing
        exported: set[tuple[str, str]] = set()
        for cname, view in self.weigher.views.items():
            kept = view.kept_out_of_sight
            if view.out_of_sight or (view.model, view.version) in self._sight_exported:
                b.out_of_sight.labels(view.model, view.version, "held_out").set(view.out_of_sight - kept)
                b.out_of_sight.labels(view.model, view.version, "kept").set(kept)
                exported.add((view.model, view.version))
            if kept and cname not in self._fail_static:
                self._fail_static.add(cname)
                b.sight_lost.labels(view.model, view.version).inc()
                log.warning(
                    "lost sight of servers: keeping them in service on their last verdict",
                    model=view.model,
                    version=view.version,
                    out_of_sight=view.out_of_sight,
                    endpoints=len(view.loads),
                )
            elif not kept and cname in self._fail_static:
                self._fail_static.discard(cname)
                log.info("servers back in sight", model=view.model, version=view.version)
        for model, version in self._sight_exported - exported:
            for decision in ("held_out", "kept"):
                with contextlib.suppress(KeyError):
                    b.out_of_sight.remove(model, version, decision)
        self._fail_static &= set(self.weigher.views)
        self._sight_exported = exported

    def _export(self, fleet: Fleet, now: float) -> None:
        """Per-endpoint gauges: one tuple of rows handed over (rendered when /metrics is read,
        obs/endpoint_metrics.py); per-model gauges set here."""
        b = self.metrics.balancing
        rows: list[EndpointRow] = []
        endpoints = self.store.endpoints
        for view in self.weigher.views.values():
            for load in view.loads:
                key = (view.model, load.address)
                sig = endpoints.get(key)
                rows.append(
                    EndpointRow(
                        view.model,
                        view.version,
                        load.address,
                        view.weights.get(load.address, 0),
                        load.ready,
                        load.capacity,
                        load.running,
                        load.waiting,
                        load.kv_use,
                        load.latency_s,
                        load.error_rate,
                        load.age_s,
                        self.store.lrs_totals(key, now)[0] if sig is not None and sig.lrs else 0.0,
                        sig.scrape_errors if sig is not None else 0,
                        was_ready=key in self._was_ready,
                        adapters_in_use=None
                        if load.max_lora is None
                        else float(len({*(load.lora_running or ()), *(load.lora_waiting or ())})),
                        adapter_slots=None if load.max_lora is None else float(load.max_lora),
                    )
                )
        b.endpoints.publish(tuple(rows), at=now)
        self._export_scrape_errors()
        models: set[str] = set()
        for m in fleet.models:
            stable = self.weigher.views.get(cluster_name(m.name, m.stable))
            if stable is not None:
                b.balance_degree.labels(m.name).set(load_balance_degree(stable.loads))
                models.add(m.name)
        for gone in self._models_exported - models:
            b.balance_degree.remove(gone)
        self._models_exported = models

    def _export_scrape_errors(self) -> None:
        """Per version, the scrape errors of its endpoints by reason: each endpoint's new
        errors since the last round are added, so the counter never goes down when an
        endpoint leaves."""
        b = self.metrics.balancing
        endpoints = self.store.endpoints
        counted = {
            k: (sig, n)
            for k, (sig, n) in self._scrape_errors_counted.items()
            if endpoints.get((k[0], k[2])) is sig
        }
        versions: set[tuple[str, str]] = set()
        for view in self.weigher.views.values():
            mv = (view.model, view.version)
            if mv not in self._versions_exported:
                for reason in SCRAPE_ERROR_REASONS:
                    b.version_scrape_errors.labels(view.model, view.version, reason)
            versions.add(mv)
            for load in view.loads:
                sig = endpoints.get((view.model, load.address))
                if sig is None or not sig.scrape_errors_by_reason:
                    continue
                key = (view.model, view.version, load.address)
                held = counted.get(key)
                before = held[1] if held is not None else {}
                for reason, n in sig.scrape_errors_by_reason.items():
                    if n > before.get(reason, 0):
                        b.version_scrape_errors.labels(*mv, reason).inc(n - before.get(reason, 0))
                counted[key] = (sig, dict(sig.scrape_errors_by_reason))
        for model, version in self._versions_exported - versions:
            for reason in {*SCRAPE_ERROR_REASONS, "other"}:
                with contextlib.suppress(KeyError):
                    b.version_scrape_errors.remove(model, version, reason)
        self._scrape_errors_counted = counted
        self._versions_exported = versions

    def wake(self) -> None:
        """Start the next round now (a request held for a model with no server: wake it)."""
        self._wake.set()

    async def next_round(self) -> None:
        """Return once the next round has ended."""
        await self._round.wait()

    async def one_round(self) -> None:
        """One round of the loop: a round that raises is logged and counted as an error (its
        gauges stay as they were, the last success does not advance) and the next one runs."""
        try:
            await self.tick()
        except Exception:
            log.exception("weight update failed; the weights in force stay")
            self.metrics.loops.failed(WEIGHTS, self.interval_s())
        else:
            self.metrics.loops.succeeded(WEIGHTS, self.interval_s())

    async def run(self) -> None:
        """A round every `signals.interval` until cancelled."""
        while True:
            started = time.monotonic()
            self._wake.clear()
            await self.one_round()
            done, self._round = self._round, asyncio.Event()
            done.set()
            # The interval is read again every quarter second: a reloaded fleet file with a
            # shorter one takes effect at once, not after the old interval ran out.
            while (left := self.interval_s() - (time.monotonic() - started)) > 0 and not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), min(left, 0.25))

    def interval_s(self) -> float:
        """The period of the loop: the fleet's `signals.interval` (1 s before a fleet loads)."""
        fleet = self.reconciler.fleet
        return fleet.signals.interval_s if fleet is not None else 1.0
