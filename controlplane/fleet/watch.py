"""Watch the fleet file and hand every valid edit on; refuse invalid ones loudly.

A file being rewritten in place can be read half-written: a truncated fleet is valid YAML
with models missing, and serving it answers 404 for them (or with a tenant's limit missing,
and the tenant is suddenly unlimited). So an edit that removes something (a model, a
version, an endpoint; the quotas, a tenant's or a model's quota, one of their limits, a
rate-limit service) is acted on only once the file has held still
for `settle_s` (limits.FILE_SETTLE_S); an edit that only adds or changes goes out at once,
and so does a file that does not load (refusing it changes nothing served). The first load
is never held. A file that never holds still (edits every second) is not held forever: once
the first held change is `settle_max_s` old (limits.FILE_SETTLE_MAX_S), content read the same
on two polls in a row goes out.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from controlplane import limits
from controlplane.fleet.errors import ConfigError, FleetConfigInvalid
from controlplane.fleet.loader import decode_fleet, parse_fleet, read_fleet_bytes
from controlplane.fleet.model import Fleet, QuotaLimit, QuotaSpec

log = structlog.get_logger("controlplane.fleet")


class FleetFileWatcher:
    """Polls a YAML file (content hash) and calls `on_fleet` with each new valid fleet.

    Polling works the same on every filesystem, including a Kubernetes ConfigMap volume,
    whose atomic symlink swaps inotify-based watchers often miss.
    """

    def __init__(
        self,
        path: Path,
        on_fleet: Callable[[Fleet], None],
        on_invalid: Callable[[FleetConfigInvalid], None],
        interval_s: float = 0.25,
        settle_s: float = limits.FILE_SETTLE_S,
        settle_max_s: float = limits.FILE_SETTLE_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.on_fleet = on_fleet
        self.on_invalid = on_invalid
        self.interval_s = interval_s
        self.settle_s = settle_s
        self.settle_max_s = max(settle_max_s, settle_s)
        self.clock = clock
        self._digest: bytes | None = None  # of the content last acted on
        self._served: Fleet | None = None  # the last fleet handed on
        # Content seen but not yet acted on: its digest, since when, and its verdict.
        self._pending: tuple[bytes, float, Fleet | FleetConfigInvalid] | None = None
        self._held_since: float | None = None  # the first change held since the last one acted on
        self.held: str = ""  # why the file's current content waits, for logs and tests

    def check(self) -> bool:
        """Act on the file if its content changed (here, on the caller's thread). Returns
        True if something was handed on."""
        seen = self._changed()
        if seen is None:
            return self._settled()
        digest, data = seen
        return self._consider(digest, data if isinstance(data, FleetConfigInvalid) else self._parse(data))

    async def check_async(self) -> bool:
        """As `check`, with the parsing in a worker thread: a large or hostile file never
        blocks the event loop that serves xDS. The callbacks run on the loop."""
        seen = self._changed()
        if seen is None:
            return self._settled()
        digest, data = seen
        if isinstance(data, FleetConfigInvalid):
            return self._consider(digest, data)
        return self._consider(digest, await asyncio.to_thread(self._parse, data))

    def _changed(self) -> tuple[bytes, bytes | FleetConfigInvalid] | None:
        """The file's content (or why it cannot be read) if it differs from both what was
        acted on and what waits to be."""
        data: bytes | FleetConfigInvalid
        try:
            data = read_fleet_bytes(self.path)
            digest = hashlib.blake2b(data).digest()
        except FleetConfigInvalid as e:
            data, digest = e, f"unreadable:{e}".encode()
        if digest == self._digest:
            if self._pending is not None:
                log.info("fleet file back to what is served; the held edit is dropped", held=self.held)
            self._pending, self.held, self._held_since = None, "", None
            return None
        if self._pending is not None and digest == self._pending[0]:
            return None
        return digest, data

    def _consider(self, digest: bytes, result: Fleet | FleetConfigInvalid) -> bool:
        """New content: act on it now, or hold it until the file has held still."""
        why = self._why_hold(result)
        if not why:
            self._act(digest, result)
            return True
        now = self.clock()
        self._pending, self.held = (digest, now, result), why
        if self._held_since is None:
            self._held_since = now
        log.info("fleet file changed; held until it holds still", reason=why, settle_s=self.settle_s)
        return self._settled()

    def _settled(self) -> bool:
        """Act on held content once the file has not changed for settle_s, or once changes
        have been held for settle_max_s and this content was read the same twice."""
        if self._pending is None:
            return False
        digest, seen_at, result = self._pending
        now = self.clock()
        still = now - seen_at
        held = now - (self._held_since if self._held_since is not None else seen_at)
        if still < self.settle_s and not (held >= self.settle_max_s and still > 0):
            return False
        if still < self.settle_s:
            log.warning(
                "fleet file keeps changing; the held edit goes out after the longest wait",
                reason=self.held,
                held_s=round(held, 2),
                settle_max_s=self.settle_max_s,
            )
        self._act(digest, result)
        return True

    def _why_hold(self, result: Fleet | FleetConfigInvalid) -> str:
        if self._served is None or self.settle_s <= 0 or isinstance(result, FleetConfigInvalid):
            return ""  # a refused file changes nothing served: reported at once
        return removals(self._served, result)

    def _act(self, digest: bytes, result: Fleet | FleetConfigInvalid) -> None:
        self._digest, self._pending, self.held, self._held_since = digest, None, "", None
        if isinstance(result, Fleet):
            self._served = result
        self._deliver(result)

    def _parse(self, data: bytes) -> Fleet | FleetConfigInvalid:
        return parse_file_bytes(data, str(self.path))

    def _deliver(self, result: Fleet | FleetConfigInvalid) -> None:
        if isinstance(result, FleetConfigInvalid):
            self.on_invalid(result)
        else:
            self.on_fleet(result)

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            try:
                await self.check_async()
            except Exception:  # a bug here must not stop serving the last good config
                log.exception("fleet watcher failed; will retry")
            await asyncio.sleep(self.interval_s)


def parse_file_bytes(data: bytes, file: str) -> Fleet | FleetConfigInvalid:
    """The fleet in a file's bytes, or why not. A loader bug on some input is reported as an
    invalid file (counted, alerted on), never as a crash that leaves the status saying valid."""
    try:
        return parse_fleet(decode_fleet(data, file), file)
    except FleetConfigInvalid as e:
        return e
    except Exception as e:  # any input must end in a verdict
        log.exception("fleet loader failed on this input; refusing it", file=file)
        return FleetConfigInvalid([ConfigError(file, "", f"could not be loaded: {type(e).__name__}: {e}")])


def removals(old: Fleet, new: Fleet) -> str:
    """What `new` takes away from `old` (models, versions, endpoints, and quotas:
    quota_removals), as a short phrase; "" when it only adds or changes (pure)."""
    gone: list[str] = []
    versions = {m.name: {v.name: v for v in m.versions} for m in new.models}
    for m in old.models:
        if m.name not in versions:
            gone.append(f"model {m.name}")
            continue
        for v in m.versions:
            now = versions[m.name].get(v.name)
            if now is None:
                gone.append(f"version {m.name}@{v.name}")
                continue
            left = {(e.host, e.port) for e in now.endpoints}
            lost = sum(1 for e in v.endpoints if (e.host, e.port) not in left)
            if lost:
                gone.append(f"{lost} endpoint(s) of {m.name}@{v.name}")
    gone += quota_removals(old.quotas, new.quotas)
    if not gone:
        return ""
    shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
    return f"it removes {shown}"


_QUOTA_KINDS = ("requests_per_minute", "tokens_per_minute")


def quota_removals(old: QuotaSpec | None, new: QuotaSpec | None) -> list[str]:
    """What `new` takes away from `old`'s quotas, by their keys in the file: the whole block,
    a tenant's or a model's entry, one limit of one (a tenant would be suddenly unlimited, or
    on a looser level's limit), a rate-limit service. A limit changed in value is not a
    removal (pure)."""
    if old is None:
        return []
    if new is None:
        return ["quotas"]
    gone: list[str] = []

    def limits_lost(path: str, was: QuotaLimit, now: QuotaLimit | None) -> None:
        for kind in _QUOTA_KINDS:
            if getattr(was, kind) is not None and (now is None or getattr(now, kind) is None):
                gone.append(f"{path}.{kind}")

    def tenants_lost(path: str, was: dict[str, QuotaLimit], now: dict[str, QuotaLimit]) -> None:
        for tenant, limit in was.items():
            if tenant not in now:
                gone.append(f"{path}.{tenant}")
            else:
                limits_lost(f"{path}.{tenant}", limit, now[tenant])

    limits_lost("quotas.default", old.default, new.default)
    tenants_lost("quotas.tenants", dict(old.tenants), dict(new.tenants))
    for model, (default, tenants) in old.models.items():
        if model not in new.models:
            gone.append(f"quotas.models.{model}")
            continue
        new_default, new_tenants = new.models[model]
        limits_lost(f"quotas.models.{model}.default", default, new_default)
        tenants_lost(f"quotas.models.{model}.tenants", dict(tenants), dict(new_tenants))
    lost = [e for e in old.endpoints if e not in new.endpoints]
    if lost:
        gone.append(f"{len(lost)} endpoint(s) of quotas.service")
    return gone
