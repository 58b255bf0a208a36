"""Pure: which eligible server takes a request, and what the picker knows to decide it.

The control plane decides what is eligible (its EDS assignments: held-out servers are sent
UNHEALTHY, draining ones DRAINING, the failover rank (zone, preferred GPU) is the EDS
priority, and the weight is adaptive's view of each server's speed and load); the picker
only orders the eligible servers of the cluster the route chose, in its first rank with any,
as the simulation's full-scan picker does: the servers known to have a slot free (idle, or
busy below the slots a page showed) first,
fastest first (capacity: the control plane's, declared or learnt, else the EDS weight), the
least busy of equal ones; then the others by the time a request would take there: a full
server first makes it wait for one of its slots to free, (load - slots + 1) / slots services
more, before its own 1 / capacity. That is a per-request full scan over every proxy's
requests, which Envoy's weighted least request (a proxy's own requests, a rate share per
host) cannot do.

What the picker knows of a server:
- its **load**: the requests the picker sent there that have not answered yet (it sees each
  start, at the pick, and end, at the response's headers), those its peers (other pickers,
  whose counts it reads every few tens of milliseconds) have there, plus the requests its
  own page shows that none of them sent (other proxies' fallbacks, direct clients): the
  page's running + waiting less what the pickers had in flight there when the page was read
  (the peers' as they last said). A page read longer ago than LOAD_MAX_AGE_S says nothing,
  nor a peer's counts older than PEER_MAX_AGE_S.
- its **slots**: the running count its page showed while requests also waited there (a full
  server runs as many as it can). Until a page has shown it full, it is taken to have as
  many as the most its cluster's other servers showed; with none known, one: the rank is
  then (load + 1) / capacity, weighted least request's score.
- its **KV cache**: a page that shows it at least KV_FULL used makes the server count as full.

A request with a prefix key (the hash the gateway's Lua filter computes from the prompt's
first messages or bytes, for models with `affinity: {prefix: ...}`) goes back to the server
that took the key last while that server's time is at most PREFIX_LOAD_BOUND times the
mean of the eligible servers' (consistent hashing's bounded load: a hot prefix spills over
instead of piling onto one server); a miss, or a spill, goes to the best server, which then
holds the key. The index keeps at most `prefix_entries`
keys, the least recently used dropped first, each as a 16-byte digest of the cluster and
the key (a key is up to 1 MiB of prompt: the index is bounded in bytes, not only in count).

Everything it is told is checked here, so no input can make a pick raise or rank by
nonsense: a page's figures that are not finite or are negative say nothing; a peer's
answer with more servers than PICKER_PEER_MAX_SERVERS, or a count that is not a whole
number from 0 to what the server can hold (peer_bound: its slots times
PICKER_PEER_SLOTS_FACTOR), is refused whole, and that peer counts for nothing until it
answers sensibly (observe_peer says why).

Ties go to the server with the lower load, then to the one whose KV events show it holding
the fewest blocks (a new prefix fills the emptiest cache), then to the one picked least
recently, so equal servers take turns. Nothing here does I/O; picker/service.py feeds it the
assignments, the pages and the requests.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from controlplane import limits
from controlplane.kvcache.index import STEP_BLOCKS, Applied, KvIndex, run
from controlplane.kvcache.mirror import KvMirror
from controlplane.kvcache.wire import Batch
from controlplane.picker.adapters import BLOCKED, EVICT, RESIDENT, SLOT_FREE, UNKNOWN, AdapterView

# Health statuses a server may be picked in: what Envoy's override_host takes by default.
ELIGIBLE = frozenset({health_check_pb2.UNKNOWN, health_check_pb2.HEALTHY})
FALLBACKS = 2  # servers named after the first, for Envoy to walk on retries
LOAD_MAX_AGE_S = 5.0  # a server's page read longer ago than this says nothing of its load now
KV_FULL = 0.95  # a page showing this much of the KV cache used: the server counts as full
PREFIX_LOAD_BOUND = 1.5  # a prefix goes back to its server while its time is at most this x the mean
PREFIX_ENTRIES = 65536  # prefix keys remembered (least recently used dropped first)
EVENTS_KEEP = 4096  # starts and ends remembered per server (to know its in-flight count at a reading)
PEER_MAX_AGE_S = 1.0  # another picker's counts read longer ago than this say nothing
# A server sent a prompt with blocks it did not hold publishes their storing within its
# prefill; one that has said nothing this long after such a pick is stale (scored by the
# approximate index until it publishes again).
KV_STALE_S = 10.0
# The part of a request's service a fully cached prompt saves (its prefill), where no server of
# the cluster has shown its prefill and decode times (ServerLoad): a server's time is lowered
# by this times the cached part of the prompt, over its speed. Where they are known, the
# saving is the request's own: cached tokens / (prompt tokens + its decode in prompt tokens).
KV_PREFILL_SHARE = 0.5
APPROXIMATE_BLOCK = 8  # a prompt's approximate key: the key of its 8th block (or its last)
# The share of a request's whole service (its prompt computed, and its decode) that a
# cluster's requests take once their cached prompts are counted: a moving average over its
# picks with a prompt, each weighing KV_INCURRED_ALPHA. A wait for a slot is a wait for
# requests ahead to end, and those are mostly cached too: the wait is this share of services
# (at most 1, at least KV_INCURRED_MIN), not whole ones.
KV_INCURRED_ALPHA = 0.05
KV_INCURRED_MIN = 0.05


def adapter_reason(state: str) -> str:
    """The pick reason of a request for an adapter sent to a server in `state` (adapters.py):
    adapter_resident, adapter_slot_free, adapter_evict (a blocked server evicts once a slot's
    requests end); a server whose slots are unknown: least_loaded."""
    return {
        RESIDENT: "adapter_resident",
        SLOT_FREE: "adapter_slot_free",
        EVICT: "adapter_evict",
        BLOCKED: "adapter_evict",
    }.get(state, "least_loaded")


def prefix_digest(cluster: str, prefix: str) -> bytes:
    """What the prefix index keeps for a key: 16 bytes, whatever the key's length (up to
    limits.PICKER_PREFIX_KEY_MAX_BYTES of prompt), per cluster."""
    h = hashlib.blake2b(digest_size=limits.PICKER_PREFIX_DIGEST_BYTES)
    name = cluster.encode(errors="surrogatepass")
    h.update(len(name).to_bytes(8, "big"))  # length first: no cluster and key run into another pair
    h.update(name)
    h.update(prefix.encode(errors="surrogatepass"))
    return h.digest()


def _real(x: object) -> float | None:
    """`x` as a finite number, else None (not a number, NaN, infinite, too large for a float)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        f = float(x)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _finite(x: object) -> float | None:
    """`x` as a finite number from 0 up, else None."""
    f = _real(x)
    return f if f is not None and f >= 0 else None


