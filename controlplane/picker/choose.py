"""Pure: which eligible server takes a request, and what the picker knows to decide it.

The control plane decides what is eligible (its EDS assignments: held-out servers are sent
UNHEALTHY, draining ones DRAINING, and the weight is adaptive's view of each server's
speed and load); the picker only orders the eligible servers of the cluster the route chose,
by the requests in flight it knows of, relative to the weight: (in flight + 1) / weight,
lowest first, the way Envoy's weighted least request scores a host but over every proxy's
requests instead of one proxy's. Ties go to the server with fewer in flight, then to the one
picked least recently, so equal servers take turns. (What "in flight" can cover depends on
what Envoy shows the picker of a request's end: see picker/service.py.)

Nothing here does I/O; picker/service.py feeds it the assignments and the requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

# Health statuses a server may be picked in: what Envoy's override_host takes by default.
ELIGIBLE = frozenset({health_check_pb2.UNKNOWN, health_check_pb2.HEALTHY})
FALLBACKS = 2  # servers named after the first, for Envoy to walk on retries


@dataclass(frozen=True)
class Candidate:
    """One server of a cluster as the control plane last sent it."""

    address: str  # IP:PORT, [IPv6]:PORT
    weight: int
    eligible: bool


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
    _last_pick: dict[str, int] = field(default_factory=dict)
    _picks: int = 0

    def assign(self, assignments: Iterable[endpoint_pb2.ClusterLoadAssignment]) -> None:
        """The control plane's assignments, whole (state of the world): clusters not in them
        are gone. In-flight counts stay: requests already sent still end."""
        self.clusters = {cla.cluster_name: candidates(cla) for cla in assignments}

    def pick(self, cluster: str) -> tuple[str, ...]:
        """The servers to send a request of `cluster` to, best first (the first and up to
        FALLBACKS more), and counts it in flight on the first; () when the picker knows no
        eligible server there (Envoy then routes by the weights)."""
        ranked = rank(self.clusters.get(cluster, ()), self.inflight, self._last_pick)
        if not ranked:
            return ()
        chosen = ranked[0]
        self.inflight[chosen] = self.inflight.get(chosen, 0) + 1
        self._picks += 1
        self._last_pick[chosen] = self._picks
        return tuple(ranked[: 1 + FALLBACKS])

    def done(self, address: str) -> None:
        """A request picked for `address` ended (answered, failed or cancelled)."""
        left = self.inflight.get(address, 0) - 1
        if left > 0:
            self.inflight[address] = left
        else:
            self.inflight.pop(address, None)


def rank(
    servers: Iterable[Candidate], inflight: Mapping[str, int], last_pick: Mapping[str, int] | None = None
) -> list[str]:
    """The eligible servers' addresses, best first: lowest (in flight + 1) / weight, then
    fewest in flight, then picked longest ago (never first)."""
    last = last_pick or {}
    eligible = [s for s in servers if s.eligible]
    eligible.sort(
        key=lambda s: (
            (inflight.get(s.address, 0) + 1) / s.weight,
            inflight.get(s.address, 0),
            last.get(s.address, 0),
        )
    )
    return [s.address for s in eligible]
