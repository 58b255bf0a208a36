"""The signals' output: what is known about one endpoint's load right now (pure data).

The signal store produces it; the balancing policies, load shedding and the fleet
simulator consume it. A figure never read (no page yet, or a dialect without it) is None,
never 0: an operator must not read "idle" where the truth is "unknown". The policies weigh
an unknown figure as 0 (docs/signals.md). It lives here, below them, so imports flow one way:
fleet <- signals <- balancing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EndpointLoad:
    """What the signals know about one endpoint right now."""

    address: str
    ready: bool = True  # the server's own last verdict (an endpoint never heard from: ready)
    running: float | None = None  # None: never read (no page, no proxy's report)
    waiting: float | None = None
    kv_use: float | None = None  # 0-1
    latency_s: float | None = None  # smoothed mean latency
    error_rate: float | None = None  # 0-1; None: no completion counted yet, by either source
    age_s: float = 0.0  # age of the newest signal
    capacity: float = 1.0  # relative throughput (GPU class or learnt)
    ready_for_s: float = math.inf  # seconds since it became ready (slow start)
    token_latency_s: float | None = None  # smoothed time per output token: how fast a request runs here
    prefill_s_per_token: float | None = None  # smoothed prefill seconds per prompt token not cached
    decode_s_per_request: float | None = None  # smoothed decode seconds per request
    fits: bool = True  # the model fits this endpoint's GPU memory (model_aware)
    preferred: bool = False  # the endpoint's GPU class is one the model prefers (model_aware)
    # False: its probes have gone unanswered for UNREACHABLE_AFTER scrapes in a row. The
    # control plane cannot see it; whether it is held out is the cluster's call
    # (balancing/sight.py), because the proxies may well reach it.
    in_sight: bool = True
    # vLLM's LoRA adapters, from the newest page as running and waiting are (so as old as
    # `age_s`): its running and waiting lists (a vLLM 0.32 names every adapter with a request
    # in flight in both; one loaded but idle is in neither), and its adapter slots
    # (--max-loras). None: unknown (no page, a server without them, or its series refused);
    # an empty tuple: known to hold none (docs/signals.md#lora-adapters).
    lora_running: tuple[str, ...] | None = None
    lora_waiting: tuple[str, ...] | None = None
    max_lora: int | None = None


def counted(figure: float | None) -> float:
    """A figure as the weights and the demand counts take it: one never read counts as 0,
    as it did before unknown was told apart (the weights must not move for it)."""
    return 0.0 if figure is None else figure
