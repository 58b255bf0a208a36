"""Pure: where each LoRA adapter is loaded, as the picker knows it, and what sending a request
for one to a server costs (docs/adapters.md).

A server (vLLM with --enable-lora) holds at most `max_lora` adapters in its GPU slots. A
request for an adapter in a slot runs at once; one for another adapter waits while a slot is
taken for it: a free one, else the least recently used adapter with no request running is
evicted, and the new one loaded (up to seconds on a GPU). Sent where it is not held, a
request pays that load, and the adapter it evicts pays it again on its next request: the
stampede of loads and evictions the picker is here to avoid.

What the picker knows of a server's slots:
- **its page** (vLLM's `vllm:lora_requests_info`, read by the control plane and handed on with
  the other page figures, ServerLoad): the adapters with requests running and waiting there,
  and its `max_lora` slots. Only a page read within LOAD_MAX_AGE_S counts.
- **its own sends**: each adapter it sent a request there, and when. An adapter that
  finished its requests stays in its slot until evicted; no page shows it. The picker keeps
  the most recent `max_lora` distinct adapters it (or the page) saw there as the slots'
  content: that is vLLM's own least-recently-used order, as far as one picker sees it.

Where a server stands for a request of adapter A (`state`):
- RESIDENT: A is running or waiting there (page), or among the slots' recent content.
- SLOT_FREE: fewer than max_lora adapters are there: A loads without evicting.
- EVICT: every slot holds another adapter, at least one with nothing in flight: A loads
  and evicts the least recently used such one. Its harm grows with how recently that one was
  used (a busy tenant's adapter pays a reload soon).
- BLOCKED: every slot's adapter has requests in flight: A waits for one to end, then loads.
- UNKNOWN: no page has shown the server's slots: it may hold A or not.

`penalty` turns the state into time, in the picker's units (a speed-1 service), which
choose.PickerState.pick adds to a server's time: resident costs nothing, a load costs
LOAD_COST services, an eviction that as well plus up to EVICT_HARM more, a blocked server
a further service's wait. A hot adapter therefore spreads: its servers' queues grow until a
server without it, paying one load, is faster (the prefix index's load bound, by another
name: a resident server's time may exceed the best other's by at most its saving).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from controlplane import limits

RESIDENT, SLOT_FREE, EVICT, BLOCKED, UNKNOWN = "resident", "slot_free", "evict", "blocked", "unknown"
STATES = (RESIDENT, SLOT_FREE, EVICT, BLOCKED, UNKNOWN)

LOAD_COST = 1.0  # services a load costs: on a GPU an adapter loads in about a request's time
EVICT_HARM = 1.0  # services at most an eviction costs the evicted adapter (its next load)
HARM_WINDOW_S = 30.0  # an evicted adapter used this long ago or longer is harmed not at all
UNKNOWN_COST = 0.5 * LOAD_COST  # a server whose slots no page has shown: may hold it, may not
SLOTS_MAX = 1024  # a page's max_lora above this is nonsense (vLLM's own bound is far lower)
NAMES_MAX = 64  # adapters kept per server (a page's list past this is cut by the control plane)
REMEMBER_S = 600.0  # an adapter not seen on a server this long is forgotten there


@dataclass
class _Server:
    """One server's slots as the picker knows them."""

    max_lora: int | None = None
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    read_at: float = -math.inf
    # adapter -> when last seen there (a request sent, a page showing it), oldest first
    last_used: OrderedDict[str, float] = field(default_factory=OrderedDict)
    inflight: dict[str, int] = field(default_factory=dict)


