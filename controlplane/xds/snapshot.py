"""Versioned snapshots: every resource serialised once, with a content hash as its version."""

from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf.message import Message

from controlplane.resources.types import CLUSTER, ENDPOINT, LISTENER, ROUTE
from controlplane.routing.clusters import empty_assignment
from controlplane.routing.translate import (
    DesiredResources,
    cluster_refs,
    rds_names,
)
from controlplane.xds import capabilities, wire


@dataclass(frozen=True)
class SnapshotResource:
    """One resource, serialised once: its Any bytes and both response encodings."""

    name: str
    type_url: str
    version: str
    sotw_field: bytes
    delta_field: bytes
    # Clusters this resource sends traffic to (routes); make-before-break waits on them.
    refs: frozenset[str] = frozenset()
    # Route configurations this resource asks for over RDS (listeners).
    routes: frozenset[str] = frozenset()
    # Features some Envoy versions lack (capabilities.Feature.key): adapted for those proxies.
    needs: frozenset[str] = frozenset()
    # A cluster whose endpoints come with it (STATIC, DNS), not over EDS: ready once ACKed.
    self_contained: bool = False
    # The message it was built from: the same object next time means the same bytes.
    message: Message | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Placeholder(SnapshotResource):
    """A resource a proxy holds (from an earlier stream, or kept) whose content we do not
    have: kept, never sent."""

    @classmethod
    def of(cls, type_url: str, name: str, version: str) -> Placeholder:
        return cls(name=name, type_url=type_url, version=version, sotw_field=b"", delta_field=b"")


@functools.lru_cache(maxsize=1 << 16)
def pair_hash(name: str, version: str) -> int:
    """A 64-bit hash of (name, version): XORed over what a proxy holds, its state version."""
    return int.from_bytes(hashlib.blake2b(f"{name}\0{version}".encode(), digest_size=8).digest(), "big")


def content_version(data: bytes) -> str:
    """A short, stable hash of serialised bytes: equal bytes, equal version on every replica."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class _Counter:
    """Resources serialised so far in this process (exported as a metric; tests read it)."""

    value = 0


SERIALISED = _Counter()


def encode_resource(type_url: str, name: str, msg: Message) -> SnapshotResource:
    """Serialise a message once into both wire encodings."""
    SERIALISED.value += 1
    name = sys.intern(name)  # streams intern the names they subscribe to: one string each
    value = msg.SerializeToString(deterministic=True)
    version = content_version(value)
    payload = wire.any_bytes(type_url, value)
    return SnapshotResource(
        name=name,
        type_url=type_url,
        version=version,
        sotw_field=wire.sotw_resource_field(payload),
        delta_field=wire.delta_resource_field(name, version, payload),
        refs=cluster_refs(msg) if type_url == ROUTE else frozenset(),
        routes=rds_names(msg) if type_url == LISTENER else frozenset(),
        needs=capabilities.needs(type_url, msg) if type_url in (CLUSTER, LISTENER) else frozenset(),
        self_contained=type_url == CLUSTER and _self_contained(msg),
        message=msg,
    )


def _self_contained(msg: Message) -> bool:
    """A Cluster that is not fed by EDS."""
    assert isinstance(msg, cluster_pb2.Cluster)
    return msg.type != cluster_pb2.Cluster.EDS and not msg.HasField("cluster_type")


@functools.lru_cache(maxsize=4096)
def _empty_assignment_resource(name: str) -> SnapshotResource:
    """Empty assignments are encoded once per name, not once per stream that asks."""
    return encode_resource(ENDPOINT, name, empty_assignment(name))


@dataclass(frozen=True)
class Lingering:
    """A cluster that left the fleet: the last assignment it had. A proxy that comes back (a
    reconnect) may still route to it, and gets this rather than an empty assignment."""

    assignment: SnapshotResource
    since: float
    # Its last definition (None when restored from the memory file, which holds that).
    cluster: SnapshotResource | None = None


DEFAULT_LINGER_S = 600.0


@dataclass(frozen=True)
class Snapshot:
    """The complete desired state at one moment, shared read-only by every stream."""

    generation: int
    created_at: float
    resources: Mapping[str, Mapping[str, SnapshotResource]]
    # Per type, the names a wildcard subscription gets (build_snapshot fills every type).
    wildcard: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # Per type, names added, changed or removed since the snapshot `parent` (None: unknown).
    changes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    parent: int | None = None
    # Clusters removed within the linger window (name -> last cluster and assignment).
    lingering: Mapping[str, Lingering] = field(default_factory=dict)
    _versions: dict[str, dict[str, str]] = field(default_factory=dict, compare=False, repr=False)

    def versions(self, type_url: str, held: Mapping[str, SnapshotResource]) -> dict[str, str]:
        """name -> version of `held`; one shared dict when `held` is this snapshot's whole type."""
        if held is self.resources.get(type_url):
            cached = self._versions.get(type_url)
            if cached is None:
                cached = self._versions[type_url] = {n: r.version for n, r in held.items()}
            return cached
        return {n: r.version for n, r in held.items()}

    def get(self, type_url: str, name: str) -> SnapshotResource | None:
        """The named resource, or for EDS the last assignment of a lingering cluster, else an
        empty one (only a name that never had data gets that), or None."""
        res = self.resources.get(type_url, {}).get(name)
        if res is None and type_url == ENDPOINT:
            gone = self.lingering.get(name)
            return gone.assignment if gone is not None else _empty_assignment_resource(name)
        return res

    def wildcard_names(self, type_url: str) -> frozenset[str]:
        """What a wildcard subscription to this type receives."""
        return self.wildcard.get(type_url, frozenset())

    def count(self, type_url: str) -> int:
        return len(self.resources.get(type_url, {}))