def sane_load(page: ServerLoad) -> ServerLoad | None:
    """A page's figures as the ranking may use them: the queue and the read time must be
    finite (else the page says nothing: None); a capacity, running, waiting, KV use, prefill
    or decode time that is not a finite number from 0 up is unknown."""
    queued, read_at = _finite(page.queued), _real(page.read_at)
    if queued is None or read_at is None:
        return None
    kv = _finite(page.kv_use)
    return ServerLoad(
        min(queued, float(limits.METRICS_MAX_QUEUE)),
        read_at,
        _finite(page.capacity) or None,
        running=_finite(page.running),
        waiting=_finite(page.waiting),
        kv_use=None if kv is None else min(kv, 1.0),
        prefill_s_per_token=_finite(page.prefill_s_per_token),
        decode_s_per_request=_finite(page.decode_s_per_request),
        lora_running=page.lora_running,
        lora_waiting=page.lora_waiting,
        max_lora=page.max_lora,
    )


@dataclass(frozen=True)
class ServerLoad:
    """A server's page as the control plane last read it: requests running and waiting, read
    at `read_at` (the picker's monotonic clock), its KV-cache use, and its capacity as the
    control plane knows it."""

    queued: float  # running + waiting
    read_at: float
    capacity: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_use: float | None = None
    # What a request costs there (vLLM's pages, smoothed by the control plane): prefill
    # seconds per prompt token not cached, decode seconds per request. None: unknown.
    prefill_s_per_token: float | None = None
    decode_s_per_request: float | None = None
    # Its LoRA adapters (vLLM's lora_requests_info): those with requests running and waiting,
    # and its adapter slots. None: the page showed none.
    lora_running: tuple[str, ...] | None = None
    lora_waiting: tuple[str, ...] | None = None
    max_lora: int | None = None

    def decode_in_prompt_tokens(self) -> float | None:
        """A request's decode as the prompt tokens whose prefill takes as long (None: unknown):
        speed cancels out, so one server's figure stands for its peers' too."""
        p, d = _real(self.prefill_s_per_token), _real(self.decode_s_per_request)
        return d / p if p is not None and d is not None and p > 0 and d >= 0 else None


