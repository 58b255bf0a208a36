"""Which proxies hold an xDS stream on some replica, shared through etcd.

Load reports count only from a node that holds an xDS stream (anyone can open an LRS
stream; only a proxy we serve routes the traffic it reports). With several replicas an
Envoy's LRS stream may reach another replica than its ADS stream (Envoy picks a host of
its xDS cluster per gRPC stream), so every replica publishes the node ids it serves under
`<prefix>/nodes/<replica>-<id>` (bound to a lease: a stopped replica's key goes) and reads
the others'.

A published set is the 8-byte BLAKE2b digests of the node ids, sorted and concatenated: a
node id may be 1,024 characters, and a replica serving 100,000 proxies still writes 800 KB,
under etcd's 1.5 MiB request limit (more are cut at NODES_MAX_PUBLISHED, and logged).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Callable, Iterable

import structlog

from controlplane.ha.etcd import Etcd, LeasedKey
from controlplane.obs.outage import Outage
from controlplane.rollout.store import StoreUnavailable

log = structlog.get_logger("controlplane.ha")

PUBLISH_S = 2.0  # how often the set is published (if changed) and the others' read
LEASE_TTL_S = 10
DIGEST = 8
NODES_MAX_PUBLISHED = 150_000  # 1.2 MB of digests


def digest(node_id: str) -> bytes:
    return hashlib.blake2b(node_id.encode("utf-8", "surrogatepass"), digest_size=DIGEST).digest()


def encode(node_ids: Iterable[str]) -> bytes:
    """The published form of a set of node ids (pure)."""
    return b"".join(sorted({digest(n) for n in node_ids})[:NODES_MAX_PUBLISHED])


def decode(value: bytes) -> frozenset[bytes]:
    """The digests in a published value; a torn or foreign value gives what whole digests it
    holds (pure)."""
    return frozenset(value[i : i + DIGEST] for i in range(0, len(value) - DIGEST + 1, DIGEST))


class SharedNodes:
    """Publishes the node ids holding xDS streams here; answers whether another replica
    serves a node."""

    def __init__(
        self,
        etcd: Etcd,
        replica: str,
        local: Callable[[], Iterable[str]],
    ) -> None:
        self.etcd = etcd
        self.local = local
        self.prefix = etcd.url.key("nodes") + b"/"
        self._mine = LeasedKey(etcd, self.prefix + f"{replica}-{uuid.uuid4().hex[:6]}".encode(), LEASE_TTL_S)
        self.peers: frozenset[bytes] = frozenset()

    def holds(self, node_id: str) -> bool:
        """Whether another replica serves `node_id`, as last read."""
        return digest(node_id) in self.peers

    async def sync(self) -> None:
        """Publish this replica's set (if changed) and read the others' (once)."""
        local = list(self.local())
        if len(local) > NODES_MAX_PUBLISHED:
            log.warning("too many proxies to share them all", proxies=len(local), shared=NODES_MAX_PUBLISHED)
        await self._mine.put(encode(local))
        result = await self.etcd.call(lambda c: c.get_prefix(self.prefix))
        peers: set[bytes] = set()
        for kv in result:
            if bytes(kv.key) != self._mine.key:
                peers |= decode(bytes(kv.value))
        self.peers = frozenset(peers)

    async def run(self) -> None:
        """Sync every PUBLISH_S until cancelled; the key goes with the replica."""
        outage = Outage(log, "cannot share the proxies served here: etcd unreachable")
        try:
            while True:
                try:
                    await self.sync()
                    outage.ok()
                except StoreUnavailable as e:
                    outage.failed(e)
                await asyncio.sleep(PUBLISH_S)
        finally:
            await self._mine.close()