def build_snapshot(
    desired: DesiredResources,
    generation: int,
    created_at: float,
    previous: Snapshot | None = None,
    linger_s: float = DEFAULT_LINGER_S,
    lingering_seed: Mapping[str, Lingering] | None = None,
) -> Snapshot:
    """Serialise desired resources; reuse the previous snapshot's objects for unchanged input.

    A message object seen in the previous snapshot is not serialised again; an equal
    serialisation reuses the previous resource object too. The first snapshot of a process
    starts lingering with `lingering_seed` (what a restarted server remembered).
    """
    resources: dict[str, dict[str, SnapshotResource]] = {}
    changes: dict[str, frozenset[str]] = {}
    for type_url, by_name in desired.by_type.items():
        prev = previous.resources.get(type_url, {}) if previous else {}
        out: dict[str, SnapshotResource] = {}
        changed: set[str] = set()
        for name, msg in by_name.items():
            old = prev.get(name)
            if old is not None and old.message is msg:
                out[name] = old
                continue
            res = encode_resource(type_url, name, msg)
            if old is not None and old.version == res.version:
                res = old
            else:
                changed.add(name)
            out[name] = res
        changed.update(n for n in prev if n not in out)
        resources[type_url] = out
        changes[type_url] = frozenset(changed)
    wildcard = {t: frozenset(r) for t, r in resources.items()}
    wildcard.update(desired.wildcard)
    return Snapshot(
        generation=generation,
        created_at=created_at,
        resources=resources,
        wildcard=wildcard,
        changes=changes if previous is not None else {},
        parent=previous.generation if previous is not None else None,
        lingering=(
            _lingering(previous, resources, changes.get(CLUSTER, frozenset()), created_at, linger_s)
            if previous is not None
            else {n: g for n, g in (lingering_seed or {}).items() if n not in resources.get(CLUSTER, {})}
        ),
    )


def _lingering(
    previous: Snapshot | None,
    resources: Mapping[str, Mapping[str, SnapshotResource]],
    changed_clusters: frozenset[str],
    now: float,
    linger_s: float,
) -> Mapping[str, Lingering]:
    """Clusters removed since `previous` join the lingering ones; back or expired ones leave."""
    if previous is None:
        return {}
    clusters = resources.get(CLUSTER, {})
    before = previous.resources.get(CLUSTER, {})
    gone = [n for n in changed_clusters if n in before and n not in clusters]
    if not gone and not previous.lingering:
        return previous.lingering
    out = {n: g for n, g in previous.lingering.items() if n not in clusters and now - g.since < linger_s}
    assignments = previous.resources.get(ENDPOINT, {})
    for name in gone:
        assignment = assignments.get(name)
        if assignment is not None:
            out[name] = Lingering(assignment, now, before[name])
    return out
