"""The rollout controller: operator commands and ticks in, stored state and routing out (I/O shell).

It owns the API layer over the fleet file (rollouts, promoted stables, retiring versions,
endpoint drains). Every command is checked, run through the pure state machine, committed
to the store with its audit records, and only then applied and acknowledged. Once a second
it ticks each running rollout (proxies' ACKs, analysis from the signals) and each drain (in
flight down to 0, or its deadline). After a restart it carries on from the stored state.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import structlog

from controlplane import limits
from controlplane.fleet.model import Fleet, Model
from controlplane.obs.metrics import ROLLOUT, Metrics
from controlplane.resources.names import cluster_name
from controlplane.resources.types import ENDPOINT
from controlplane.rollout import machine
from controlplane.rollout.analysis import VersionFigures, analysis, figures, with_peer_reports
from controlplane.rollout.export import RolloutSeries
from controlplane.rollout.machine import (
    Effect,
    Rollout,
    RolloutRejected,
    RolloutSpec,
    SetStable,
    Transition,
)
from controlplane.rollout.overlay import (
    EndpointDrain,
    ModelLayer,
    active,
    effective,
    stale_layers,
)
from controlplane.rollout.store import (
    AuditRecord,
    StateChange,
    StateStore,
    StoreConflict,
    StoreUnavailable,
)
from controlplane.signals.load import counted
from controlplane.signals.store import EndpointCounters, EndpointKey, SignalStore
from controlplane.xds.reconciler import Reconciler

log = structlog.get_logger("controlplane.rollout")

Code = Literal["INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "UNAVAILABLE", "ABORTED"]
DRAIN_TIMEOUT_S = 120.0  # an endpoint drain removes the endpoint after this even if busy
DRAIN_SETTLE_S = 3.0  # at least this long DRAINING, so every proxy has it and signals are fresh
# A version traffic left is marked DRAINING no sooner than this after the route change (the
# snapshot with it is out by then: debounce max delay 1 s), once no proxy's routes name it.
ROUTES_SETTLE_S = 1.0
# A version left outside a rollout (an aborted canary, say) that proxies still route to after
# this is reported (audit, log) naming them; it drains anyway after DRAIN_TIMEOUT_S.
LEAVE_REPORT_S = 30.0
# Envoy reopens a failed load-report stream after 5 s, to any replica (a dead one again,
# maybe): for this long after this replica starts or takes the lead, a window without load
# reports proves nothing, so its analysis counts as watched only from then on.
LRS_RECONNECT_S = 12.0


class ProxyView(Protocol):
    """What rollouts and drains ask of the connected proxies (xds/server.py's ProxyRegistry)."""

    def routing_to(self, cluster: str, envoys_only: bool = False) -> tuple[str, ...]:
        """Proxies whose routes name the cluster (Envoys only: `envoys_only`)."""

    def lacking(self, cluster: str) -> tuple[str, ...]:
        """Envoys that have not ACKed the cluster and its endpoints."""

    def all_synced(self, type_url: str) -> bool:
        """Whether every proxy that asked for the type has ACKed its latest."""


class CommandRejected(Exception):
    """An operator command that cannot apply; `code` is the gRPC status to answer with."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Baseline:
    step: int
    step_started_at: float
    counters: dict[str, EndpointCounters]
    taken_at: float


class RolloutController:
    """Holds the API layer; feeds the reconciler the effective fleet and routing overlay."""

    def __init__(
        self,
        store: StateStore,
        reconciler: Reconciler,
        signals: SignalStore,
        registry: ProxyView,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
        tick_s: float = 1.0,
        peer_reports: Callable[[EndpointKey], EndpointCounters] | None = None,
        actor: str = "controller",
    ) -> None:
        self.store = store
        # Who the audit trail names for what the controller does by itself (steps, analysis,
        # completion): "controller", or "controller@<replica id>" with several replicas.
        self.actor = actor
        self.reconciler = reconciler
        self.signals = signals
        self.registry = registry
        self.metrics = metrics
        self.clock = clock
        self._file_read_at = -math.inf  # when the file last changed (set_file_fleet)
        self.tick_s = tick_s
        self.file_fleet: Fleet | None = None
        self.rollouts: dict[str, Rollout] = {}
        self.layers: dict[str, ModelLayer] = {}
        self.drains: dict[str, EndpointDrain] = {}
        self.figures: dict[str, tuple[VersionFigures, VersionFigures]] = {}
        # Why a running step's analysis is inconclusive so far (shown with the status; a
        # timed step pauses on it once its interval has elapsed).
        self.inconclusive: dict[str, str] = {}
        # The load reports other replicas received (HA), to add to this replica's own.
        self.peer_reports = peer_reports
        self._baselines: dict[str, _Baseline] = {}
        self._driving_since: float | None = None  # when this replica began ticking rollouts
        self._leave_reported: set[tuple[str, str]] = set()
        self.series = RolloutSeries(metrics)
        # Run at each tick after the rollouts' own, before versions retire (endpoint drains:
        # drain/controller.py).
        self.tick_hooks: list[Callable[[float], Awaitable[None]]] = []
        self._changed = asyncio.Event()
        # Whether this replica drives rollouts and drains (ticks them). With one replica it
        # always does; with several, the one holding the etcd lease does (controlplane/ha/).
        self.leader = True
        # A replica that just gained the lead reloads the stored state before it drives: what
        # it holds may have missed a change (its member lost when the change was made).
        self._reload_first = False

    async def restore(self) -> None:
        """Load the stored state (at start, and when another replica changed it)."""
        state = await self.store.load()
        first = not (self.rollouts or self.layers or self.drains)
        self.rollouts, self.layers, self.drains = state.rollouts, state.layers, state.drains
        resumed = [f"{m} at step {r.step + 1} ({r.phase})" for m, r in self.rollouts.items() if active(r)]
        if first and (resumed or self.drains):
            log.info(
                "rollout state restored", rollouts=resumed, drains=len(self.drains), store=self.store.where
            )
        self.publish()

    async def _write(
        self,
        who: str,
        transitions: Iterable[Transition] = (),
        **changes: Any,
    ) -> None:
        """Write to the store, or raise CommandRejected saying why nothing changed."""
        try:
            await self.store.write(who, transitions, StateChange(**{k: tuple(v) for k, v in changes.items()}))
        except StoreUnavailable as e:
            raise CommandRejected(
                "UNAVAILABLE",
                f"the state store is unreachable ({e}); nothing was changed; retry once it is back",
            ) from None
        except StoreConflict:
            await self.restore()
            raise CommandRejected(
                "ABORTED",
                "another control-plane replica changed this at the same moment; nothing was changed "
                "by this call: look at the state again and retry",
            ) from None

    # ---- the file and what is served -----------------------------------------------------

    def set_file_fleet(self, fleet: Fleet) -> None:
        """A (re)loaded fleet: serve it at once. Layers it has moved past, and rollouts it
        broke, stop applying now (overlay.effective ignores them); `reconcile_file` records
        that in the store."""
        if fleet != self.file_fleet:
            self._file_read_at = self.clock()
        self.file_fleet = fleet
        self.publish()

    async def reconcile_file(self) -> None:
        """Drop the layers the fleet has moved past and abort the rollouts it broke, durably."""
        fleet = self.file_fleet
        if fleet is None:
            return
        if self.clock() - self._file_read_at < limits.FILE_SETTLE_S:
            # Never persist a destructive decision from one reading: a file caught half-written
            # (then whole again a moment later) would abort a rollout for good. What is served
            # follows the file at once; the store follows once the file has held still.
            return
        stale = stale_layers(fleet, self.layers.values())
        transitions: list[Transition] = []
        for layer in stale:
            transitions.append(
                Transition(
                    layer.model,
                    "Completed",
                    -1,
                    0,
                    f"the file's stable for {layer.model} changed from {layer.file_stable}; "
                    "the file wins and the API's changes to the model are dropped",
                )
            )
        aborted: list[Rollout] = []
        by_name = {m.name: m for m in fleet.models}
        for model, r in self.rollouts.items():
            if not active(r):
                continue
            m = by_name.get(model)
            why = (
                "the model left the fleet file"
                if m is None
                else f"the file no longer has version {r.spec.canary}"
                if r.spec.canary not in {v.name for v in m.versions}
                else f"the file no longer has version {r.spec.stable}"
                if r.spec.stable not in {v.name for v in m.versions}
                else None
            )
            if why is None:
                continue
            a, effects = machine.apply(r, machine.Abort(f"{why}; aborted"))
            aborted.append(a)
            transitions += [e for e in effects if isinstance(e, Transition)]
        if stale or aborted:
            await self._write(
                "fleet-file", transitions, rollouts=aborted, drop_layers=[x.model for x in stale]
            )
            for x in stale:
                del self.layers[x.model]
            for a in aborted:
                self.rollouts[a.spec.model] = a
                self.metrics.rollouts.aborts.labels(a.spec.model, "file").inc()
                log.warning("rollout aborted by a file change", model=a.spec.model, reason=a.reason)
            self._count(transitions)
            self.publish()

    def publish(self) -> None:
        """Hand the reconciler the fleet as served and the routing overlay."""
        if self.file_fleet is None:
            return
        fleet, overlay = effective(self.file_fleet, self.layers, self.rollouts, self.drains)
        if fleet != self.reconciler.fleet:
            self.reconciler.set_fleet(fleet)
        self.reconciler.set_overlay(overlay)
        self.series.export_routing(fleet, overlay)
        self._export()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout_s: float) -> None:
        """Return at the next change, or after `timeout_s`."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    # ---- rollout commands -----------------------------------------------------------------

    def _model(self, name: str) -> Model:
        fleet = self.file_fleet
        if fleet is None:
            raise CommandRejected("FAILED_PRECONDITION", "no fleet is loaded yet; fix the fleet file first")
        for m in fleet.models:
            if m.name == name:
                return m
        known = ", ".join(m.name for m in fleet.models) or "none"
        raise CommandRejected("NOT_FOUND", f"unknown model {name!r} (the fleet has: {known})")

    def stable_of(self, m: Model) -> str:
        layer = self.layers.get(m.name)
        if layer is not None and layer.file_stable == m.stable and layer.stable:
            return layer.stable
        return m.stable

    async def start(self, request: RolloutSpec, who: str) -> Rollout:
        """Start a rollout of `request.model` to `request.canary`; its `stable` is ignored:
        the rollout starts from the model's stable version as served now."""
        m = self._model(request.model)
        versions = {v.name: v for v in m.versions}
        if request.canary not in versions:
            raise CommandRejected(
                "NOT_FOUND",
                f"model {m.name} has no version {request.canary!r} (it has: {', '.join(versions)}); "
                "add it with its endpoints to the fleet file first",
            )
        spec = replace(request, stable=self.stable_of(m))
        try:
            spec.check()
        except RolloutRejected as e:
            raise CommandRejected(e.code, str(e)) from None
        current = self.rollouts.get(m.name)
        if active(current) and current is not None:
            raise CommandRejected(
                "FAILED_PRECONDITION",
                f"model {m.name} already has a rollout to {current.spec.canary} ({current.phase}); "
                "abort it or let it finish first",
            )
        drained = {a for a, d in self.drains.items() if d.state == "drained"}
        if all(ep.address in drained for ep in versions[spec.canary].endpoints):
            raise CommandRejected(
                "FAILED_PRECONDITION",
                f"version {spec.canary} of {m.name} has no endpoints in service; undrain some first",
            )
        try:
            r, effects = machine.start(spec, self.clock())
        except RolloutRejected as e:
            raise CommandRejected(e.code, str(e)) from None
        # Both versions back in service, should an earlier rollout have retired either.
        layer = self._layer(m)
        for v in (spec.stable, spec.canary):
            layer = layer.with_version(v, None, 0.0)
        await self._commit(r, effects, who, layer)
        log.info("rollout started", model=m.name, stable=spec.stable, canary=spec.canary, who=who)
        return r

    def _layer(self, m: Model) -> ModelLayer:
        layer = self.layers.get(m.name)
        if layer is None or layer.file_stable != m.stable:
            return ModelLayer(model=m.name, file_stable=m.stable)
        return layer

    async def command(self, model: str, cmd: machine.Command, who: str) -> Rollout:
        """Pause, Resume, Promote or Abort the model's rollout."""
        self._model(model)
        r = self.rollouts.get(model)
        if r is None:
            raise CommandRejected("NOT_FOUND", f"model {model} has no rollout; start one first")
        try:
            new, effects = machine.apply(r, cmd)
        except RolloutRejected as e:
            raise CommandRejected(e.code, str(e)) from None
        if isinstance(cmd, machine.Abort):
            self.metrics.rollouts.aborts.labels(model, "operator").inc()
        await self._commit(new, effects, who)
        return new

    async def undo(self, model: str, who: str) -> Rollout:
        """A new rollout back to the version a completed rollout replaced, with its settings."""
        self._model(model)
        r = self.rollouts.get(model)
        if r is None:
            raise CommandRejected("NOT_FOUND", f"model {model} has no rollout to undo")
        if r.phase != "Completed":
            raise CommandRejected(
                "FAILED_PRECONDITION",
                f"the rollout of {model} is {r.phase}; only a completed rollout can be undone "
                + ("(abort a running one instead)" if active(r) else "(an aborted one left stable serving)"),
            )
        return await self.start(replace(r.spec, canary=r.spec.stable), who)

    async def _commit(
        self, r: Rollout, effects: list[Effect], who: str, layer: ModelLayer | None = None
    ) -> None:
        """Store the rollout with what its effects do to the model's layer; then apply."""
        m = self._model(r.spec.model)
        layer = layer or self._layer(m)
        now = self.clock()
        for e in effects:
            if isinstance(e, SetStable):
                layer = replace(layer, stable=e.version)
            elif isinstance(e, machine.Leave):
                layer = layer.with_version(e.version, "leaving", now)
            elif isinstance(e, machine.Return):
                layer = layer.with_version(e.version, None, now)
            elif isinstance(e, machine.Drain):
                # Routes move off it first; its endpoints go DRAINING only once no proxy's
                # routes name it (otherwise a proxy could route to a cluster whose endpoints
                # all refuse new requests: a 503).
                layer = layer.with_version(e.version, "leaving", now)
        transitions = [e for e in effects if isinstance(e, Transition)]
        await self._write(who, transitions, rollouts=[r], layers=[layer])
        self.rollouts[r.spec.model] = r
        self.layers[m.name] = layer
        self.inconclusive.pop(m.name, None)  # said of the rollout as it was: the next tick says anew
        self._count(transitions)
        for t in transitions:
            log.info(
                "rollout transition",
                model=t.model,
                phase=t.phase,
                step=t.step + 1,
                weight=t.weight,
                reason=t.reason,
                who=who,
            )
        self.publish()

    def _count(self, transitions: list[Transition]) -> None:
        for t in transitions:
            self.metrics.rollouts.transitions.labels(t.model, t.phase).inc()

    async def history(self, model: str) -> list[AuditRecord]:
        self._model(model)
        return await self.store.history(model)

    # ---- endpoint drains (drain/controller.py decides; the state is stored here) -----------

    async def save_drain(self, who: str, audit: Transition, drain: EndpointDrain) -> None:
        """Store a drain (new, or now drained) with its audit record, then serve it."""
        await self._write(who, [audit], drains=[drain])
        self.drains[drain.address] = drain
        self.publish()

    async def drop_drain(self, who: str, audit: Transition, address: str) -> None:
        """Store that an endpoint is no longer drained, with its audit record, then serve it."""
        await self._write(who, [audit], drop_drains=[address])
        del self.drains[address]
        self.publish()

    # ---- ticks ------------------------------------------------------------------------------

    def analysed_endpoints(self) -> set[EndpointKey]:
        """The endpoints whose load reports running rollouts' analysis reads (both versions)."""
        fleet = self.file_fleet
        if fleet is None:
            return set()
        out: set[EndpointKey] = set()
        for m in fleet.models:
            r = self.rollouts.get(m.name)
            if r is None or not active(r):
                continue
            for v in m.versions:
                if v.name in (r.spec.stable, r.spec.canary):
                    out.update((m.name, ep.address) for ep in v.endpoints)
        return out

    def _counters(self, model: str, addresses: list[str]) -> dict[str, EndpointCounters]:
        out = {a: self.signals.counters((model, a)) for a in addresses}
        if self.peer_reports is not None:
            out = {a: with_peer_reports(c, self.peer_reports((model, a))) for a, c in out.items()}
        return out

    def _analyse(self, r: Rollout, now_s: float) -> machine.Analysis | None:
        m = self._model(r.spec.model)
        addrs = {v.name: [ep.address for ep in v.endpoints] for v in m.versions}
        both = addrs.get(r.spec.canary, []) + addrs.get(r.spec.stable, [])
        now = self._counters(m.name, both)
        b = self._baselines.get(m.name)
        if b is None or (b.step, b.step_started_at) != (r.step, r.step_started_at):
            self._baselines[m.name] = _Baseline(r.step, r.step_started_at, now, now_s)
            self.figures.pop(m.name, None)
            self.inconclusive.pop(m.name, None)
            return None
        canary = figures(now, b.counters, addrs.get(r.spec.canary, []))
        stable = figures(now, b.counters, addrs.get(r.spec.stable, []))
        self.figures[m.name] = (canary, stable)
        driving = self._driving_since if self._driving_since is not None else now_s
        watched = max(0.0, now_s - max(b.taken_at, driving + LRS_RECONNECT_S))
        a = analysis(canary, stable, watched)
        running = r.phase == "Progressing" and not r.finishing
        why = machine.inconclusive(r.spec, r.weight, a) if running else None
        if why is None:
            self.inconclusive.pop(m.name, None)
        else:
            self.inconclusive[m.name] = why
        return a

    async def tick(self) -> None:
        """Advance running rollouts and drains by what the proxies and signals say now."""
        if self.file_fleet is None:
            return
        now = self.clock()
        if self._driving_since is None:
            self._driving_since = now
        for model, r in list(self.rollouts.items()):
            if not active(r):
                self.inconclusive.pop(model, None)
                continue
            unacked = self.registry.lacking(cluster_name(model, r.spec.canary)) if r.step < 0 else ()
            a = self._analyse(r, now) if r.step >= 0 else None
            still = (
                self.registry.routing_to(cluster_name(model, r.spec.stable), envoys_only=True)
                if r.finishing
                else ()
            )
            new, effects = machine.apply(r, machine.Tick(now, unacked, a, still))
            if not effects and new == replace(r, reason=new.reason):
                # Only what a holding rollout waits for changed (counts, time left): shown by
                # status at once, not stored, since it changes every tick.
                self.rollouts[model] = new
                continue
            if new != r:
                if new.phase == "Aborted":
                    self.metrics.rollouts.aborts.labels(model, "analysis").inc()
                    log.warning("rollout aborted by analysis", model=model, reason=new.reason)
                await self._commit(new, effects, self.actor)
        for hook in self.tick_hooks:
            await hook(now)
        await self._tick_versions(now)
        self._export()

    def _in_flight(self, model: str, address: str) -> float:
        load = self.signals.load((model, address), 1.0, time.monotonic())
        in_progress = self.signals.lrs_totals((model, address), time.monotonic())[0]
        return in_progress + counted(load.running) + counted(load.waiting)

    def drained_reason(
        self, models: list[str], addresses: list[str], since: float, timeout_s: float, now: float
    ) -> str | None:
        """Why endpoints draining since `since` count as drained now (every proxy has their
        DRAINING state, none has requests in flight, DRAIN_SETTLE_S passed; or the deadline
        passed), or None while they do not."""
        if now - since >= timeout_s:
            return f"the drain deadline ({timeout_s:g}s) passed"
        if now - since < DRAIN_SETTLE_S or not self.registry.all_synced(ENDPOINT):
            return None
        busy = sum(self._in_flight(m, a) for m in models for a in addresses)
        return "no requests in flight" if busy <= 0 else None

    async def _tick_versions(self, now: float) -> None:
        """Versions a rollout left: DRAINING once no route sends to them, then retired once drained."""
        fleet = self.file_fleet
        if fleet is None:
            return
        for m in fleet.models:
            layer = self.layers.get(m.name)
            if layer is None or layer.file_stable != m.stable:
                continue
            r = self.rollouts.get(m.name)
            for version, (state, since) in list(layer.versions.items()):
                if active(r) and r is not None and version in (r.spec.stable, r.spec.canary):
                    continue
                if state == "leaving":
                    if now - since < ROUTES_SETTLE_S:
                        continue
                    routing = self.registry.routing_to(cluster_name(m.name, version))
                    why = f"version {version}: no route sends to it; draining"
                    if routing and now - since < DRAIN_TIMEOUT_S:
                        await self._report_leaving(m.name, version, since, routing, now)
                        continue
                    if routing:
                        why = (
                            f"version {version}: still routed by {', '.join(routing)} after "
                            f"{DRAIN_TIMEOUT_S:g}s; draining anyway"
                        )
                    self._leave_reported.discard((m.name, version))
                    layer = layer.with_version(version, "draining", now)
                    await self._write(
                        self.actor,
                        [Transition(m.name, "Draining", -1, 0, why)],
                        layers=[layer],
                    )
                    self.layers[m.name] = layer
                    self.publish()
                    continue
                if state != "draining":
                    continue
                eps = [ep.address for v in m.versions if v.name == version for ep in v.endpoints]
                drained = self.drained_reason([m.name], eps, since, DRAIN_TIMEOUT_S, now)
                if drained is None:
                    continue
                layer = layer.with_version(version, "retired", now)
                await self._write(
                    self.actor,
                    [
                        Transition(
                            m.name, "Retired", -1, 0, f"version {version} drained and removed: {drained}"
                        )
                    ],
                    layers=[layer],
                )
                self.layers[m.name] = layer
                log.info("version drained and removed", model=m.name, version=version, why=drained)
                self.publish()

    async def _report_leaving(
        self, model: str, version: str, since: float, routing: tuple[str, ...], now: float
    ) -> None:
        """Once per leaving version: say which proxies keep it from draining."""
        if now - since < LEAVE_REPORT_S or (model, version) in self._leave_reported:
            return
        self._leave_reported.add((model, version))
        reason = (
            f"version {version}: proxies still route to it {LEAVE_REPORT_S:g}s after it left: "
            f"{', '.join(routing)}; it drains once they stop, or after {DRAIN_TIMEOUT_S:g}s"
        )
        log.warning("version still routed after leaving", model=model, version=version, proxies=list(routing))
        await self._write(self.actor, [Transition(model, "Leaving", -1, 0, reason)])

    async def run(self) -> None:
        """Tick until cancelled (only while leader), and follow other replicas' changes."""
        follow = asyncio.create_task(self._follow())
        try:
            while True:
                await asyncio.sleep(self.tick_s)
                await self.one_round()
        finally:
            follow.cancel()

    async def one_round(self) -> None:
        """One tick of the loop, while this replica leads: counted (`controlplane_loop_*`,
        loop `rollout`) as ok, or as an error when it raised or could not be stored."""
        loops = self.metrics.loops
        if not self.leader:
            self._driving_since = None  # a new lead waits for the proxies' reports again
            loops.idle(ROLLOUT)  # the leader's loop: nothing to age on a follower
            return
        try:
            if self._reload_first:
                await self.restore()
                self._reload_first = False
            await self.reconcile_file()
            await self.tick()
        except CommandRejected as e:
            log.warning("rollout tick not stored; retrying next tick", reason=str(e))
            loops.failed(ROLLOUT, self.tick_s)
        except Exception:
            log.exception("rollout tick failed; retrying next tick")
            loops.failed(ROLLOUT, self.tick_s)
        else:
            loops.succeeded(ROLLOUT, self.tick_s)

    async def _follow(self) -> None:
        # A store unreachable at start: keep trying until the state is loaded.
        while True:
            try:
                await self.restore()
                break
            except StoreUnavailable:
                await asyncio.sleep(1.0)
        async for _ in self.store.changes():
            try:
                await self.restore()
            except Exception as e:
                log.warning("could not reload the state another replica changed", error=str(e))

    def set_leader(self, leads: bool) -> None:
        """This replica gained or lost the leader lease: only the leader exports the rollout
        and drain series, so a former leader's do not stay frozen beside the new one's. A new
        leader reloads the stored state at its first tick, before it drives anything."""
        if leads and not self.leader:
            self._reload_first = True
        self.leader = leads
        self._export()

    def _export(self) -> None:
        self.series.export(self.file_fleet, self.rollouts, self.drains, self.figures, self.leader)
