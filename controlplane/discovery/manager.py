"""Discovery's shell: one task per discovered version, and the fleet with what they found.

Every version with `discover:` gets a task that asks its source (DNS now and again at the
records' TTL; Kubernetes by list and watch) and folds each answer into a `SourceState`
(state.py: a failing source never empties a version). `augment(fleet)` gives the file's
fleet with each such version's endpoints filled in, so discovered servers take the same path
as listed ones: probes, readiness, slow start, weights, memory fit, rollouts, drains.

A server that leaves its source (its name no longer resolves to it, its pod is gone) is not
dropped: it stays in the fleet and is drained (EDS DRAINING: no new requests, in-flight ones
finish) through the rollout controller's drains, and leaves the fleet once drained. A
terminating pod (serving, not ready) is drained the same way while it is still listed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from controlplane.discovery.dns import DnsFailure, resolve, resolver_for
from controlplane.discovery.source import SourceKey
from controlplane.discovery.state import Found, SourceState
from controlplane.drain.controller import EndpointDrains
from controlplane.fleet.model import Discover, Endpoint, Fleet, Model
from controlplane.obs.metrics import DISCOVERY, Metrics
from controlplane.rollout.controller import CommandRejected

log = structlog.get_logger("controlplane.discovery")

WHO = "discovery"


@dataclass
class _Leaving:
    model: str
    version: str
    endpoint: Endpoint
    why: str


class Discovery:
    """Runs the sources of the fleet's discovered versions; merges what they found."""

    def __init__(
        self,
        drains: EndpointDrains,
        metrics: Metrics,
        on_change: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.drains = drains
        self.metrics = metrics
        self.on_change = on_change
        self.clock = clock
        self.fleet: Fleet | None = None  # the file's fleet
        self.states: dict[SourceKey, SourceState] = {}
        self._tasks: dict[SourceKey, tuple[Discover, asyncio.Task[None]]] = {}
        self.leaving: dict[str, _Leaving] = {}  # address -> gone from its source, draining
        self._drained_by_us: set[str] = set()
        self._exported: set[SourceKey] = set()
        self.status: tuple[dict[str, object], ...] = ()  # for /debug/discovery

    # ---- the fleet

    def augment(self, fleet: Fleet) -> Fleet:
        """The file's fleet with every discovered version's endpoints filled in."""
        self.fleet = fleet
        self._reconcile_tasks(fleet)
        if not any(v.discover for m in fleet.models for v in m.versions):
            return fleet
        taken = {ep.address for m in fleet.models for v in m.versions for ep in v.endpoints}
        models = []
        for m in fleet.models:
            versions = []
            for v in m.versions:
                if v.discover is None:
                    versions.append(v)
                    continue
                eps: list[Endpoint] = []
                state = self.states.get((m.name, v.name))
                for f in state.known or () if state is not None else ():
                    if f.address in taken:
                        continue  # another version (or the file) has it: first one wins
                    taken.add(f.address)
                    eps.append(_endpoint(v.discover, f))
                for address, lv in self.leaving.items():
                    if (lv.model, lv.version) == (m.name, v.name) and address not in taken:
                        taken.add(address)
                        eps.append(lv.endpoint)
                versions.append(dataclasses.replace(v, endpoints=tuple(eps)))
            models.append(dataclasses.replace(m, versions=tuple(versions)))
        return dataclasses.replace(fleet, models=tuple(models))

    def source_of(self, model: str, version: str, address: str) -> tuple[str, float | None]:
        """(source, seconds since it last named the endpoint) for status: ("file", None) for
        listed endpoints."""
        fleet = self.fleet
        d = _discover_of(fleet, (model, version)) if fleet is not None else None
        if d is None:
            return "file", None
        state = self.states.get((model, version))
        seen = state.seen_at.get(address) if state is not None else None  # only known addresses
        if state is not None and seen is not None:
            kept = f" (kept: the source fails: {state.error})" if state.error else ""
            return d.source() + kept, self.clock() - seen
        lv = self.leaving.get(address)
        if lv is not None and (lv.model, lv.version) == (model, version):
            return f"{d.source()} (gone: {lv.why})", None
        return "file", None

    # ---- the sources

    def _reconcile_tasks(self, fleet: Fleet) -> None:
        wanted = {(m.name, v.name): v.discover for m in fleet.models for v in m.versions if v.discover}
        for key, (d, task) in list(self._tasks.items()):
            if wanted.get(key) != d:
                task.cancel()
                del self._tasks[key]
        for key in [k for k in self.states if k not in wanted]:
            del self.states[key]
        for key, d in wanted.items():
            if key in self._tasks:
                continue
            if key not in self.states or self.states[key].source != d.source():
                self.states[key] = SourceState(d.source())
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop (explain, check-config): nothing is discovered
            self._tasks[key] = (d, loop.create_task(self._run_source(key, d)))

    async def _run_source(self, key: SourceKey, d: Discover) -> None:
        if d.kind == "kubernetes":
            from controlplane.discovery.kubernetes import watch_source  # only where it is used

            await watch_source(self, key, d)
            return
        while True:
            fleet = self.fleet
            if fleet is None:
                return
            settings = fleet.discovery
            try:
                answer = await resolve(d, settings, resolver_for(settings))
            except DnsFailure as e:
                self.failed(key, str(e))
                wait = settings.dns_min_interval_s
            except Exception as e:  # a resolver error not foreseen: said, and asked again
                log.exception("dns discovery failed unexpectedly", model=key[0], version=key[1])
                self.failed(key, f"{type(e).__name__}: {e}")
                wait = settings.dns_min_interval_s
            else:
                hold = min(max(answer.ttl, settings.dns_min_interval_s), settings.dns_max_interval_s)
                self.answered(key, answer.found, hold_empty_s=hold)
                wait = hold
            await asyncio.sleep(wait)

    def answered(self, key: SourceKey, found: tuple[Found, ...], hold_empty_s: float) -> None:
        """A source's definite answer: fold it in; the fleet changes if the set did."""
        state = self.states.get(key)
        if state is None:
            return
        before = {f.address: f for f in state.known or ()}
        was_error = state.error
        if state.answer(found, self.clock(), hold_empty_s):
            now_known = {f.address for f in state.known or ()}
            for address, f in before.items():
                if address not in now_known:
                    self._leave(key, f, "no longer in its source")
            for address in now_known:
                self.leaving.pop(address, None)  # came back: the step undrains it
            log.info(
                "discovered endpoints changed",
                model=key[0],
                version=key[1],
                source=state.source,
                endpoints=sorted(now_known),
            )
            self.on_change()
        if state.error and state.error != was_error:
            log.warning(
                "discovery keeps the last known endpoints",
                model=key[0],
                version=key[1],
                source=state.source,
                why=state.error,
            )
        elif was_error and not state.error:
            log.info("discovery source answers again", model=key[0], version=key[1], source=state.source)
        self._export(key)

    def failed(self, key: SourceKey, why: str) -> None:
        """No answer to trust: the last known set stands; said once per change of reason."""
        state = self.states.get(key)
        if state is None:
            return
        first = state.error != why
        state.failed(why)
        self.metrics.discovery.failures.labels(key[0], key[1]).inc()
        if first:
            log.warning(
                "discovery source failing; the last known endpoints stay",
                model=key[0],
                version=key[1],
                source=state.source,
                error=why,
                kept=len(state.known or ()),
            )
        self._export(key)

    def _leave(self, key: SourceKey, f: Found, why: str) -> None:
        fleet = self.fleet
        d = _discover_of(fleet, key) if fleet is not None else None
        if d is None:
            return
        self.leaving[f.address] = _Leaving(key[0], key[1], _endpoint(d, f), why)

    def _publish_status(self) -> None:
        """`status` for /debug/discovery, replaced whole (the status server reads it from its
        own thread)."""
        now = self.clock()
        self.status = tuple(
            {
                "model": model,
                "version": version,
                "source": st.source,
                "healthy": st.healthy,
                "error": st.error,
                "failures": st.failures,
                "last_answer_age_s": round(now - st.last_ok, 3) if st.last_ok is not None else None,
                "endpoints": [
                    f.address + (" (terminating)" if f.terminating else "") for f in st.known or ()
                ],
                "leaving": sorted(
                    a for a, lv in self.leaving.items() if (lv.model, lv.version) == (model, version)
                ),
            }
            for (model, version), st in sorted(self.states.items())
        )

    def _export(self, key: SourceKey) -> None:
        self._publish_status()
        state = self.states.get(key)
        if state is None:
            return
        m = self.metrics.discovery
        m.endpoints.labels(key[0], key[1]).set(len(state.known or ()))
        m.healthy.labels(key[0], key[1]).set(1 if state.healthy else 0)
        self._exported.add(key)

    # ---- drains of servers that left (or are terminating)

    async def one_round(self, interval_s: float) -> None:
        """`step`, logged and counted (`controlplane_loop_*`, loop `discovery`): a round that
        raises is an error, and the next one tries again."""
        try:
            await self.step()
        except Exception:
            log.exception("discovery round failed; will retry")
            self.metrics.loops.failed(DISCOVERY, interval_s)
        else:
            self.metrics.loops.succeeded(DISCOVERY, interval_s)

    async def step(self) -> None:
        """Drain what left its source (and terminating pods); drop what is drained."""
        fleet = self.fleet
        if fleet is None:
            return
        dm = self.metrics.discovery
        for key in [k for k in self._exported if k not in self.states]:
            for g in (dm.endpoints, dm.healthy, dm.failures):
                with contextlib.suppress(KeyError):
                    g.remove(*key)
            self._exported.discard(key)
        models = {m.name: m for m in fleet.models}
        to_drain: dict[str, tuple[Model, str]] = {}
        for address, lv in self.leaving.items():
            if lv.model in models:
                to_drain[address] = (models[lv.model], f"left discovery: {lv.why}")
        for (model, _), state in self.states.items():
            for f in state.known or ():
                if f.terminating and model in models:
                    to_drain[f.address] = (models[model], f"terminating: {f.origin}")
        changed = False
        for address, (m, why) in to_drain.items():
            drain = self.drains.drains.get(address)
            if drain is None:
                timeout = fleet.traffic_of(m).timeout_s
                with contextlib.suppress(CommandRejected):
                    await self.drains.drain(address, timeout, why, WHO)
                    self._drained_by_us.add(address)
            elif drain.state == "drained" and address in self.leaving:
                del self.leaving[address]
                with contextlib.suppress(CommandRejected):
                    await self.drains.forget(address, "gone from its discovery source", WHO)
                self._drained_by_us.discard(address)
                log.info("discovered endpoint drained and removed", model=m.name, address=address)
                changed = True
        # A server that came back (listed again, ready again) is taken back.
        for address in [a for a in self._drained_by_us if a not in to_drain]:
            self._drained_by_us.discard(address)
            if address in self.drains.drains:
                with contextlib.suppress(CommandRejected):
                    await self.drains.undrain(address, "back in its discovery source", WHO)
        if changed:
            self.on_change()

    def close(self) -> None:
        for _, task in self._tasks.values():
            task.cancel()
        self._tasks.clear()


def _discover_of(fleet: Fleet, key: SourceKey) -> Discover | None:
    for m in fleet.models:
        if m.name == key[0]:
            for v in m.versions:
                if v.name == key[1]:
                    return v.discover
    return None


def _endpoint(d: Discover, f: Found) -> Endpoint:
    """A found server as the file would list it: the source's facts over the version's."""
    t = d.template or Endpoint(host="", port=0)
    capacity = f.capacity if f.capacity is not None and math.isfinite(f.capacity) else t.capacity
    return Endpoint(
        host=f.host,
        port=f.port,
        gpu=f.gpu or t.gpu,
        gpu_memory_gb=f.gpu_memory_gb if f.gpu_memory_gb is not None else t.gpu_memory_gb,
        capacity=capacity,
        zone=f.zone or t.zone,
        region=t.region,
    )
