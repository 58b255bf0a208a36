"""Endpoint drains (I/O shell): drain, undrain, forget, and once a tick, whether a draining
endpoint is drained now.

A drained endpoint leaves every cluster that has it; a draining one stays, marked DRAINING,
so proxies send it no new request while it finishes what it holds. It counts as drained once
every proxy has its endpoints, no request is in flight, and at least a settling time has
passed, or at its deadline whatever it still holds (rollout/controller.py's `drained_reason`,
which the retirement of a version after a rollout applies too). Every change is stored, with
an audit record, before it is applied.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import replace

import structlog

from controlplane.rollout.controller import DRAIN_TIMEOUT_S, CommandRejected, RolloutController
from controlplane.rollout.machine import Transition
from controlplane.rollout.overlay import EndpointDrain

log = structlog.get_logger("controlplane.drain")


class EndpointDrains:
    """Drains of single endpoints, kept in the rollout controller's API state."""

    def __init__(self, rollouts: RolloutController) -> None:
        self.rollouts = rollouts
        rollouts.tick_hooks.append(self.tick)
        # Called with an address as soon as its drain is stored as drained (an actuator stops
        # the server then, not a round later).
        self.on_drained: list[Callable[[str], Awaitable[None]]] = []

    @property
    def drains(self) -> dict[str, EndpointDrain]:
        """Every drain in force, by address (draining or drained)."""
        return self.rollouts.drains

    def endpoint_models(self, address: str) -> list[tuple[str, str]]:
        """(model, version) pairs the address serves in the file."""
        fleet = self.rollouts.file_fleet
        if fleet is None:
            return []
        return [
            (m.name, v.name)
            for m in fleet.models
            for v in m.versions
            for ep in v.endpoints
            if ep.address == address
        ]

    async def drain(self, address: str, timeout_s: float | None, reason: str, who: str) -> EndpointDrain:
        served = self.endpoint_models(address)
        if not served:
            raise CommandRejected(
                "NOT_FOUND",
                f"no endpoint {address!r} in the fleet; `cpctl endpoints list` shows the addresses",
            )
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise CommandRejected(
                "INVALID_ARGUMENT", f"timeout: must be a finite number of seconds > 0, got {timeout_s}"
            )
        current = self.drains.get(address)
        if current is not None:
            return current  # draining already: idempotent
        d = EndpointDrain(
            address,
            "draining",
            self.rollouts.clock(),
            timeout_s or DRAIN_TIMEOUT_S,
            who,
            reason or "drained by operator",
        )
        model = served[0][0]
        await self.rollouts.save_drain(
            who, Transition(model, "Draining", -1, 0, f"endpoint {address}: {d.reason}"), d
        )
        log.info("endpoint draining", address=address, who=who, reason=d.reason)
        return d

    async def undrain(self, address: str, reason: str, who: str) -> None:
        served = self.endpoint_models(address)
        if not served and address not in self.drains:
            raise CommandRejected("NOT_FOUND", f"no endpoint {address!r} in the fleet")
        if address not in self.drains:
            raise CommandRejected("FAILED_PRECONDITION", f"endpoint {address} is not draining or drained")
        model = served[0][0] if served else ""
        why = f"endpoint {address}: {reason or 'undrained by operator'}"
        await self.rollouts.drop_drain(who, Transition(model, "Undrained", -1, 0, why), address)
        log.info("endpoint undrained", address=address, who=who)

    async def forget(self, address: str, why: str, who: str) -> None:
        """The endpoint is gone for good (a provider stopped it): drop its drain record, so an
        endpoint started later at the same address is not born drained."""
        if address not in self.drains:
            return
        served = self.endpoint_models(address)
        model = served[0][0] if served else ""
        await self.rollouts.drop_drain(
            who, Transition(model, "Removed", -1, 0, f"endpoint {address}: {why}"), address
        )

    async def tick(self, now: float) -> None:
        """Mark drained every draining endpoint that is drained now."""
        for address, d in list(self.drains.items()):
            if d.state != "draining":
                continue
            models = [m for m, _ in self.endpoint_models(address)]
            why = self.rollouts.drained_reason(models, [address], d.started_at, d.timeout_s, now)
            if why is None:
                continue
            audit = Transition(
                models[0] if models else "", "Drained", -1, 0, f"endpoint {address} removed: {why}"
            )
            await self.rollouts.save_drain(self.rollouts.actor, audit, replace(d, state="drained"))
            log.info("endpoint drained and removed", address=address, why=why)
            for hook in self.on_drained:
                await hook(address)
