"""One replica among several on etcd (`--store etcd://...`), wired: the shared rollout state,
the fleet in etcd, the load reports and proxies shared with the other replicas, and the
leader election that says which replica drives rollouts and drains."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from controlplane.fleet.errors import FleetConfigInvalid
from controlplane.fleet.model import Fleet
from controlplane.ha.election import LeaderElection
from controlplane.ha.etcd import Etcd, parse_store_url
from controlplane.ha.fleet import EtcdFleetSource
from controlplane.ha.nodes import SharedNodes
from controlplane.ha.reports import SharedReports
from controlplane.ha.state import EtcdStateStore, new_replica_id
from controlplane.signals.store import EndpointKey, SignalStore


class Replica:
    """This replica's etcd connection and what it shares through it."""

    def __init__(
        self,
        url: str,
        replica_id: str,
        on_fleet: Callable[[Fleet], None],
        on_invalid: Callable[[FleetConfigInvalid], None],
        watch_interval_s: float,
    ) -> None:
        self.etcd = Etcd(parse_store_url(url))
        self.id = replica_id or new_replica_id()
        self.actor = f"controller@{self.id}"  # who the audit trail names for this replica's moves
        self.state = EtcdStateStore(self.etcd, self.id)
        self.fleet = EtcdFleetSource(self.etcd, on_fleet, on_invalid, watch_interval_s)
        self.reports: SharedReports | None = None
        self.nodes: SharedNodes | None = None
        self.election: LeaderElection | None = None

    def share(
        self,
        signals: SignalStore,
        analysed: Callable[[], set[EndpointKey]],
        local_nodes: Callable[[], Iterable[str]],
        leader_ttl_s: int,
        on_leadership: Callable[[bool], None],
        on_store: Callable[[bool], None],
    ) -> None:
        """Share with the other replicas: an Envoy's load reports may reach another replica
        than the leader, and its xDS stream may be held by any of them."""
        self.reports = SharedReports(self.etcd, self.id, signals, analysed)
        self.nodes = SharedNodes(self.etcd, self.id, local_nodes)
        self.election = LeaderElection(
            self.etcd, self.id, leader_ttl_s, on_change=on_leadership, on_store=on_store
        )

    def holds(self, node_id: str) -> bool:
        """Whether another replica holds an xDS stream of this node."""
        return self.nodes is not None and self.nodes.holds(node_id)

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        """The background loops of what is shared (run until cancelled)."""
        return [x.run() for x in (self.election, self.reports, self.nodes) if x is not None]
