"""Leader election on an etcd lease: exactly one replica drives rollouts and drains.

A replica becomes leader by creating `<prefix>/leader` (only if absent) bound to a lease
of `ttl_s` seconds, and keeps the lease alive every ttl/3. It leads only while its last
successful keep-alive is recent (under 2/3 of the TTL ago), so a leader cut off from etcd
stops driving before its lease can expire and another replica take over: there is never
more than one driver. When the leader dies, its lease expires within the TTL; the others
poll the key and the first to create it leads, continuing from the stored state.

Every replica serves xDS and computes weights from its own scrapes whether it leads or
not (docs/ha.md says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import aetcd
import structlog

from controlplane.ha.etcd import Etcd
from controlplane.rollout.store import StoreUnavailable

log = structlog.get_logger("controlplane.ha")


class LeaderElection:
    def __init__(
        self,
        etcd: Etcd,
        replica: str,
        ttl_s: int = 5,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_store: Callable[[bool], None] | None = None,
    ) -> None:
        self.etcd = etcd
        self.replica = replica
        self.ttl_s = ttl_s
        self.on_change = on_change
        self.on_store = on_store  # told after each round whether etcd answered it
        self.clock = clock
        self.key = etcd.url.key("leader")
        self._lease: Any = None
        self._last_ok = -1e9
        self._was = False
        self.leader_id: str | None = None  # who leads, as last seen

    def is_leader(self) -> bool:
        return self._lease is not None and self.clock() - self._last_ok < self.ttl_s * 2 / 3

    def _report(self) -> None:
        now = self.is_leader()
        if now != self._was:
            self._was = now
            log.info("leadership gained" if now else "leadership lost", replica=self.replica)
            if self.on_change is not None:
                self.on_change(now)

    async def _campaign(self) -> None:
        lease = await self.etcd.call(lambda c: c.lease(self.ttl_s))

        async def txn(c: aetcd.Client) -> tuple[bool, Any]:
            tx = c.transactions
            return await c.transaction(  # type: ignore[no-any-return]
                compare=[tx.create(self.key) == 0],
                success=[tx.put(self.key, self.replica.encode(), lease=lease)],
                failure=[tx.get(self.key)],
            )

        won, responses = await self.etcd.call(txn)
        if won:
            self._lease, self._last_ok, self.leader_id = lease, self.clock(), self.replica
            return
        with contextlib.suppress(Exception):
            await self.etcd.call(lambda c: c.revoke_lease(lease.id))
        if responses and responses[0]:
            self.leader_id = bytes(responses[0][0][0]).decode()

    async def _keep_alive(self) -> None:
        lease = self._lease
        await self.etcd.call(lambda c: c.refresh_lease(lease.id))
        holder = await self.etcd.call(lambda c: c.get(self.key))
        if holder is None or bytes(holder.value).decode() != self.replica:
            self._lease = None  # our lease ran out and someone else leads now
            return
        self._last_ok = self.clock()

    async def run(self) -> None:
        """Campaign, then keep the lease alive, until cancelled (then resign)."""
        try:
            while True:
                reached = True
                try:
                    if self._lease is None:
                        await self._campaign()
                    else:
                        await self._keep_alive()
                except StoreUnavailable as e:
                    reached = False
                    if self._lease is not None and not self.is_leader():
                        log.warning("leadership lapsed: etcd unreachable", error=str(e))
                        self._lease = None
                except Exception as e:  # e.g. the lease is gone: campaign afresh
                    log.warning("leader election round failed", error=repr(e))
                    self._lease = None
                if self.on_store is not None:
                    self.on_store(reached)
                self._report()
                await asyncio.sleep(self.ttl_s / 3 if self._lease is not None else 0.5)
        finally:
            await self.resign()

    async def resign(self) -> None:
        """Give up leadership at once (a clean stop), so another replica need not wait the TTL."""
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(Exception):
                await self.etcd.call(lambda c: c.revoke_lease(lease.id))
        self._report()
