"""The service model of an emulated GPU model server (pure: time is an input).

Continuous batching with `slots` concurrent sequences. A sequence first prefills its
prompt (time proportional to prompt tokens), then decodes (time proportional to output
tokens), both divided by the GPU's `speed`. Requests beyond the slots wait in FIFO order
and start the moment a slot frees. KV-cache use is the tokens held by running sequences
(prompt plus tokens generated so far) over the server's KV capacity. The model ignores
batch-size effects on step time: a slot is a slot, which keeps it predictable for tests
and simulations (docs/emulator.md says so too).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSpec:
    slots: int = 8
    speed: float = 1.0  # relative GPU speed: 0.35 is a GPU 1/0.35 times slower
    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.02
    kv_capacity_tokens: int = 200_000


@dataclass(frozen=True)
class Completed:
    request_id: int
    submitted: float
    started: float
    first_token: float
    finished: float
    prompt_tokens: int
    output_tokens: int

    @property
    def latency_s(self) -> float:
        return self.finished - self.submitted

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.submitted


@dataclass
class _Sequence:
    request_id: int
    submitted: float
    prompt_tokens: int
    output_tokens: int
    started: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0


class BatchingServer:
    """State of one emulated server; advance it with the clock, submit requests to it."""

    def __init__(self, spec: ServerSpec) -> None:
        if spec.slots < 1 or spec.speed <= 0:
            raise ValueError("slots must be >= 1 and speed > 0")
        self.spec = spec
        self.running: list[_Sequence] = []
        self.waiting: deque[_Sequence] = deque()
        self.now = 0.0

    def _start(self, seq: _Sequence, at: float) -> None:
        s = self.spec
        seq.started = at
        seq.first_token = at + seq.prompt_tokens * s.prefill_s_per_token / s.speed
        seq.finished = seq.first_token + seq.output_tokens * s.decode_s_per_token / s.speed
        self.running.append(seq)

    def submit(self, request_id: int, prompt_tokens: int, output_tokens: int, now: float) -> list[Completed]:
        """Queue a request at `now` (after completing whatever finished before it)."""
        done = self.advance(now)
        seq = _Sequence(request_id, now, max(0, prompt_tokens), max(1, output_tokens))
        if len(self.running) < self.spec.slots:
            self._start(seq, now)
        else:
            self.waiting.append(seq)
        return done

    def advance(self, now: float) -> list[Completed]:
        """Move the clock to `now`; return the requests that finished, in finishing order."""
        if now < self.now:
            raise ValueError("time does not go backwards")
        done: list[Completed] = []
        while self.running:
            first = min(self.running, key=lambda q: q.finished)
            if first.finished > now:
                break
            self.running.remove(first)
            done.append(
                Completed(
                    first.request_id,
                    first.submitted,
                    first.started,
                    first.first_token,
                    first.finished,
                    first.prompt_tokens,
                    first.output_tokens,
                )
            )
            if self.waiting:
                self._start(self.waiting.popleft(), first.finished)
        self.now = now
        return done

    def next_event(self) -> float | None:
        """When the next running sequence finishes, if any."""
        return min((q.finished for q in self.running), default=None)

    @property
    def kv_use(self) -> float:
        """Tokens held by running sequences over KV capacity (0-1)."""
        held = 0.0
        s = self.spec
        for q in self.running:
            generated = 0.0
            if self.now > q.first_token:
                generated = min(q.output_tokens, (self.now - q.first_token) * s.speed / s.decode_s_per_token)
            held += q.prompt_tokens + generated
        return min(1.0, held / s.kv_capacity_tokens)
