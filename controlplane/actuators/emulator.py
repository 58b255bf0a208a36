"""The `emulator` provider: the control plane starts and stops emulated servers itself,
following each model's desired replicas (fleet-level `autoscaling: {provider: emulator}`).

For the demo and the tests: autoscaling seen end to end on one machine. Every model's
stable version gets `controlplane emulate` processes (with the configured cold start) on
top of the endpoints the file lists, which count as fixed capacity and are never stopped.
Each round (1 s) `autoscaling/scale_down.plan` says what to do: a new server starts cold and
joins the fleet once its /health says ready (as a readiness probe gates a pod); one to
remove is drained first through the drain machinery (EDS DRAINING, in-flight requests
finish) and stopped only once drained, so a scale-down drops no request. Single replica
only: with several replicas every one would start its own servers, so the provider does not
run under --store.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from controlplane.autoscaling.autoscaler import MODEL, Autoscaler
from controlplane.autoscaling.scale_down import DRAINED, DRAINING, READY, STARTING, Replica, plan
from controlplane.drain.controller import EndpointDrains
from controlplane.fleet.model import Endpoint, Fleet
from controlplane.rollout.controller import CommandRejected
from controlplane.signals.store import SignalStore
from controlplane.sim.ports import free_port
from controlplane.sim.procs import die_with_parent

log = structlog.get_logger("controlplane.provider")

WHO = "autoscaler"


@dataclass
class _Server:
    model: str
    address: str
    proc: subprocess.Popen[bytes]
    started_at: float
    listening: bool = False  # in the fleet only once its /health says it is ready


class EmulatorProvider:
    def __init__(
        self,
        drains: EndpointDrains,
        autoscaler: Autoscaler,
        store: SignalStore,
        on_change: Callable[[], None],
        log_dir: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.drains = drains
        drains.on_drained.append(self._drained)
        self.autoscaler = autoscaler
        self.store = store
        self.on_change = on_change
        self.log_dir = log_dir
        self.clock = clock
        self.servers: dict[str, _Server] = {}  # by address
        self.fleet: Fleet | None = None  # the file's fleet (without the servers started here)
        self._watches: set[asyncio.Task[None]] = set()

    def active(self) -> bool:
        return self.fleet is not None and self.fleet.autoscaling.provider == "emulator"

    def augment(self, fleet: Fleet) -> Fleet:
        """The file's fleet with the servers started here added to their model's stable version."""
        self.fleet = fleet
        if not self.servers:
            return fleet
        models = []
        for m in fleet.models:
            mine = [s for s in self.servers.values() if s.model == m.name and s.listening]
            if not mine:
                models.append(m)
                continue
            versions = tuple(
                replace(v, endpoints=(*v.endpoints, *(_endpoint(s.address) for s in mine)))
                if v.name == m.stable
                else v
                for v in m.versions
            )
            models.append(replace(m, versions=versions))
        return replace(fleet, models=tuple(models))

    def _replicas(self, model: str) -> list[Replica]:
        out = []
        for s in self.servers.values():
            if s.model != model:
                continue
            drain = self.drains.drains.get(s.address)
            sig = self.store.endpoints.get((model, s.address))
            sample = sig.sample if sig is not None else None
            load = (sample.running or 0.0) + (sample.waiting or 0.0) if sample is not None else 0.0
            if drain is not None:
                state = DRAINED if drain.state == "drained" else DRAINING
            else:
                state = READY if sig is not None and sig.ready is True else STARTING
            out.append(Replica(s.address, state, load, True, s.started_at))
        return out

    async def step(self) -> None:
        """One round: every model towards its desired replicas."""
        fleet = self.fleet
        if fleet is None or not self.active():
            return
        changed = False
        for m in fleet.models:
            d = self.autoscaler.decisions.get((m.name, MODEL))
            if d is None:
                continue
            fixed = len(m.version(m.stable).endpoints)
            want = max(0, d.desired - fixed)
            p = plan(want, self._replicas(m.name))
            for _ in range(p.start):
                self._start(fleet, m.name)
                changed = True
            for address in p.undrain:
                with contextlib.suppress(CommandRejected):
                    await self.drains.undrain(address, f"scale up: {d.desired} wanted", WHO)
            for address in p.drain:
                timeout = fleet.traffic_of(m).timeout_s
                with contextlib.suppress(CommandRejected):
                    await self.drains.drain(address, timeout, f"scale down: {d.desired} wanted", WHO)
            for address in p.stop:
                await self._stop(address, f"scale down: {d.desired} wanted")
                changed = True
        for address in [a for a, s in self.servers.items() if s.proc.poll() is not None]:
            log.warning("emulated server exited", address=address, code=self.servers[address].proc.returncode)
            await self._stop(address, "exited")
            changed = True
        if changed:
            self.on_change()

    async def _drained(self, address: str) -> None:
        """A server of ours is drained: stop it now (the next round's plan would stop it too,
        a round later), so a scale-down frees its GPU as soon as nothing runs on it."""
        if address in self.servers and self.active():
            await self._stop(address, "scale down: drained")
            self.on_change()

    def _start(self, fleet: Fleet, model: str) -> None:
        e = fleet.autoscaling.emulator
        address = f"127.0.0.1:{free_port()}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = (
            self.log_dir / f"emulated-{model.replace('/', '_')}-{address.rsplit(':', 1)[1]}.log"
        ).open("ab")
        args = [sys.executable, "-m", "controlplane", "emulate", "--listen", address, "--model", model]
        args += ["--cold-start", f"{e.cold_start_s:g}", "--slots", str(e.slots)]
        args += ["--decode-ms-per-token", f"{e.decode_ms_per_token:g}", "--speed", f"{e.speed:g}"]
        args += ["--log-format", "json"]
        proc = subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),
        )
        log_file.close()
        server = self.servers[address] = _Server(model, address, proc, self.clock())
        self._watches.add(asyncio.get_running_loop().create_task(self._join_when_listening(server)))
        log.info("emulated server started", model=model, address=address, cold_start_s=e.cold_start_s)

    async def _join_when_listening(self, server: _Server) -> None:
        """Add the server to the fleet once its /health says it is ready, as a Kubernetes
        readiness probe gates a pod's endpoint: a server added while loading would get the
        benefit of the doubt where it is its model's only one."""
        try:
            while self.servers.get(server.address) is server and server.proc.poll() is None:
                if await _ready(server.address):
                    server.listening = True
                    self.autoscaler.forecaster.cold_starts.observe(
                        server.model, self.clock() - server.started_at
                    )
                    self.on_change()
                    return
                await asyncio.sleep(0.1)
        finally:
            self._watches.discard(asyncio.current_task())

    async def _stop(self, address: str, why: str) -> None:
        s = self.servers.pop(address)
        if s.proc.poll() is None:
            s.proc.terminate()
            try:
                s.proc.wait(5)
            except subprocess.TimeoutExpired:
                s.proc.kill()
        with contextlib.suppress(CommandRejected):
            await self.drains.forget(address, f"stopped ({why})", WHO)
        log.info("emulated server stopped", model=s.model, address=address, why=why)

    def close(self) -> None:
        for task in self._watches:
            task.cancel()
        for s in self.servers.values():
            if s.proc.poll() is None:
                s.proc.terminate()
        for s in self.servers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.proc.wait(5)
        self.servers.clear()


async def _ready(address: str) -> bool:
    """Whether GET /health answers 200."""
    host, _, port = address.rpartition(":")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 0.2)
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(f"GET /health HTTP/1.0\r\nHost: {address}\r\n\r\n".encode())
        status = await asyncio.wait_for(reader.readline(), 0.5)
        return status.split()[1:2] == [b"200"]
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


def _endpoint(address: str) -> Endpoint:
    host, _, port = address.rpartition(":")
    return Endpoint(host=host, port=int(port))
