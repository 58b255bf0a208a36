"""Pure: which eligible server takes a request, and what the picker knows to decide it.

The control plane decides what is eligible (its EDS assignments: held-out servers are sent
UNHEALTHY, draining ones DRAINING, and the weight is adaptive's view of each server's
speed and load); the picker only orders the eligible servers of the cluster the route chose,
by its load relative to its capacity: (load + 1) / capacity, lowest first, the way Envoy's
weighted least request scores a host but over every proxy's requests instead of one proxy's.
A server's load is what its own page last said (running + waiting, read by the control
plane: every proxy's requests) plus the picks made for it since that reading; without a
reading younger than LOAD_MAX_AGE_S, the requests the picker still sees in flight. Its
capacity is the control plane's (declared or learnt), else the EDS weight. Ties go to the
server with the lower load, then to the one picked least recently, so equal servers take
turns.

Nothing here does I/O; picker/service.py feeds it the assignments and the requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

# Health statuses a server may be picked in: what Envoy's override_host takes by default.
ELIGIBLE = frozenset({health_check_pb2.UNKNOWN, health_check_pb2.HEALTHY})
FALLBACKS = 2  # servers named after the first, for Envoy to walk on retries
LOAD_MAX_AGE_S = 5.0  # a server's page read longer ago than this says nothing of its load now
RECENT_KEEP = 1024  # picks remembered per server (those since its last reading count)


@dataclass(frozen=True)
class ServerLoad:
    """A server's load as its own page said: requests running and waiting, read at `read_at`
    (the picker's monotonic clock), and its capacity as the control plane knows it."""

    queued: float
    read_at: float
    capacity: float | None = None


@dataclass(frozen=True)
class Candidate:
    """One server of a cluster as the control plane last sent it."""

    address: str  # IP:PORT, [IPv6]:PORT
    weight: int
    eligible: bool
    capacity: float | None = None  # the control plane's, where the picker has it

    @property
    def scale(self) -> float:
        """What a load is divided by: the capacity, else the EDS weight."""
        return self.capacity if self.capacity else float(self.weight)


def candidates(cla: endpoint_pb2.ClusterLoadAssignment) -> tuple[Candidate, ...]:
    """A ClusterLoadAssignment's servers, eligible or not, in its order."""
    out = []
    for locality in cla.endpoints:
        for lb in locality.lb_endpoints:
            sock = lb.endpoint.address.socket_address
            host = f"[{sock.address}]" if ":" in sock.address else sock.address
            weight = lb.load_balancing_weight.value if lb.HasField("load_balancing_weight") else 1
            out.append(Candidate(f"{host}:{sock.port_value}", max(1, weight), lb.health_status in ELIGIBLE))
    return tuple(out)


@dataclass
class PickerState:
    """What one picker knows: each cluster's servers, and each server's requests in flight."""

    clusters: dict[str, tuple[Candidate, ...]] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    loads: dict[str, ServerLoad] = field(default_factory=dict)
    _recent: dict[str, deque[float]] = field(default_factory=dict)
    _last_pick: dict[str, int] = field(default_factory=dict)
    _picks: int = 0

    def assign(self, assignments: Iterable[endpoint_pb2.ClusterLoadAssignment]) -> None:
        """The control plane's assignments, whole (state of the world): clusters not in them
        are gone. In-flight counts stay: requests already sent still end."""
        self.clusters = {cla.cluster_name: candidates(cla) for cla in assignments}

    def observe(self, loads: Mapping[str, ServerLoad]) -> None:
        """The servers' loads as the control plane last read them (replacing the previous).
        Picks made before a server's reading are in it: they are forgotten, so a pick only
        ever sums the few made since."""
        self.loads = dict(loads)
        for address, recent in self._recent.items():
            known = self.loads.get(address)
            while recent and known is not None and recent[0] <= known.read_at:
                recent.popleft()

    def load(self, address: str, now: float) -> float:
        """What the picker reckons `address` has to do at `now`: its page's last reading plus
        the picks made for it since; without a fresh reading, the picks still in flight."""
        known = self.loads.get(address)
        if known is not None and now - known.read_at <= LOAD_MAX_AGE_S:
            recent = self._recent.get(address, ())
            return known.queued + sum(1 for t in recent if t > known.read_at)
        return float(self.inflight.get(address, 0))

    def pick(self, cluster: str, now: float = 0.0) -> tuple[str, ...]:
        """The servers to send a request of `cluster` to, best first (the first and up to
        FALLBACKS more), and counts it as picked at `now` on the first; () when the picker
        knows no eligible server there (Envoy then routes by the weights)."""
        servers = [
            Candidate(c.address, c.weight, c.eligible, self._capacity(c))
            for c in self.clusters.get(cluster, ())
        ]
        loads = {c.address: self.load(c.address, now) for c in servers if c.eligible}
        ranked = rank(servers, loads, self._last_pick)
        if not ranked:
            return ()
        chosen = ranked[0]
        self.inflight[chosen] = self.inflight.get(chosen, 0) + 1
        self._recent.setdefault(chosen, deque(maxlen=RECENT_KEEP)).append(now)
        self._picks += 1
        self._last_pick[chosen] = self._picks
        return tuple(ranked[: 1 + FALLBACKS])

    def _capacity(self, c: Candidate) -> float | None:
        known = self.loads.get(c.address)
        return known.capacity if known is not None and known.capacity else None

    def done(self, address: str) -> None:
        """A request picked for `address` ended (answered, failed or cancelled)."""
        left = self.inflight.get(address, 0) - 1
        if left > 0:
            self.inflight[address] = left
        else:
            self.inflight.pop(address, None)


def rank(
    servers: Iterable[Candidate], load: Mapping[str, float], last_pick: Mapping[str, int] | None = None
) -> list[str]:
    """The eligible servers' addresses, best first: lowest (load + 1) / capacity (else
    weight), then lowest load, then picked longest ago (never first)."""
    last = last_pick or {}
    eligible = [s for s in servers if s.eligible]
    eligible.sort(
        key=lambda s: (
            (load.get(s.address, 0) + 1) / s.scale,
            load.get(s.address, 0),
            last.get(s.address, 0),
        )
    )
    return [s.address for s in eligible]
