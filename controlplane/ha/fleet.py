"""The fleet in etcd: one YAML document under `<prefix>/fleet`, checked like the file.

`controlplane import --from fleet.yaml --to etcd://...` validates a file and writes it;
`controlplane export --from etcd://... --to fleet.yaml` writes it back out. Every replica
polls the key (with the state's revision poll) and hands each new valid fleet on; an
invalid one is refused loudly and the last good fleet keeps being served, as with a file.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import structlog

from controlplane.fleet.errors import FleetConfigInvalid
from controlplane.fleet.model import Fleet
from controlplane.fleet.watch import parse_file_bytes
from controlplane.ha.etcd import Etcd
from controlplane.obs.outage import Outage
from controlplane.rollout.store import StoreUnavailable

log = structlog.get_logger("controlplane.ha")


async def read_fleet_text(etcd: Etcd) -> str | None:
    got = await etcd.call(lambda c: c.get(etcd.url.key("fleet")))
    return None if got is None else bytes(got.value).decode()


async def write_fleet_text(etcd: Etcd, text: str) -> None:
    """Store a fleet document (the caller has validated it)."""
    await etcd.call(lambda c: c.put(etcd.url.key("fleet"), text.encode()))


class EtcdFleetSource:
    """Polls `<prefix>/fleet` and calls `on_fleet` with each new valid fleet."""

    def __init__(
        self,
        etcd: Etcd,
        on_fleet: Callable[[Fleet], None],
        on_invalid: Callable[[FleetConfigInvalid], None],
        interval_s: float = 0.25,
    ) -> None:
        self.etcd = etcd
        self.on_fleet = on_fleet
        self.on_invalid = on_invalid
        self.interval_s = interval_s
        self.name = f"{etcd.url.where}/fleet"
        self._digest: bytes | None = None
        self._missing_logged = False

    async def check(self) -> bool:
        """Load the fleet if it changed; True if it did. Raises StoreUnavailable."""
        text = await read_fleet_text(self.etcd)
        if text is None:
            if not self._missing_logged:
                log.error(
                    "no fleet in etcd yet; proxies get UNAVAILABLE until one is imported",
                    key=self.name,
                    fix=f"controlplane import --from fleet.yaml --to {self.etcd.url.where}",
                )
                self._missing_logged = True
            return False
        digest = hashlib.blake2b(text.encode()).digest()
        if digest == self._digest:
            return False
        self._digest = digest
        # Parsed in a worker thread (never on the loop that serves xDS); any input ends in a
        # verdict, a loader bug included.
        result = await asyncio.to_thread(parse_file_bytes, text.encode(), self.name)
        if isinstance(result, FleetConfigInvalid):
            self.on_invalid(result)
        else:
            self.on_fleet(result)
        return True

    async def run(self) -> None:
        """Poll until cancelled; an unreachable etcd keeps the last fleet in service."""
        outage = Outage(log, "etcd unreachable; serving the last fleet", "etcd reachable again")
        where = self.etcd.url.where
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except StoreUnavailable as e:
                outage.failed(e)
                await asyncio.sleep(self.interval_s * 4)
                continue
            outage.ok(store=where)
