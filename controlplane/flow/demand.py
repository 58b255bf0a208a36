"""Requests waiting in the pickers' queues, as each picker last reported them (pure): demand
for the autoscaler (docs/flow-control.md#autoscaling), so a saturated model asks for
replicas before its servers' own queues show it.

A report names its picker and, per model, the requests waiting. Only the fleet's models
count (`models`), at most MAX_REQUESTS per model and report, and at most MAX_PICKERS pickers
are remembered (the least recently heard forgotten first): a caller with the token cannot
grow the control plane or invent models. A report older than MAX_AGE_S counts for nothing
(a picker gone, or its queue drained and it stopped reporting).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping

MAX_PICKERS = 64
MAX_AGE_S = 5.0
MAX_REQUESTS = 1_000_000  # per model and report: a queue's bound is at most this (fleet/schema_policies.py)


class PickerQueues:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._reports: OrderedDict[str, tuple[float, dict[str, int]]] = OrderedDict()

    def report(self, picker: str, queued: Mapping[str, int], models: Collection[str]) -> None:
        """`picker`'s queues now: model -> requests waiting (models not in `models` dropped,
        counts clamped to 0..MAX_REQUESTS)."""
        kept = {m: min(MAX_REQUESTS, max(0, int(n))) for m, n in queued.items() if m in models}
        self._reports[picker[:256]] = (self.clock(), kept)
        self._reports.move_to_end(picker[:256])
        while len(self._reports) > MAX_PICKERS:
            self._reports.popitem(last=False)

    def demand(self) -> dict[str, float]:
        """Requests waiting per model over every fresh report."""
        now = self.clock()
        out: dict[str, float] = {}
        for at, queued in self._reports.values():
            if now - at > MAX_AGE_S:
                continue
            for model, n in queued.items():
                out[model] = out.get(model, 0.0) + n
        return out


def combined(*parts: Callable[[], Mapping[str, float]] | None) -> Callable[[], Mapping[str, float]]:
    """One demand source from several (the holding service's, the pickers'): summed per model."""

    def total() -> dict[str, float]:
        out: dict[str, float] = {}
        for part in parts:
            if part is None:
                continue
            for model, n in part().items():
                out[model] = out.get(model, 0.0) + n
        return out

    return total
