"""Pure: what a response costs in tokens, from the charge descriptor Envoy sends when it ends
(routing/quotas.py builds it): its usage when the server said, else the most the request let
the server send. Never free, whatever the values say."""

from __future__ import annotations

import math

from controlplane.routing.quotas import COPIES_FIELDS, OUTPUT_LIMIT_FIELDS, PROMPT_BYTES_KEY, USAGE_KEY

MAX_USAGE = 10_000_000  # tokens one response may report; more is not a usage, it is a bug
DEFAULT_OUTPUT_ESTIMATE = 256  # output tokens charged when the request sets no output limit
MAX_COPIES = 128  # completions one request may ask for (n, best_of), as the estimate counts them
PROMPT_BYTES_PER_TOKEN = 4


def count(raw: str | None) -> int | None:
    """A whole, finite, non-negative number from a descriptor value (json_to_metadata writes
    a JSON number as text: "3000", "3000.000000"); None for anything else: absent, "none",
    negative, NaN, infinite, not a number, or longer than any number."""
    if raw is None:
        return None
    raw = raw.strip()
    if not raw or len(raw) > 40:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(min(value, 1e18))


def charged_tokens(entries: dict[str, str]) -> tuple[int, str]:
    """The tokens a response costs, and how they are known ("usage" or "estimate"):
    - its usage.total_tokens when the server sent a sane one (a whole number up to MAX_USAGE:
      a JSON answer's, or a stream's usage event);
    - else an estimate: the request's bytes / 4 for the prompt, plus the largest output limit
      it carried (max_tokens, max_completion_tokens, ...: OUTPUT_LIMIT_FIELDS; none:
      DEFAULT_OUTPUT_ESTIMATE) times the most completions it asked for (n, best_of, at most
      MAX_COPIES); at least 1 and at most MAX_USAGE."""
    usage = count(entries.get(USAGE_KEY))
    if usage is not None and usage <= MAX_USAGE:
        return usage, "usage"
    prompt = (count(entries.get(PROMPT_BYTES_KEY)) or 0) // PROMPT_BYTES_PER_TOKEN
    limits = [n for key in OUTPUT_LIMIT_FIELDS if (n := count(entries.get(key))) is not None]
    output = max(limits) if limits else DEFAULT_OUTPUT_ESTIMATE
    copies = max([n for key in COPIES_FIELDS if (n := count(entries.get(key))) is not None] or [1])
    copies = min(max(copies, 1), MAX_COPIES)
    return max(1, min(MAX_USAGE, min(prompt, MAX_USAGE) + min(output, MAX_USAGE) * copies)), "estimate"
