"""The picker's adapter placement (`placement: dynamic`, docs/adapters.md): a thin I/O shell
that loads a LoRA adapter onto a server through vLLM's runtime API when a request for it finds
no server that has it.

vLLM started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True takes `POST /v1/load_lora_adapter`
with `{"lora_name", "lora_path"}` and registers the adapter: from then on a request naming it
is served there (the adapter takes a GPU slot at its first request, as one given with
--lora-modules does). It answers 200, or 400 when the adapter is already loaded (which is as
good). Only the servers this picker loaded an adapter onto are known to have it, so a request
for it goes to those only; a server that restarted has lost it, and its next load puts it back.

- **One load at a time per adapter**: requests that arrive while it loads wait for the same
  load, not one each.
- **A load that fails** (an error, a refusal, no answer within LOAD_TIMEOUT_S) holds that
  server out for that adapter for FAILED_HOLD_S, never for the base model: the next server in
  the pick's order is tried, up to LOAD_TRIES servers.
- **Cold adapters are unloaded**: one this picker loaded that no request of its has used on a
  server for `idle_unload_s` (and with none in flight there) is unloaded from it (`POST
  /v1/unload_lora_adapter`), after being dropped from what the picker sends there. vLLM keeps
  registered adapters in host memory: a placement that only grew would fill it.
- Nothing here decides where: the caller gives the servers best first (choose.py's order).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import structlog

from controlplane.net.http import client_session

log = structlog.get_logger("controlplane.picker")

LOAD_TIMEOUT_S = 25.0  # one load's answer: within routing/translate.ADAPTER_LOAD_WAIT_S, with room
FAILED_HOLD_S = 60.0  # a server that failed to load an adapter is not asked for it again this long
LOAD_TRIES = 2  # servers tried for one load before the request is answered with the failure
IDLE_UNLOAD_S = 600.0  # an adapter this picker loaded, unused on a server this long, is unloaded
ERROR_MAX_CHARS = 300


class LoadFailed(Exception):
    """No server could load the adapter: why, in words (the last server's answer)."""


@dataclass
class Placer:
    """Which servers this picker loaded each adapter onto, and the loads under way."""

    registered: dict[str, set[str]] = field(default_factory=dict)  # adapter -> servers that have it
    failed: dict[tuple[str, str], float] = field(default_factory=dict)  # (server, adapter) -> when
    loads: dict[str, int] = field(default_factory=dict)  # outcome -> count (loaded, failed, unloaded)
    idle_unload_s: float = IDLE_UNLOAD_S
    used: dict[tuple[str, str], float] = field(default_factory=dict)  # (adapter, server) -> last sent
    _loading: dict[str, asyncio.Task[str]] = field(default_factory=dict)
    _session: aiohttp.ClientSession | None = None

    def holding(self, adapter: str, servers: frozenset[str]) -> frozenset[str]:
        """Of `servers`, those known to have `adapter`."""
        return servers & self.registered.get(adapter, set())

    def usable(self, adapter: str, servers: Sequence[str], now: float) -> list[str]:
        """`servers` less those that failed to load `adapter` within FAILED_HOLD_S."""
        return [s for s in servers if now - self.failed.get((s, adapter), -FAILED_HOLD_S) >= FAILED_HOLD_S]

    def sent(self, adapter: str, server: str, now: float) -> None:
        """A request of `adapter` sent to `server` at `now` (it is not cold there)."""
        if server in self.registered.get(adapter, ()):
            self.used[(adapter, server)] = now

    def cold(self, now: float, busy: Callable[[str, str], bool]) -> list[tuple[str, str]]:
        """(adapter, server) pairs loaded here and unused for idle_unload_s, none in flight
        (`busy(adapter, server)`): dropped from what requests are sent to; the caller unloads them."""
        out = []
        for adapter, servers in self.registered.items():
            for server in sorted(servers):
                last = self.used.get((adapter, server), now)
                self.used.setdefault((adapter, server), last)
                if now - last >= self.idle_unload_s and not busy(adapter, server):
                    out.append((adapter, server))
        for adapter, server in out:
            self.registered[adapter].discard(server)
            self.used.pop((adapter, server), None)
        return out

    async def unload(self, adapter: str, server: str) -> bool:
        """Unload `adapter` from `server` (already dropped from where requests go); whether the
        server said it did (an adapter it no longer has counts as done)."""
        try:
            async with self._client().post(
                f"http://{server}/v1/unload_lora_adapter", json={"lora_name": adapter}
            ) as r:
                text = (await r.content.read(4096)).decode(errors="replace")
                ok = r.status == 200 or (r.status in (400, 404) and "not" in text.lower())
        except (aiohttp.ClientError, TimeoutError) as e:
            error = str(e)[:ERROR_MAX_CHARS]
            log.warning("adapter unload failed", adapter=adapter, server=server, error=error)
            return False
        if ok:
            self.loads["unloaded"] = self.loads.get("unloaded", 0) + 1
            log.info("cold adapter unloaded", adapter=adapter, server=server)
        else:
            log.warning("adapter unload refused", adapter=adapter, server=server, answer=text.strip()[:300])
        return ok

    def lost(self, adapter: str, server: str) -> None:
        """`server` answered a request of `adapter` 404: it no longer has it (a restart)."""
        if server in self.registered.get(adapter, ()):
            self.registered[adapter].discard(server)
            self.used.pop((adapter, server), None)
            self.loads["lost"] = self.loads.get("lost", 0) + 1
            log.warning(
                "a server lost an adapter the picker loaded: loaded again when asked",
                adapter=adapter,
                server=server,
            )

    def keep_only(self, servers: set[str]) -> None:
        """Servers gone from every cluster: what they had is no more (one back later starts
        without the adapters loaded at runtime)."""
        for adapter, had in self.registered.items():
            for server in had - servers:
                had.discard(server)
                self.used.pop((adapter, server), None)

    async def place(self, adapter: str, source: str, servers: Sequence[str]) -> str:
        """Load `adapter` from `source` onto the first of `servers` that takes it (best first);
        the server, or LoadFailed. A load already under way for the adapter is awaited."""
        task = self._loading.get(adapter)
        if task is None:
            task = asyncio.ensure_future(self._place(adapter, source, servers))
            self._loading[adapter] = task
            task.add_done_callback(lambda _: self._loading.pop(adapter, None))
        return await asyncio.shield(task)

    async def _place(self, adapter: str, source: str, servers: Sequence[str]) -> str:
        why = "no server may serve it"
        for server in self.usable(adapter, servers, time.monotonic())[:LOAD_TRIES]:
            try:
                await self._load(server, adapter, source)
            except LoadFailed as e:
                why = f"{server}: {e}"
                self.failed[(server, adapter)] = time.monotonic()
                self.loads["failed"] = self.loads.get("failed", 0) + 1
                log.warning("adapter load failed", adapter=adapter, server=server, error=str(e))
                continue
            self.registered.setdefault(adapter, set()).add(server)
            self.loads["loaded"] = self.loads.get("loaded", 0) + 1
            log.info("adapter loaded", adapter=adapter, server=server)
            return server
        raise LoadFailed(why)

    async def _load(self, server: str, adapter: str, source: str) -> None:
        try:
            async with self._client().post(
                f"http://{server}/v1/load_lora_adapter", json={"lora_name": adapter, "lora_path": source}
            ) as r:
                text = (await r.content.read(4096)).decode(errors="replace")
                if r.status == 200 or (r.status == 400 and "already" in text.lower()):
                    return
                raise LoadFailed(f"HTTP {r.status}: {text.strip()[:ERROR_MAX_CHARS]}")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise LoadFailed(f"{type(e).__name__}: {str(e)[:ERROR_MAX_CHARS]}") from None

    def _client(self) -> aiohttp.ClientSession:
        """The session the loads and unloads share (made on first use, on the picker's loop)."""
        if self._session is None:
            self._session = client_session(timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S))
        return self._session

    async def close(self) -> None:
        for task in list(self._loading.values()):
            task.cancel()
        if self._session is not None:
            await self._session.close()
