"""A thin seam to etcd: `etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`, failover across members.

aetcd talks to one member. `Etcd.call` runs a request against the current member and, if
that member cannot be reached, moves to the next one and tries again, so losing one
member of a cluster loses nothing. When no member answers it raises StoreUnavailable
naming them all. Every request has a deadline, so an unreachable etcd never stalls the
control plane: xDS keeps serving the last snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import structlog

from controlplane.rollout.store import StoreUnavailable

log = structlog.get_logger("controlplane.ha")
T = TypeVar("T")
DEFAULT_PREFIX = "/controlplane"
# What a member that cannot be reached raises (or a grpc channel that is not ready yet).
UNREACHABLE = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    aetcd.exceptions.InternalError,
    asyncio.TimeoutError,
    OSError,
)


class StoreUrlInvalid(ValueError):
    pass


@dataclass(frozen=True)
class EtcdUrl:
    endpoints: tuple[tuple[str, int], ...]
    prefix: str = DEFAULT_PREFIX

    @property
    def where(self) -> str:
        return "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints) + self.prefix

    def key(self, *parts: str) -> bytes:
        return "/".join((self.prefix, *parts)).encode()


def parse_store_url(url: str) -> EtcdUrl:
    """`etcd://HOST:PORT[,HOST:PORT...][/PREFIX]` -> EtcdUrl; StoreUrlInvalid says what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "etcd":
        raise StoreUrlInvalid(f"{url!r}: expected etcd://HOST:PORT[,HOST:PORT...][/PREFIX]")
    hosts, slash, prefix = rest.partition("/")
    endpoints = []
    for hp in hosts.split(","):
        host, colon, port = hp.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreUrlInvalid(f"{url!r}: {hp!r} is not HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    p = "/" + prefix.strip("/") if slash and prefix.strip("/") else DEFAULT_PREFIX
    return EtcdUrl(tuple(endpoints), p)


class Etcd:
    """Requests to an etcd cluster, moving to the next member when one is unreachable."""

    def __init__(self, url: EtcdUrl, timeout_s: int = 2) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._index = 0
        self._client: aetcd.Client | None = None
        self._closing: list[asyncio.TimerHandle] = []

    async def _current(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.url.endpoints[self._index]
            client = aetcd.Client(host=host, port=port, timeout=self.timeout_s)
            await client.connect()
            self._client = client
        return self._client

    async def _next(self, failed: int) -> None:
        """Move on from member `failed`, unless a concurrent request already has (several tasks
        share this object; none may skip a member the others just moved to)."""
        if self._index != failed:
            return
        client, self._client = self._client, None
        self._index = (self._index + 1) % len(self.url.endpoints)
        if client is not None:
            # Other tasks may still have requests in flight on it: closing the channel now
            # would cancel them. Close it once they have all timed out.
            task = asyncio.get_running_loop().call_later(
                self.timeout_s + 2, lambda: asyncio.ensure_future(_close_quietly(client))
            )
            self._closing.append(task)

    async def call(self, request: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Run `request` on a member that answers; StoreUnavailable if none does."""
        errors = []
        # Every member twice: right after a member is lost the others may be electing a new
        # raft leader for a moment (about a second), and refuse requests meanwhile.
        for attempt in range(2 * len(self.url.endpoints)):
            if attempt == len(self.url.endpoints):
                await asyncio.sleep(0.5)
            index = self._index
            host, port = self.url.endpoints[index]
            try:
                client = await self._current()
                return await asyncio.wait_for(request(client), self.timeout_s + 1)
            except UNREACHABLE as e:
                errors.append(f"{host}:{port}: {type(e).__name__}")
                await self._next(index)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # our caller is being cancelled: let it go
                # grpc cancels the calls of a channel that was closed under them: try again.
                errors.append(f"{host}:{port}: channel closed")
        raise StoreUnavailable(f"{self.url.where} is unreachable ({'; '.join(errors)})")

    async def close(self) -> None:
        for handle in self._closing:
            handle.cancel()
        if self._client is not None:
            await _close_quietly(self._client)
            self._client = None


async def _close_quietly(client: aetcd.Client) -> None:
    # Closing a dead channel may fail too; it is gone either way.
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), 1)


class LeasedKey:
    """One key this replica publishes, bound to a lease so that it goes when the replica does
    (or is away longer than the lease): written only when its value changes, the lease kept
    alive on every `put`."""

    def __init__(self, etcd: Etcd, key: bytes, ttl_s: int) -> None:
        self.etcd = etcd
        self.key = key
        self.ttl_s = ttl_s
        self._lease: Any = None
        self.published: bytes | None = None

    async def put(self, value: bytes) -> None:
        lease = self._lease
        if lease is not None:
            reply = await self.etcd.call(lambda c: c.refresh_lease(lease.id))
            if reply is None or reply.TTL <= 0:  # expired (etcd was away): the key went with it
                self._lease = self.published = None
        if self._lease is None:
            self._lease = await self.etcd.call(lambda c: c.lease(self.ttl_s))
        if value != self.published:
            lease = self._lease
            await self.etcd.call(lambda c: c.put(self.key, value, lease=lease))
            self.published = value

    async def close(self) -> None:
        """Remove the key now (its lease revoked), quietly: the replica is going away."""
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(Exception):
                await self.etcd.call(lambda c: c.revoke_lease(lease.id))