@dataclass(frozen=True)
class Candidate:
    """One server of a cluster as the control plane last sent it."""

    address: str  # IP:PORT, [IPv6]:PORT
    weight: int
    eligible: bool
    capacity: float | None = None  # the control plane's, where the picker has it
    priority: int = 0  # the EDS failover rank (zone, preferred GPU): lower is used first

    @property
    def scale(self) -> float:
        """What a load is divided by: the capacity, else the EDS weight."""
        return self.capacity if self.capacity else float(self.weight)


class Pick(NamedTuple):
    """The servers named for a request, best first (empty: none, Envoy routes by the
    weights), and why the first: least_loaded, kv_hit (its KV events show the prompt's first
    blocks cached there), approximate (the approximate index sent the prefix there last);
    and how many of the prompt's blocks the first holds (from its events)."""

    servers: tuple[str, ...]
    reason: str
    kv_blocks: int = 0


@dataclass(frozen=True)
class KvAsk:
    """A request's prompt as the precise index matches it: its blocks' keys per block size
    (kvcache/blocks.py), and its length in tokens."""

    keys: Mapping[int, list[int]]
    tokens: int

    def approximate_key(self) -> str:
        """A key for the approximate index, from the prompt's first blocks (the smallest block
        size's APPROXIMATE_BLOCK-th key, or its last)."""
        keys = self.keys[min(self.keys)] if self.keys else []
        return f"kv:{keys[min(len(keys), APPROXIMATE_BLOCK) - 1]:016x}" if keys else ""


NO_PICK = Pick((), "")


def candidates(cla: endpoint_pb2.ClusterLoadAssignment) -> tuple[Candidate, ...]:
    """A ClusterLoadAssignment's servers, eligible or not, in its order."""
    out = []
    for locality in cla.endpoints:
        for lb in locality.lb_endpoints:
            sock = lb.endpoint.address.socket_address
            host = f"[{sock.address}]" if ":" in sock.address else sock.address
            weight = lb.load_balancing_weight.value if lb.HasField("load_balancing_weight") else 1
            out.append(
                Candidate(
                    f"{host}:{sock.port_value}",
                    max(1, weight),
                    lb.health_status in ELIGIBLE,
                    priority=locality.priority,
                )
            )
    return tuple(out)


def wait_and_service(load: float, slots: float, scale: float) -> float:
    """The time a new request takes on a server with `load` requests, `slots` slots and
    speed `scale`, in units of a speed-1 service: one service with a slot free, else the wait
    for (load - slots + 1) of its requests to end, `slots` at a time, first. Total: a load
    or slots that is not a finite number from 0 up counts as 0 (one slot), a speed that is
    not a finite positive number as 1."""
    load = _finite(load) or 0.0
    slots = max(1.0, _finite(slots) or 1.0)
    scale = _finite(scale) or 1.0
    if load < slots:
        return 1.0 / scale
    return (1.0 + (load - slots + 1.0) / slots) / scale


