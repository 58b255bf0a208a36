"""LoRA adapters in the emulator, pure (time is an input): names, and the GPU's adapter slots.

vLLM serves adapters of one base model: a request names an adapter in `model`; the running
batch may hold requests of at most `max_loras` distinct adapters, each in a GPU slot; an
adapter not in a slot is loaded into one when its request is scheduled, evicting the least
recently used adapter that no running request uses. `AdapterSlots` is that cache: which
adapters are resident, in LRU order, when each one's load is over, and the loads, evictions
and failed loads per adapter (kept across restarts by the server that owns the counts).
The engine (`emulator_engine`) asks it whether a waiting request's adapter can have a slot.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_ADAPTERS = 4096  # adapters registered at once (vLLM has no bound; /v1/models lists them all)
MAX_LORAS = 256  # GPU adapter slots
MAX_NAME_CHARS = 256
MAX_LORA_LOAD_S = 600.0


class AdapterLoadFailed(Exception):
    """An adapter's load into a GPU slot failed (the `lora_load_fail` fault)."""

    def __init__(self, adapter: str) -> None:
        super().__init__(f"Loading lora {adapter} failed: emulated fault (lora_load_fail)")
        self.adapter = adapter


def adapter_name_problem(name: object, served_model: str) -> str | None:
    """Why `name` cannot name an adapter, or None. Names are joined with commas on the metrics
    page (`vllm:lora_requests_info`), so a comma or a space in one would make that page
    ambiguous; the base model's own name would make a request's `model` ambiguous."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if len(name) > MAX_NAME_CHARS:
        return f"must be at most {MAX_NAME_CHARS} characters, got {len(name)}"
    if any(c == "," or c.isspace() for c in name):
        return f"must have no comma or whitespace (the metrics page joins names with commas), got {name!r}"
    if name == served_model:
        return f"must differ from the served model {served_model!r}"
    return None


def lora_module(entry: str) -> tuple[str, str]:
    """vLLM's `--lora-modules` entry `name=path` (or a bare `name`, whose path is the name) as
    (name, path). The emulator loads nothing: the path is only shown by /v1/models."""
    name, sep, path = entry.partition("=")
    return name, path if sep else name


@dataclass
class LoraCounts:
    """Per adapter: loads into a GPU slot, evictions from one, loads that failed. Owned by the
    server, so they survive its crashes and restarts as its other counters do."""

    loads: Counter[str] = field(default_factory=Counter)
    evictions: Counter[str] = field(default_factory=Counter)
    load_failures: Counter[str] = field(default_factory=Counter)


@dataclass
class _Slot:
    ready_at: float  # when its load is over: prefill of its requests starts no earlier
    running: int = 0  # requests of this adapter in the running batch
    dropped: bool = False  # unregistered while it ran: freed when its last request ends


class AdapterSlots:
    """The GPU's `max_loras` adapter slots, least recently used first. An adapter with running
    requests is never evicted; loading one costs `load_s`; `fails(name)` says whether a load
    of that adapter fails now (the fault)."""

    def __init__(
        self,
        max_loras: int,
        load_s: float,
        counts: LoraCounts | None = None,
        fails: Callable[[str], bool] | None = None,
    ) -> None:
        if not 1 <= max_loras <= MAX_LORAS:
            raise ValueError(f"max_loras: must be between 1 and {MAX_LORAS}, got {max_loras!r}")
        if not (math.isfinite(load_s) and 0 <= load_s <= MAX_LORA_LOAD_S):
            raise ValueError(f"lora_load_s: must be between 0 and {MAX_LORA_LOAD_S:g}, got {load_s!r}")
        self.max_loras = max_loras
        self.load_s = load_s
        self.counts = counts if counts is not None else LoraCounts()
        self._fails = fails or (lambda _: False)
        self._slots: OrderedDict[str, _Slot] = OrderedDict()

    @property
    def resident(self) -> list[str]:
        """Adapters in a slot, least recently used first."""
        return list(self._slots)

    def ready_at(self, name: str) -> float | None:
        slot = self._slots.get(name)
        return slot.ready_at if slot else None

    def can_take(self, name: str) -> bool:
        """Whether a request of `name` can join the batch now: its adapter is resident, a slot
        is free, or a resident adapter has no running request (it would be evicted)."""
        return (
            name in self._slots
            or len(self._slots) < self.max_loras
            or any(s.running == 0 for s in self._slots.values())
        )

    def take(self, name: str, at: float) -> float:
        """A request of `name` joins the batch at `at`: load its adapter if it is not resident
        (evicting the least recently used idle one if no slot is free). Return when the adapter
        is ready. Raise AdapterLoadFailed if the load fails (no slot is taken), ValueError if
        no slot can be had (call `can_take` first)."""
        slot = self._slots.get(name)
        if slot is None:
            slot = self._load(name, at)
        slot.running += 1
        self._slots.move_to_end(name)
        return slot.ready_at

    def release(self, name: str) -> None:
        """A request of `name` left the batch (finished or aborted): its adapter was just used."""
        slot = self._slots.get(name)
        if slot is None:
            return
        slot.running = max(0, slot.running - 1)
        if slot.dropped and slot.running == 0:
            del self._slots[name]
        else:
            self._slots.move_to_end(name)

    def place(self, name: str, at: float, *, cost: bool) -> bool:
        """Make `name` resident without a request, as vLLM's eager load at registration does
        (`cost`: the load takes `load_s` and it and the eviction it makes are counted; at
        start-up they are not). False if no slot can be had. Raise AdapterLoadFailed if the
        load fails."""
        slot = self._slots.get(name)
        if slot is not None:
            slot.dropped = False
            self._slots.move_to_end(name)
            return True
        if not self.can_take(name):
            return False
        self._load(name, at, cost=cost)
        return True

    def drop(self, name: str) -> None:
        """`name` was unregistered: free its slot now if no request runs it, else when the last
        one ends. Not an eviction."""
        slot = self._slots.get(name)
        if slot is None:
            return
        if slot.running == 0:
            del self._slots[name]
        else:
            slot.dropped = True

    def _load(self, name: str, at: float, *, cost: bool = True) -> _Slot:
        if self._fails(name):
            self.counts.load_failures[name] += 1
            raise AdapterLoadFailed(name)
        if len(self._slots) >= self.max_loras:
            victim = next((n for n, s in self._slots.items() if s.running == 0), None)
            if victim is None:
                raise ValueError(f"no GPU adapter slot for {name!r}: every one runs requests")
            del self._slots[victim]
            if cost:  # start-up placement (vLLM's --lora-modules) is not counted
                self.counts.evictions[victim] += 1
        slot = _Slot(ready_at=at + self.load_s if cost else at)
        self._slots[name] = slot
        if cost:
            self.counts.loads[name] += 1
        return slot