@dataclass
class AdapterView:
    """Every server's adapter slots, from the pages and the picker's own requests."""

    page_max_age_s: float = 5.0
    servers: dict[str, _Server] = field(default_factory=dict)
    # Adapters seen entering a server whose every slot was taken: an eviction there (as far
    # as the pages and this picker's requests show: another picker's sends are seen only
    # once a page shows them running).
    evictions: int = 0

    def observe(
        self,
        server: str,
        running: Iterable[str] | None,
        waiting: Iterable[str] | None,
        max_lora: int | None,
        read_at: float,
    ) -> None:
        """A page read at `read_at`: its adapters running and waiting, its slots (None: the
        page showed none; a server without LoRA, or a dialect without the series)."""
        if running is None and waiting is None and max_lora is None:
            return
        s = self.servers.setdefault(server, _Server())
        if max_lora is not None and 0 <= max_lora <= SLOTS_MAX:
            s.max_lora = int(max_lora)
        now_running = frozenset(list(running or ())[:NAMES_MAX])
        now_waiting = frozenset(list(waiting or ())[:NAMES_MAX])
        for a in sorted(now_running | now_waiting):  # against the slots as they were
            self._use(s, a, read_at, server if a in now_running else "")  # a waiting one holds no slot yet
        s.running, s.waiting, s.read_at = now_running, now_waiting, read_at

    def _use(self, s: _Server, adapter: str, now: float, server: str = "") -> None:
        if (
            server
            and s.max_lora
            and adapter not in (held := self.slots(server, now))
            and len(held) >= s.max_lora
        ):
            self.evictions += 1
        s.last_used[adapter] = max(now, s.last_used.get(adapter, now))
        s.last_used.move_to_end(adapter)
        while len(s.last_used) > NAMES_MAX:
            s.last_used.popitem(last=False)

    def started(self, server: str, adapter: str, now: float) -> None:
        """A request of `adapter` sent to `server` at `now`."""
        s = self.servers.setdefault(server, _Server())
        self._use(s, adapter, now, server)
        s.inflight[adapter] = s.inflight.get(adapter, 0) + 1

    def done(self, server: str, adapter: str, now: float) -> None:
        """A request of `adapter` at `server` ended at `now`."""
        s = self.servers.get(server)
        if s is None:
            return
        left = s.inflight.get(adapter, 0) - 1
        if left > 0:
            s.inflight[adapter] = left
        else:
            s.inflight.pop(adapter, None)
        if adapter in s.last_used:
            self._use(s, adapter, now)

    def _fresh(self, s: _Server, now: float) -> bool:
        return now - s.read_at <= self.page_max_age_s

    def slots(self, server: str, now: float) -> list[str]:
        """The adapters taken to be in `server`'s slots now, least recently used first: the
        most recent max_lora it was seen with (the page's running and waiting always)."""
        s = self.servers.get(server)
        if s is None or s.max_lora is None:
            return []
        for a, t in list(s.last_used.items()):
            if now - t > REMEMBER_S and not s.inflight.get(a):
                del s.last_used[a]
        recent = list(s.last_used)[-s.max_lora :] if s.max_lora else []
        pinned = (s.running | s.waiting) if self._fresh(s, now) else frozenset()
        return [a for a in s.last_used if a in recent or a in pinned or s.inflight.get(a)]

    def state(self, server: str, adapter: str, now: float) -> tuple[str, float]:
        """Where `server` stands for a request of `adapter` (one of STATES), and for EVICT the
        harm to the adapter it would evict (0 to 1: 1 if used just now)."""
        s = self.servers.get(server)
        if s is None:
            return UNKNOWN, 0.0
        fresh = self._fresh(s, now)
        if s.inflight.get(adapter) or (fresh and adapter in s.running | s.waiting):
            return RESIDENT, 0.0
        if s.max_lora is None:  # slots unknown: only what was sent there a moment ago is known there
            recent = adapter in s.last_used and now - s.last_used[adapter] < 1.0
            return (RESIDENT, 0.0) if recent else (UNKNOWN, 0.0)
        held = self.slots(server, now)
        if adapter in held:
            return RESIDENT, 0.0
        if len(held) < s.max_lora:
            return SLOT_FREE, 0.0
        busy = (s.running | s.waiting) if fresh else frozenset()  # a waiting one takes the next slot
        idle = [a for a in held if not s.inflight.get(a) and a not in busy]
        if not idle:
            return BLOCKED, 0.0
        victim = idle[0]
        age = now - s.last_used.get(victim, -math.inf)
        return EVICT, max(0.0, 1.0 - age / HARM_WINDOW_S)

    def penalty(self, server: str, adapter: str, now: float) -> tuple[str, float]:
        """`state`, and what it adds to a request's time there, in speed-1 services."""
        state, harm = self.state(server, adapter, now)
        cost = {
            RESIDENT: 0.0,
            SLOT_FREE: LOAD_COST,
            EVICT: LOAD_COST + EVICT_HARM * harm,
            BLOCKED: 2.0 * LOAD_COST + EVICT_HARM,
            UNKNOWN: UNKNOWN_COST,
        }[state]
        return state, cost

    def forget(self, server: str) -> None:
        """A server gone from every cluster, or restarted: nothing is known of its slots."""
        self.servers.pop(server, None)


class AdapterConfigError(ValueError):
    """A cluster's adapters metadata the picker cannot use (the cluster is picked as if its
    model had no adapters)."""


@dataclass(frozen=True)
class AdapterRule:
    """One adapter as the fleet file names it (fleet.model.Adapter, as the cluster carries it)."""

    source: str | None = None
    versions: frozenset[str] = frozenset()  # empty: every version
    endpoints: frozenset[str] = frozenset()  # empty: every endpoint


@dataclass(frozen=True)
class ClusterAdapters:
    """A picked cluster's adapters (routing/clusters.adapter_config): its model's placement,
    and each adapter's rule."""

    placement: str
    rules: dict[str, AdapterRule]

    def servers(self, adapter: str, version: str, candidates: Iterable[str]) -> frozenset[str] | None:
        """Of `candidates` (a cluster of `version`), the servers that may serve `adapter`; None
        when the adapter restricts none (every one may)."""
        rule = self.rules.get(adapter)
        if rule is None or (not rule.versions and not rule.endpoints):
            return None
        if rule.versions and version not in rule.versions:
            return frozenset()
        return frozenset(candidates) & rule.endpoints if rule.endpoints else None


def read_adapter_config(text: str) -> ClusterAdapters:
    """The JSON a cluster's `controlplane.adapters` metadata carries, checked."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise AdapterConfigError(f"not JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("placement") not in ("static", "dynamic"):
        raise AdapterConfigError("expected an object with placement static or dynamic")
    adapters = raw.get("adapters")
    if not isinstance(adapters, dict) or len(adapters) > limits.FLEET_ADAPTERS_MAX:
        raise AdapterConfigError(f"expected adapters: an object of at most {limits.FLEET_ADAPTERS_MAX}")
    rules: dict[str, AdapterRule] = {}
    for name, rule in adapters.items():
        if not isinstance(rule, dict) or len(name) > limits.API_NAME_MAX_CHARS:
            raise AdapterConfigError(f"adapter {name[:64]!r}: expected an object")
        source = rule.get("source")
        lists = [rule.get("versions", []), rule.get("endpoints", [])]
        if (source is not None and not isinstance(source, str)) or not all(
            isinstance(x, list) and all(isinstance(v, str) for v in x) for x in lists
        ):
            raise AdapterConfigError(f"adapter {name[:64]!r}: source a string, versions and endpoints lists")
        rules[name] = AdapterRule(source, frozenset(lists[0]), frozenset(lists[1]))
    return ClusterAdapters(str(raw["placement"]), rules)