@dataclass
class PickerState:
    """What one picker knows: each cluster's servers, each server's requests in flight, the
    servers' pages, and where prefixes went."""

    prefix_entries: int = PREFIX_ENTRIES
    prefix_bound: float = PREFIX_LOAD_BOUND
    clusters: dict[str, tuple[Candidate, ...]] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    loads: dict[str, ServerLoad] = field(default_factory=dict)
    slots: dict[str, float] = field(default_factory=dict)
    peers: dict[str, tuple[float, dict[str, int]]] = field(default_factory=dict)  # peer -> (read at, counts)
    prefixes: OrderedDict[bytes, str] = field(default_factory=OrderedDict)  # prefix_digest -> server
    # The servers' KV events: the index (kvcache/index.py), or the picker's mirror of it where
    # the index runs in a process of its own (kvcache/mirror.py, picker/kv_process.py).
    kv: KvIndex | KvMirror = field(default_factory=KvIndex)
    kv_publishers: set[str] = field(default_factory=set)  # servers the control plane says publish
    kv_pending: dict[str, float] = field(default_factory=dict)  # server -> a pick not yet published
    kv_stale_picks: int = 0  # picks that scored a server by the approximate index: its events stale
    adapters: AdapterView = field(default_factory=AdapterView)  # where LoRA adapters are (adapters.py)
    adapter_affinity: bool = True  # False: an adapter's requests picked as the base model's (A/B)
    kv_incurred: dict[str, float] = field(default_factory=dict)  # cluster -> share (KV_INCURRED_ALPHA)
    _events: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    _last_pick: dict[str, int] = field(default_factory=dict)
    _picks: int = 0
    _known: set[str] = field(default_factory=set)

    def assign(self, assignments: Iterable[endpoint_pb2.ClusterLoadAssignment]) -> None:
        """The control plane's assignments, whole (state of the world): clusters not in them
        are gone. In-flight counts stay: requests already sent still end; what was kept of
        a server in no cluster and with nothing in flight goes (so a fleet that changes for
        years does not grow the picker)."""
        self.clusters = {cla.cluster_name: candidates(cla) for cla in assignments}
        self._known = {c.address for servers in self.clusters.values() for c in servers}
        known = self._known
        self.kv_incurred = {k: v for k, v in self.kv_incurred.items() if k in self.clusters}
        for kept in (self._events, self._last_pick, self.slots, self.kv_pending, self.adapters.servers):
            for address in [a for a in kept if a not in known and a not in self.inflight]:
                del kept[address]
        self.kv.keep_only(known)

    def known(self) -> set[str]:
        """Every server of every cluster in the last assignments."""
        return self._known

    def observe(self, loads: Mapping[str, ServerLoad]) -> None:
        """The servers' pages as the control plane last read them (replacing the previous).
        A page that shows requests waiting shows the server full: its running count is its
        slots (the most seen so). A page whose figures are not finite says nothing (sane_load)."""
        self.loads = {a: p for a, page in loads.items() if (p := sane_load(page)) is not None}
        for address, page in self.loads.items():
            if page.waiting and page.running and page.running > self.slots.get(address, 0.0):
                self.slots[address] = page.running
            self.adapters.observe(address, page.lora_running, page.lora_waiting, page.max_lora, page.read_at)

    def inflight_at(self, address: str, t: float) -> float:
        """The picker's requests in flight at `address` at time `t` (from the starts and ends
        it remembers after t)."""
        later = 0
        for at, delta in reversed(self._events.get(address, ())):  # in time order: newest last
            if at <= t:
                break
            later += delta
        return max(0.0, float(self.inflight.get(address, 0) - later))

    def observe_peer(
        self, peer: str, counts: Mapping[str, object] | Sequence[tuple[str, object]], now: float
    ) -> str | None:
        """Another picker's requests in flight per server (a mapping, or the pairs as it sent
        them), as it said at `now`; None if taken. An answer with more than
        PICKER_PEER_MAX_SERVERS servers, a server named twice, or any count that is not a
        whole number from 0 to peer_bound(server), is refused whole: the reason is returned,
        and the peer counts for nothing until it answers sensibly. Servers the picker does
        not know (not in its assignments, or not yet) are left out."""
        items = list(counts.items()) if isinstance(counts, Mapping) else counts
        why = self._nonsense(items)
        if why is not None:
            self.peers.pop(peer, None)
            return why
        known = self.known()
        self.peers[peer] = (now, {a: int(n) for a, n in items if a in known and n})  # type: ignore[call-overload]
        return None

    def _nonsense(self, items: Sequence[tuple[str, object]]) -> str | None:
        """Why a peer's answer cannot be taken, or None."""
        if len(items) > limits.PICKER_PEER_MAX_SERVERS:
            return f"more than {limits.PICKER_PEER_MAX_SERVERS} servers"
        seen: set[str] = set()
        unknown_slots = self._unknown_slots()  # once: not once per entry
        for address, n in items:
            if address in seen:
                return "a server named twice"
            seen.add(address)
            if isinstance(n, bool) or not isinstance(n, int):
                return f"a count that is not a whole number ({type(n).__name__})"
            if n < 0:
                return "a negative count"
            bound = self._bound(self.slots.get(address) or unknown_slots)
            if n > bound:
                shown = str(n) if n < 10**12 else "more than 10^12"  # never a 400-digit line
                return f"{shown} in flight on one server, above its bound {bound}"
        return None

    def peer_bound(self, address: str) -> int:
        """The most requests another picker may say it has in flight on `address`: its slots
        (from its page, else the most any server's page showed, else
        PICKER_PEER_DEFAULT_SLOTS) times PICKER_PEER_SLOTS_FACTOR, at most METRICS_MAX_QUEUE."""
        return self._bound(self.slots.get(address) or self._unknown_slots())

    def _unknown_slots(self) -> float:
        """The slots of a server no page has shown full: the most any page showed, else
        PICKER_PEER_DEFAULT_SLOTS."""
        return max(self.slots.values(), default=0.0) or float(limits.PICKER_PEER_DEFAULT_SLOTS)

    @staticmethod
    def _bound(slots: float) -> int:
        return min(limits.METRICS_MAX_QUEUE, math.ceil(slots * limits.PICKER_PEER_SLOTS_FACTOR))

    def peer_load(self, address: str, now: float) -> float:
        """The requests the other pickers (their counts fresher than PEER_MAX_AGE_S) have in
        flight at `address`."""
        return float(
            sum(counts.get(address, 0) for at, counts in self.peers.values() if now - at <= PEER_MAX_AGE_S)
        )

    def load(self, address: str, now: float) -> float:
        """What `address` has to do at `now`: the picker's own requests in flight and its
        peers', plus those its fresh page shows that none of them sent."""
        known = float(self.inflight.get(address, 0)) + self.peer_load(address, now)
        page = self.loads.get(address)
        if page is None or now - page.read_at > LOAD_MAX_AGE_S:
            return known
        sent = self.inflight_at(address, page.read_at) + self.peer_load(address, now)
        return known + max(0.0, page.queued - sent)

    def cost(self, c: Candidate, load: float, slots: float, incurred: float = 1.0) -> float:
        """wait_and_service for `c` at `load`; a page showing its KV cache full counts it full.
        `incurred`: what a request ahead takes, as a share of a whole service (the wait for a
        slot is counted in such services)."""
        page = self.loads.get(c.address)
        if page is not None and page.kv_use is not None and page.kv_use >= KV_FULL:
            load = max(load, slots)
        whole = wait_and_service(load, slots, c.scale)
        service = 1.0 / (_finite(c.scale) or 1.0)
        return service + (whole - service) * incurred

    def free_slot(self, cluster: str, now: float, subset: frozenset[str] | None = None) -> bool:
        """Whether any eligible server of `cluster` (of `subset`, if given: the only servers a
        request may go to; in its first failover rank) has a slot
        free by this picker's view: its requests in flight (its own, its peers', those its
        fresh page shows that none of them sent) below its slots, and its fresh page not
        showing the KV cache full. A server whose slots were never seen takes the most its
        cluster's others showed; where none was ever seen, a server is free until its fresh
        page shows a request waiting (which shows its slots: the running count). No eligible
        server: True (nothing to wait for: Envoy routes by the weights)."""
        servers = [
            c
            for c in self.clusters.get(cluster, ())
            if c.eligible and (subset is None or c.address in subset)
        ]
        if not servers:
            return True
        first = min(c.priority for c in servers)
        servers = [c for c in servers if c.priority == first]
        known = [self.slots[c.address] for c in servers if c.address in self.slots]
        for c in servers:
            page = self.loads.get(c.address)
            fresh = page if page is not None and now - page.read_at <= LOAD_MAX_AGE_S else None
            if fresh is not None and fresh.kv_use is not None and fresh.kv_use >= KV_FULL:
                continue
            slots = self.slots.get(c.address, max(known) if known else None)
            if slots is None:  # never seen full: free until its page shows a request waiting
                if fresh is None or not fresh.waiting:
                    return True
            elif self.load(c.address, now) < max(1.0, slots):
                return True
        return False

    def kv_event(self, server: str, batch: Batch, now: float) -> str:
        """A batch from `server`'s KV events (kvcache/index.py's KvIndex.apply): what became
        of it. Any batch shows the server publishing: it is not stale."""
        return run(self.kv_event_steps(server, batch, now)).value

    def kv_event_steps(
        self, server: str, batch: Batch, now: float, step: int = STEP_BLOCKS
    ) -> Generator[None, None, Applied]:
        """kv_event `step` blocks at a time (KvIndex.apply_steps): for a caller on an event loop."""
        self.kv_pending.pop(server, None)
        if not isinstance(self.kv, KvIndex):
            raise TypeError("KV events are applied to the index, not to a mirror of it")
        return self.kv.apply_steps(server, batch, now, step)

    def kv_fresh(self, server: str, now: float) -> bool:
        """The server's KV events can be trusted for a pick: it publishes (the control plane
        names its publisher; what it holds is what its events since the picker subscribed, or
        since its stream started again, say: nothing at first), and has not gone KV_STALE_S
        quiet after a pick that should have made it publish."""
        if server not in self.kv_publishers:
            return False
        since = self.kv_pending.get(server)
        return since is None or now - since <= KV_STALE_S

    def pick(
        self,
        cluster: str,
        now: float = 0.0,
        prefix: str = "",
        subset: frozenset[str] | None = None,
        kv: KvAsk | None = None,
        adapter: str = "",
    ) -> Pick:
        """The servers to send a request of `cluster` to, best first (the first and up to
        FALLBACKS more), counted in flight at `now` on the first; NO_PICK when the picker
        knows no eligible server there (Envoy then routes by the weights). `prefix`: the
        request's prefix key, if it has one; `subset`: the only servers it may go to (the
        Endpoint Picker Protocol's subset hint), if it names them; `kv`: its prompt's blocks,
        if the gateway sent the prompt and the model has a tokenizer.

        With `kv`, each server within the load bound (its time at most prefix_bound times the
        mean) has its time lowered by the share of the request's service that the part of the
        prompt it holds saves, over its speed (cached tokens / (prompt tokens + the request's
        decode in prompt tokens, from the servers' pages: ServerLoad), else KV_PREFILL_SHARE
        times the part): from its KV events where they are fresh (kv_fresh), else by the
        approximate index (all of it, if the prompt's approximate key went there last); a
        wait for a slot counts the requests ahead at the share of a whole service the
        cluster's picks have been taking (kv_incurred: they are mostly cached too). Where
        any server has such a credit, the lowered times alone rank (no free slot first): a
        short wait where the prompt is cached beats computing it again, while a long hit on a
        busy or slow server still loses to an idle fast one.

        With `adapter` (a request naming a LoRA adapter), each server's time gains what
        loading the adapter there costs (adapters.AdapterView.penalty: nothing where it is
        resident, a load where a slot is free, a load and the evicted adapter's harm
        otherwise), over its speed, and the times alone rank: a short wait where the adapter
        is loaded beats a free slot where it must be loaded, while a hot adapter's servers,
        once their queues outgrow a load, spill to others."""
        if kv is not None and not prefix:
            prefix = kv.approximate_key()
        servers = [
            Candidate(c.address, c.weight, c.eligible, self._capacity(c), c.priority)
            for c in self.clusters.get(cluster, ())
            if c.eligible and (subset is None or c.address in subset)
        ]
        if not servers:
            return NO_PICK
        # The failover ranks as Envoy keeps them: the first rank with a server to pick.
        first = min(c.priority for c in servers)
        servers = [c for c in servers if c.priority == first]
        loads = {c.address: self.load(c.address, now) for c in servers}
        # A server never seen full is taken to have as many slots as the most its peers of the
        # cluster showed (a version's servers mostly run one configuration); if it has fewer,
        # the requests that wait there show it, and its own count takes over.
        known = [self.slots[c.address] for c in servers if c.address in self.slots]
        peers = max(known) if known else 1.0
        slots = {c.address: self.slots.get(c.address, peers) for c in servers}
        # With a prompt, the requests ahead are mostly cached too: a wait is shorter than
        # whole services (kv_incurred).
        incurred = self.kv_incurred.get(cluster, 1.0) if kv is not None and kv.tokens > 0 else 1.0
        costs = {c.address: self.cost(c, loads[c.address], slots[c.address], incurred) for c in servers}

        bound = self.prefix_bound * sum(costs.values()) / len(costs)
        key = prefix_digest(cluster, prefix) if prefix and self.prefix_entries > 0 else None
        approximate = self.prefixes.get(key) if key is not None else None
        blocks: dict[str, int] = {}
        if kv is not None and kv.tokens > 0:
            fresh = [c.address for c in servers if self.kv_fresh(c.address, now)]
            blocks = self.kv.matched(fresh, kv.keys)
            decode = {a: r for a in costs if (r := self._decode_in_prompt_tokens(a)) is not None}
            peers_decode = statistics.median(decode.values()) if decode else None

            def saved(address: str, part: float) -> float:
                """The share of this request's service that `part` of its prompt cached saves."""
                r = decode.get(address, peers_decode)
                if r is None:
                    return KV_PREFILL_SHARE * part
                return part * kv.tokens / (kv.tokens + r)

            adjusted = dict(costs)
            for c in servers:
                if costs[c.address] > bound:
                    continue
                if c.address in blocks:
                    size = self.kv.block_size(c.address) or 0
                    part = min(1.0, blocks[c.address] * size / kv.tokens)
                else:
                    part = 1.0 if c.address == approximate else 0.0
                    if part and c.address in self.kv_publishers:
                        self.kv_stale_picks += 1
                adjusted[c.address] = costs[c.address] - saved(c.address, part) / c.scale
        else:
            adjusted = costs

        credited = any(adjusted[a] < costs[a] for a in costs)
        states: dict[str, str] = {}
        if adapter and self.adapter_affinity:
            adjusted = dict(adjusted)
            for c in servers:
                states[c.address], penalty = self.adapters.penalty(c.address, adapter, now)
                adjusted[c.address] += penalty / c.scale
            credited = credited or len({adjusted[a] - costs[a] for a in costs}) > 1

        def order(c: Candidate) -> tuple[bool, float, float, int, int]:
            # A server known to have a slot free before any other: a wait's length is a guess
            # (the requests ahead may be long), a free slot is not. But a cached prompt is no
            # guess either: where one is (within the load bound), the times alone rank, so a
            # short wait for a slot on the server that holds the prompt beats a free slot where
            # it must be computed again (as the approximate index's hit does).
            free = bool(known) and costs[c.address] * c.scale <= 1.0  # slots unknown: plain LR
            busy = loads[c.address] / slots[c.address]
            return (
                not free and not credited,
                adjusted[c.address],
                busy,
                self.kv.held_blocks(c.address),
                self._last_pick.get(c.address, 0),
            )

        servers.sort(key=order)
        ranked = [s.address for s in servers]
        reason = "least_loaded"
        if adapter and self.adapter_affinity:
            reason = adapter_reason(states[ranked[0]])
        elif kv is not None:
            top = ranked[0]
            if blocks.get(top):
                reason = "kv_hit"
            elif top == approximate and top not in blocks and adjusted[top] < costs[top]:
                reason = "approximate"
        elif approximate in costs and costs[approximate] <= bound:
            ranked.remove(approximate)
            ranked.insert(0, approximate)
            reason = "approximate"
        if key is not None:
            self.prefixes[key] = ranked[0]
            self.prefixes.move_to_end(key)
            while len(self.prefixes) > self.prefix_entries:
                self.prefixes.popitem(last=False)
        chosen = ranked[0]
        self.started(chosen, now)
        if adapter:
            self.adapters.started(chosen, adapter, now)
        self._picks += 1
        self._last_pick[chosen] = self._picks
        held = blocks.get(chosen, 0)
        if kv is not None and kv.tokens > 0:
            took = 1.0 - max(0.0, costs[chosen] - adjusted[chosen]) * servers[0].scale
            share = min(1.0, max(KV_INCURRED_MIN, took))
            self.kv_incurred[cluster] = incurred + KV_INCURRED_ALPHA * (share - incurred)
        if kv is not None and chosen in blocks:
            size = self.kv.block_size(chosen) or min(kv.keys, default=0)
            if size and held < len(kv.keys.get(size, ())):
                self.kv_pending.setdefault(chosen, now)  # it will store blocks: it should publish
        return Pick(tuple(ranked[: 1 + FALLBACKS]), reason, held)

    def placement_order(self, servers: Sequence[str], adapter: str, now: float) -> list[str]:
        """`servers` in the order an adapter is best loaded onto them: a free slot before an
        eviction before a wait for a slot (adapters.py), then the least busy for its speed."""
        rank = {RESIDENT: 0, SLOT_FREE: 1, UNKNOWN: 2, EVICT: 3, BLOCKED: 4}

        def key(address: str) -> tuple[int, float, float, str]:
            state, harm = self.adapters.state(address, adapter, now)
            known = self.loads.get(address)
            speed = known.capacity if known is not None and known.capacity else 1.0
            return rank.get(state, 2), harm, self.load(address, now) / speed, address

        return sorted(servers, key=key)

    def _decode_in_prompt_tokens(self, address: str) -> float | None:
        load = self.loads.get(address)
        return load.decode_in_prompt_tokens() if load is not None else None

    def _capacity(self, c: Candidate) -> float | None:
        known = self.loads.get(c.address)
        return known.capacity if known is not None and known.capacity else None

    def started(self, address: str, now: float) -> None:
        """A request picked for `address` at `now`."""
        self.inflight[address] = self.inflight.get(address, 0) + 1
        self._events.setdefault(address, deque(maxlen=EVENTS_KEEP)).append((now, 1))
        self._forget(address, now)

    def done(self, address: str, now: float = 0.0, adapter: str = "") -> None:
        """A request picked for `address` (of `adapter`, if it named one) ended at `now`
        (answered, failed or cancelled)."""
        if adapter:
            self.adapters.done(address, adapter, now)
        left = self.inflight.get(address, 0) - 1
        if left > 0:
            self.inflight[address] = left
        else:
            self.inflight.pop(address, None)
        if left >= 0:
            self._events.setdefault(address, deque(maxlen=EVENTS_KEEP)).append((now, -1))
        self._forget(address, now)

    def _forget(self, address: str, now: float) -> None:
        """Starts and ends older than any page that still counts are of no more use."""
        events = self._events.get(address)
        while events and events[0][0] < now - LOAD_MAX_AGE_S - 1.0:
            events.popleft()
