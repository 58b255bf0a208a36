"""Envoy load reports shared between control-plane replicas through etcd.

An Envoy's load-report (LRS) stream may go to another replica than its ADS stream (Envoy
picks a host of its xDS cluster per gRPC stream), and the leader judges rollouts from the
load reports it sees. So while a rollout runs, every replica publishes once a second the
cumulative per-endpoint counts of the reports *it* received, for the endpoints under
analysis, under `<prefix>/reports/<replica>-<incarnation>` (bound to a lease, so a stopped
replica's key goes), and reads the others'. The rollout controller adds them to its own
(`RolloutController.peer_reports`).

Merging (PeerReports, pure):
- A source counts from when this replica first saw it: its earlier history is not news to
  a step's analysis. A source that goes away keeps its last counts, so sums never go back.
- A source's newest-report stamp moving forward is stamped with this replica's clock, so
  "a report arrived since the step began" can be told across processes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from controlplane.ha.etcd import Etcd, LeasedKey
from controlplane.obs.outage import Outage
from controlplane.rollout.store import StoreUnavailable
from controlplane.signals.store import EndpointCounters, EndpointKey, SignalStore

log = structlog.get_logger("controlplane.ha")

PUBLISH_S = 1.0  # Envoy reports every second
LEASE_TTL_S = 10  # a replica that stops publishing has its key removed after this

# What one source says of one endpoint: (succeeded, failed, its newest report's stamp).
Report = tuple[float, float, float | None]


@dataclass
class _Seen:
    base: tuple[float, float]  # the counts when first seen (or after a reset)
    last: tuple[float, float]
    carried: tuple[float, float] = (0.0, 0.0)  # growth before a reset
    stamp: float | None = None  # the source's newest-report stamp, highest seen
    arrived_at: float | None = None  # this replica's clock when that stamp last moved

    def growth(self) -> tuple[float, float]:
        return (
            self.carried[0] + self.last[0] - self.base[0],
            self.carried[1] + self.last[1] - self.base[1],
        )


@dataclass
class PeerReports:
    """Other replicas' load-report counts, merged per endpoint (pure: time is an input)."""

    _seen: dict[EndpointKey, dict[str, _Seen]] = field(default_factory=dict)

    def fold(self, docs: Mapping[str, Mapping[EndpointKey, Report]], now: float) -> None:
        """Take in what each source (a replica's incarnation) publishes now."""
        for source, endpoints in docs.items():
            for key, (ok, failed, stamp) in endpoints.items():
                by_source = self._seen.setdefault(key, {})
                s = by_source.get(source)
                if s is None:
                    # Whether its newest report is new to a step cannot be told yet.
                    by_source[source] = _Seen((ok, failed), (ok, failed), stamp=stamp)
                    continue
                if ok < s.last[0] or failed < s.last[1]:  # the source forgot the endpoint
                    s.carried, s.base = s.growth(), (0.0, 0.0)
                s.last = (ok, failed)
                if stamp is not None and (s.stamp is None or stamp > s.stamp):
                    s.stamp, s.arrived_at = stamp, now

    def counters(self, key: EndpointKey) -> EndpointCounters:
        """The endpoint's load-report counts from every other source, since first seen."""
        ok = failed = 0.0
        arrived: float | None = None
        for s in self._seen.get(key, {}).values():
            g_ok, g_failed = s.growth()
            ok, failed = ok + g_ok, failed + g_failed
            if s.arrived_at is not None and (arrived is None or s.arrived_at > arrived):
                arrived = s.arrived_at
        return EndpointCounters(lrs_ok=ok, lrs_failed=failed, lrs_reported_at=arrived)


def encode(signals: SignalStore, keys: set[EndpointKey]) -> bytes:
    """This replica's own load-report counts for `keys`, as published."""
    rows: list[list[Any]] = []
    for model, address in sorted(keys):
        c = signals.counters((model, address))
        if c.lrs_reported_at is not None or c.lrs_ok or c.lrs_failed:
            rows.append([model, address, c.lrs_ok, c.lrs_failed, c.lrs_reported_at])
    return json.dumps({"endpoints": rows}, separators=(",", ":")).encode()


def decode(value: bytes) -> dict[EndpointKey, Report]:
    """A published document; one that cannot be read counts as empty."""
    try:
        rows = json.loads(value)["endpoints"]
        return {
            (str(m), str(a)): (float(ok), float(f), None if t is None else float(t))
            for m, a, ok, f, t in rows
        }
    except (ValueError, KeyError, TypeError):
        return {}


class SharedReports:
    """Publishes this replica's load-report counts and folds in the other replicas'."""

    def __init__(
        self,
        etcd: Etcd,
        replica: str,
        signals: SignalStore,
        wanted: Callable[[], set[EndpointKey]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.etcd = etcd
        self.signals = signals
        self.wanted = wanted
        self.clock = clock
        self.prefix = etcd.url.key("reports") + b"/"
        self.key = self.prefix + f"{replica}-{uuid.uuid4().hex[:6]}".encode()
        self.peers = PeerReports()
        self._mine = LeasedKey(etcd, self.key, LEASE_TTL_S)

    def counters(self, key: EndpointKey) -> EndpointCounters:
        return self.peers.counters(key)

    async def _publish(self, keys: set[EndpointKey]) -> None:
        await self._mine.put(encode(self.signals, keys))

    async def _read(self) -> None:
        result = await self.etcd.call(lambda c: c.get_prefix(self.prefix))
        docs = {bytes(kv.key).decode(): decode(bytes(kv.value)) for kv in result if kv.key != self.key}
        self.peers.fold(docs, self.clock())

    async def run(self) -> None:
        """Publish and read every second while some rollout is analysed, until cancelled."""
        outage = Outage(log, "cannot share load reports: etcd unreachable")
        try:
            while True:
                await asyncio.sleep(PUBLISH_S)
                keys = self.wanted()
                if not keys and self._mine.published in (None, encode(self.signals, set())):
                    continue  # no rollout running: nothing to share
                try:
                    await self._publish(keys)
                    if keys:
                        await self._read()
                    outage.ok()
                except StoreUnavailable as e:
                    outage.failed(e)
        finally:
            await self._mine.close()
