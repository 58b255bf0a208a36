"""Continuous batching in real time: the asyncio twin of `sim.service.BatchingServer`.

The same model, driven by the event loop's clock instead of a simulated one: `slots`
sequences run at once; a sequence prefills (prompt tokens x prefill time) and then decodes
(output tokens x decode time), both divided by the GPU's speed; requests beyond the slots
wait in FIFO order and start the moment a slot frees. A freed slot passes to the next
request at the time the finished sequence was due, not when its task happened to wake, so
timer jitter does not accumulate along a queue. A request whose client goes away frees its
slot at once, as vLLM aborts it.

Backlog phantoms are long requests with no client: each one queues, runs, and queues again
at the tail, so the server stays backlogged by that many requests until the backlog is
lowered, and real requests interleave with them in FIFO order.

LoRA adapters (`emulator_lora.AdapterSlots`), as vLLM's scheduler treats them: a request of
an adapter joins the batch only if its adapter has or can take a GPU slot; one that cannot is
skipped and keeps its place, so it does not hold back base-model requests or requests of
resident adapters behind it. An adapter loaded for a request costs the load before its
prefill (its time to first token includes it); the other sequences run on.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from controlplane.sim.emulator_lora import AdapterLoadFailed, AdapterSlots
from controlplane.sim.service import ServerSpec


@dataclass(eq=False)
class Sequence:
    """One request in the engine. Times are event-loop times (seconds)."""

    prompt_tokens: int
    output_tokens: int
    submitted: float
    phantom: bool = False
    cached_tokens: int = 0  # of the prompt, found in the prefix cache: no prefill for them
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    started: float = math.nan
    first_token: float = math.nan
    finished: float = math.nan
    decode_s_per_token: float = math.nan
    load_s: float = 0.0  # of the time from `started` to prefill, waiting for its adapter's load
    left: bool = False  # it has left the engine's LoRA bookkeeping (finished, aborted or failed)

    def token_time(self, k: int) -> float:
        """When output token k (0-based) is out: the first at the end of prefill, then one
        per decode step. The sequence holds its slot until `finished`, one step after the last."""
        return self.first_token + k * self.decode_s_per_token

    def held_tokens(self, now: float) -> float:
        """KV-cache tokens held at `now`: the prompt plus the tokens generated so far."""
        if math.isnan(self.started):
            return 0.0
        generated = 0.0
        if now > self.first_token:
            generated = min(self.output_tokens, (now - self.first_token) / self.decode_s_per_token)
        return self.prompt_tokens + generated

    @property
    def queue_s(self) -> float:
        return self.started - self.submitted

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.submitted

    @property
    def latency_s(self) -> float:
        return self.finished - self.submitted


class LiveBatchingServer:
    """The GPU of one emulated server. Use `admit` around the life of a request."""

    def __init__(
        self,
        spec: ServerSpec,
        adapters: AdapterSlots | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """`adapters`: the GPU's LoRA slots (None: LoRA disabled). `on_change` is called after
        every change of the running and waiting requests (the LoRA page series follow it)."""
        if spec.slots < 1 or spec.speed <= 0 or spec.decode_s_per_token <= 0:
            raise ValueError("slots must be >= 1, speed > 0 and decode_s_per_token > 0")
        self.spec = spec
        self.adapters = adapters
        self.on_change = on_change
        self.slow = 1.0  # service-time multiplier for sequences that start from now on
        self.running: list[Sequence] = []
        self._waiting: deque[tuple[Sequence, asyncio.Future[None]]] = deque()
        # Adapters with requests in flight (waiting or running) and how many, in the order each
        # came to have one (since it last had none), as vLLM keeps them for lora_requests_info.
        self._in_flight: dict[str, int] = {}
        self._phantoms: list[asyncio.Task[None]] = []
        self._ending: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()

    def now(self) -> float:
        return self._loop.time()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, fut in self._waiting if not fut.done())

    @property
    def backlog(self) -> int:
        return len(self._phantoms)

    @property
    def held_tokens(self) -> float:
        """Tokens held in the KV cache by running sequences (prompt + tokens generated so far)."""
        now = self.now()
        return sum(q.held_tokens(now) for q in self.running)

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of the requests waiting for a slot."""
        return sum(seq.prompt_tokens for seq, fut in self._waiting if not fut.done())

    @property
    def kv_use(self) -> float:
        """Tokens held by running sequences over KV capacity (0-1)."""
        return min(1.0, self.held_tokens / self.spec.kv_capacity_tokens)

    def lora_adapters(self) -> tuple[list[str], list[str], list[str]]:
        """Adapters with requests in flight, in the order each came to have one; of those, the
        adapters with running requests; and those with waiting requests."""
        running = {q.adapter for q in self.running if q.adapter is not None}
        waiting = {q.adapter for q, fut in self._waiting if q.adapter is not None and not fut.done()}
        live = list(self._in_flight)
        return live, [n for n in live if n in running], [n for n in live if n in waiting]

    @contextlib.asynccontextmanager
    async def admit(
        self,
        prompt_tokens: int,
        output_tokens: int,
        *,
        phantom: bool = False,
        cached_tokens: int = 0,
        adapter: str | None = None,
    ) -> AsyncIterator[Sequence]:
        """Wait for a slot (in arrival order; a request whose adapter cannot have a GPU slot
        yet lets those behind it pass); yield the started sequence, whose timing is then fixed;
        free the slot on exit (early if the caller is cancelled: an aborted request).
        `cached_tokens` of the prompt were found in the prefix cache: they skip prefill.
        `adapter`: its LoRA adapter; raise AdapterLoadFailed if loading it fails."""
        if adapter is not None and self.adapters is None:
            raise ValueError(f"adapter {adapter!r}: LoRA is not enabled on this engine")
        prompt = max(0, prompt_tokens)
        seq = Sequence(
            prompt, max(1, output_tokens), self.now(), phantom, min(prompt, max(0, cached_tokens)), adapter
        )
        if adapter is not None:
            self._in_flight[adapter] = self._in_flight.get(adapter, 0) + 1
        entry = (seq, self._loop.create_future())
        self._waiting.append(entry)
        self._schedule(seq.submitted)
        try:
            await entry[1]  # at once if it started above
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self._release(seq)  # handed a slot just as the caller gave up
            else:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                self._leave(seq)
                self._changed()
            raise
        try:
            yield seq
        finally:
            self._release(seq)

    async def wait_until(self, when: float) -> None:
        """Sleep until event-loop time `when` (no-op if it has passed)."""
        delay = when - self.now()
        if delay > 0:
            await asyncio.sleep(delay)

    def _start(self, seq: Sequence, at: float, ready: float | None = None) -> None:
        """Start `seq` at `at`; its prefill begins when its adapter is `ready` (loaded)."""
        s = self.spec
        factor = self.slow / s.speed
        seq.started = at
        seq.load_s = 0.0 if ready is None else max(0.0, ready - at)
        prefill_from = at + seq.load_s
        seq.first_token = (
            prefill_from + (seq.prompt_tokens - seq.cached_tokens) * s.prefill_s_per_token * factor
        )
        seq.decode_s_per_token = s.decode_s_per_token * factor
        seq.finished = seq.first_token + seq.output_tokens * seq.decode_s_per_token
        self.running.append(seq)

    def _schedule(self, at: float) -> None:
        """Start waiting requests, oldest first, while the batch has room, as vLLM's scheduler
        does: one whose adapter can have no GPU slot is skipped and keeps its place; one whose
        adapter fails to load is answered with the failure."""
        skipped: list[tuple[Sequence, asyncio.Future[None]]] = []
        while self._waiting and len(self.running) < self.spec.slots:
            entry = self._waiting.popleft()
            seq, fut = entry
            if fut.done():  # its caller was cancelled while waiting
                continue
            start = max(at, seq.submitted)
            ready = start
            if seq.adapter is not None:
                assert self.adapters is not None  # admit refuses adapters without slots
                if not self.adapters.can_take(seq.adapter):
                    skipped.append(entry)
                    continue
                try:
                    ready = self.adapters.take(seq.adapter, start)
                except AdapterLoadFailed as e:
                    self._leave(seq)
                    fut.set_exception(e)
                    continue
            self._start(seq, start, ready)
            fut.set_result(None)
        self._waiting.extendleft(reversed(skipped))
        self._changed()

    def _release(self, seq: Sequence) -> None:
        if seq not in self.running:
            return
        self.running.remove(seq)
        if seq.adapter is not None and self.adapters is not None:
            self.adapters.release(seq.adapter)
        self._leave(seq)
        self._schedule(min(self.now(), seq.finished))  # due time if it ran to the end, now if aborted

    def _leave(self, seq: Sequence) -> None:
        """`seq` is no longer in flight: its adapter's count of requests in flight drops."""
        if seq.adapter is None or seq.left:
            return
        seq.left = True
        left = self._in_flight.get(seq.adapter, 0) - 1
        if left > 0:
            self._in_flight[seq.adapter] = left
        else:
            self._in_flight.pop(seq.adapter, None)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def set_backlog(self, n: int, prompt_tokens: int, output_tokens: int) -> None:
        """Keep `n` phantom requests in the server; returns once they have queued or left."""
        while len(self._phantoms) < n:
            self._phantoms.append(asyncio.create_task(self._phantom(prompt_tokens, output_tokens)))
        while len(self._phantoms) > n:
            task = self._phantoms.pop()  # the newest is furthest back in the queue
            task.cancel()
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
        await asyncio.sleep(0)  # let new phantoms take their place and cancelled ones leave

    async def _phantom(self, prompt_tokens: int, output_tokens: int) -> None:
        while True:
            async with self.admit(prompt_tokens, output_tokens, phantom=True) as seq:
                await self.wait_until(seq.finished)

    async def close(self) -> None:
        """Drop the phantoms (callers' own requests end with their tasks)."""
        await self.set_backlog(0, 0, 1)
        await asyncio.gather(*self._ending, return_exceptions=True)
