"""Which replicas to start, drain and stop to reach the desired count (pure).

A provider (actuators/emulator.py for emulated servers) hands its replicas of one model version
and the desired count each round; `plan` answers what to do, so that scale-down never
drops a request:

- replicas still starting (not ready: no traffic) go first, stopped at once;
- then ready ones are *drained* (EDS DRAINING through the drain machinery: no new requests,
  in-flight ones finish) before they are stopped: servers of GPU classes the model does not
  prefer first, then the least loaded, then the newest;
- a rise while some drain takes them back (undrained) before starting new ones;
- only drained replicas are stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

STARTING, READY, DRAINING, DRAINED = "starting", "ready", "draining", "drained"


@dataclass(frozen=True)
class Replica:
    address: str
    state: str  # STARTING, READY, DRAINING or DRAINED
    load: float = 0.0  # requests running and waiting
    preferred: bool = True  # its GPU class is one the model prefers (or it states no preference)
    started_at: float = 0.0


@dataclass(frozen=True)
class Plan:
    start: int = 0
    stop: tuple[str, ...] = ()  # stopped now: not ready (no traffic) or drained
    drain: tuple[str, ...] = ()
    undrain: tuple[str, ...] = ()


def removal_order(replicas: list[Replica]) -> list[Replica]:
    """Ready replicas in the order they should go: non-preferred GPU classes first, then the
    least loaded, then the newest."""
    return sorted(replicas, key=lambda r: (r.preferred, r.load, -r.started_at, r.address))


def plan(want: int, replicas: list[Replica]) -> Plan:
    """What to do this round to move `replicas` towards `want` serving replicas."""
    want = max(0, want)
    starting = [r for r in replicas if r.state == STARTING]
    ready = [r for r in replicas if r.state == READY]
    draining = [r for r in replicas if r.state == DRAINING]
    drained = tuple(r.address for r in replicas if r.state == DRAINED)
    active = len(starting) + len(ready)
    if want > active:
        back = sorted(draining, key=lambda r: -r.started_at)[: want - active]
        return Plan(start=want - active - len(back), stop=drained, undrain=tuple(r.address for r in back))
    excess = active - want
    stop_now = sorted(starting, key=lambda r: -r.started_at)[:excess]
    excess -= len(stop_now)
    drain = removal_order(ready)[:excess]
    return Plan(stop=drained + tuple(r.address for r in stop_now), drain=tuple(r.address for r in drain))
