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
- Nothing here decides where: the caller gives the servers best first (choose.py's order).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import structlog

log = structlog.get_logger("controlplane.picker")

LOAD_TIMEOUT_S = 25.0  # one load's answer: within routing/translate.ADAPTER_LOAD_WAIT_S, with room
FAILED_HOLD_S = 60.0  # a server that failed to load an adapter is not asked for it again this long
LOAD_TRIES = 2  # servers tried for one load before the request is answered with the failure
ERROR_MAX_CHARS = 300


class LoadFailed(Exception):
    """No server could load the adapter: why, in words (the last server's answer)."""


@dataclass
class Placer:
    """Which servers this picker loaded each adapter onto, and the loads under way."""

    registered: dict[str, set[str]] = field(default_factory=dict)  # adapter -> servers that have it
    failed: dict[tuple[str, str], float] = field(default_factory=dict)  # (server, adapter) -> when
    loads: dict[str, int] = field(default_factory=dict)  # outcome -> count (loaded, failed)
    _loading: dict[str, asyncio.Task[str]] = field(default_factory=dict)
    _session: aiohttp.ClientSession | None = None

    def holding(self, adapter: str, servers: frozenset[str]) -> frozenset[str]:
        """Of `servers`, those known to have `adapter`."""
        return servers & self.registered.get(adapter, set())

    def usable(self, adapter: str, servers: Sequence[str], now: float) -> list[str]:
        """`servers` less those that failed to load `adapter` within FAILED_HOLD_S."""
        return [s for s in servers if now - self.failed.get((s, adapter), -FAILED_HOLD_S) >= FAILED_HOLD_S]

    def forget(self, server: str) -> None:
        """A server gone from every cluster: what it had is no more."""
        for servers in self.registered.values():
            servers.discard(server)

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
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S))
        try:
            async with self._session.post(
                f"http://{server}/v1/load_lora_adapter", json={"lora_name": adapter, "lora_path": source}
            ) as r:
                text = (await r.content.read(4096)).decode(errors="replace")
                if r.status == 200 or (r.status == 400 and "already" in text.lower()):
                    return
                raise LoadFailed(f"HTTP {r.status}: {text.strip()[:ERROR_MAX_CHARS]}")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise LoadFailed(f"{type(e).__name__}: {str(e)[:ERROR_MAX_CHARS]}") from None

    async def close(self) -> None:
        for task in list(self._loading.values()):
            task.cancel()
        if self._session is not None:
            await self._session.close()
