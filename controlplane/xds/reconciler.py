"""The reconcile loop: fleet and weights in, at most one snapshot per debounce window out."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping

import structlog

from controlplane.fleet.model import Fleet
from controlplane.hold.policy import can_hold, candidate_servers, ready_servers
from controlplane.obs.metrics import Metrics
from controlplane.resources.names import cluster_name
from controlplane.resources.types import TYPE_URLS, type_label
from controlplane.routing.incremental import IncrementalTranslator
from controlplane.routing.translate import NO_OVERLAY, RoutingOverlay
from controlplane.xds.cache import SnapshotCache
from controlplane.xds.snapshot import SERIALISED, Lingering, Snapshot, build_snapshot

log = structlog.get_logger("controlplane.reconcile")


class Reconciler:
    """Turns 'something changed' into at most one new snapshot per debounce window.

    The window is trailing: a snapshot is built once no change has arrived for
    `debounce_s`, but never later than `max_delay_s` after the first change of a burst,
    so a steady stream of changes (weights every second) still gets published.
    """

    def __init__(
        self,
        cache: SnapshotCache,
        metrics: Metrics,
        debounce_s: float = 0.1,
        max_delay_s: float = 1.0,
    ) -> None:
        self.cache = cache
        self.metrics = metrics
        self.debounce_s = debounce_s
        self.max_delay_s = max(max_delay_s, debounce_s)
        self.fleet: Fleet | None = None
        self.weights: dict[str, Mapping[str, int]] = {}
        self.shed: dict[str, frozenset[str]] = {}
        self.overlay: RoutingOverlay = NO_OVERLAY
        self.translator = IncrementalTranslator()
        # Holding (hold/): where proxies reach the holding service (None: off), and per model
        # the servers its requests may go to, as of the last snapshot built.
        self.hold_address: str | None = None
        self.ready: Mapping[str, tuple[tuple[str, int], ...]] = {}
        self.candidates: Mapping[str, tuple[tuple[str, int], ...]] = {}  # of the holding models
        # Clusters a restarted server remembers (xds/memory.py): the first snapshot lingers them.
        self.lingering_seed: Mapping[str, Lingering] = {}
        # Called with a new snapshot before any stream sees it, then after.
        self.before_publish: list[Callable[[Snapshot], None]] = []
        self.on_publish: list[Callable[[Snapshot], None]] = []
        self._dirty = asyncio.Event()
        self._last_change = 0.0
        self._generation = 0
        self._failed: dict[str, str] = {}  # model -> why its resources failed to build, last time

    def _changed(self) -> None:
        self._last_change = time.monotonic()
        self._dirty.set()

    def set_fleet(self, fleet: Fleet) -> None:
        """A new fleet (from the file or the store)."""
        self.fleet = fleet
        # Forget weights and shed classes of clusters and models the fleet no longer has.
        clusters = {cluster_name(m.name, v.name) for m in fleet.models for v in m.versions}
        self.weights = {c: w for c, w in self.weights.items() if c in clusters}
        self.shed = {m.name: self.shed[m.name] for m in fleet.models if m.name in self.shed}
        self._changed()

    def set_weights(self, cluster: str, weights: Mapping[str, int]) -> None:
        """New endpoint weights (by address) for one cluster."""
        self.weights[cluster] = dict(weights)
        self._changed()

    def set_shed(self, model: str, classes: frozenset[str]) -> None:
        """The priority classes shed (answered 429) for one model."""
        if self.shed.get(model, frozenset()) != classes:
            self.shed[model] = classes
            self._changed()

    def set_overlay(self, overlay: RoutingOverlay) -> None:
        """Rollout splits and draining endpoints (from the rollout controller)."""
        if overlay != self.overlay:
            self.overlay = overlay
            self._changed()

    def rebuild_now(self) -> Snapshot | None:
        """Translate and publish now if anything's bytes changed; return the current snapshot."""
        if self.fleet is None:
            return None
        started = time.perf_counter()
        serialised = SERIALISED.value
        overlay = self.overlay
        if self.hold_address is not None:
            fleet = self.fleet
            ready = {m.name: ready_servers(fleet, m, overlay, self.weights) for m in fleet.models}
            holding = frozenset(m.name for m in fleet.models if can_hold(fleet, m) and not ready[m.name])
            overlay = dataclasses.replace(overlay, holding=holding, hold_address=self.hold_address)
            # Each replaced whole, never mutated: the holding service reads them from its thread.
            self.ready = ready
            self.candidates = {
                m.name: candidate_servers(m, overlay) for m in fleet.models if m.name in holding
            }
        desired = self.translator.translate(self.fleet, self.weights, self.shed, overlay)
        self._report_failures(self.translator.failed)
        previous = self.cache.current
        snap = build_snapshot(
            desired,
            self._generation + 1,
            time.monotonic(),
            previous,
            lingering_seed=self.lingering_seed if previous is None else None,
        )
        self.lingering_seed = {}  # only the first snapshot starts from it
        if previous is not None and not any(snap.changes.values()) and snap.wildcard == previous.wildcard:
            return previous
        self._generation += 1
        for hook in self.before_publish:
            hook(snap)
        self.cache.publish(snap)
        self.metrics.serialisations.inc(SERIALISED.value - serialised)
        self.metrics.snapshot_build.observe(time.perf_counter() - started)
        self.metrics.snapshot_generation.set(snap.generation)
        for type_url in TYPE_URLS:
            self.metrics.snapshot_resources.labels(type_label(type_url)).set(snap.count(type_url))
        for hook in self.on_publish:
            hook(snap)
        log.info(
            "snapshot published",
            generation=snap.generation,
            changed={type_label(t): len(n) for t, n in snap.changes.items() if n},
            **{type_label(t): snap.count(t) for t in TYPE_URLS},
        )
        return snap

    def _report_failures(self, failed: Mapping[str, str]) -> None:
        """Count every failed model build; log when which models fail, or why, changes."""
        for model in failed:
            self.metrics.model_build_errors.labels(model).inc()
        if dict(failed) != self._failed:
            for model, why in failed.items():
                if self._failed.get(model) != why:
                    log.error(
                        "a model's resources failed to build; its last good ones stay", model=model, error=why
                    )
            for model in self._failed.keys() - failed.keys():
                log.info("a model's resources build again", model=model)
            self._failed = dict(failed)

    async def run(self) -> None:
        """Debounce changes into snapshots until cancelled."""
        while True:
            await self._dirty.wait()
            first = self._last_change
            while True:
                now = time.monotonic()
                quiet_at = self._last_change + self.debounce_s
                deadline = first + self.max_delay_s
                if now >= quiet_at or now >= deadline:
                    break
                await asyncio.sleep(min(quiet_at, deadline) - now)
            self._dirty.clear()
            try:
                self.rebuild_now()
            except Exception:
                log.exception("snapshot build failed; still serving the previous snapshot")
