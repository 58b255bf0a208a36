"""flow/demand.py: the pickers' queue reports as autoscaling demand (pure)."""

from __future__ import annotations

from controlplane.flow.demand import MAX_AGE_S, MAX_PICKERS, MAX_REQUESTS, PickerQueues, combined


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_fresh_reports_add_up_per_model_and_stale_ones_count_for_nothing() -> None:
    clock = Clock()
    q = PickerQueues(clock)
    q.report("p1", {"chat": 3, "code": 1}, {"chat", "code"})
    q.report("p2", {"chat": 4}, {"chat", "code"})
    assert q.demand() == {"chat": 7.0, "code": 1.0}
    q.report("p1", {"chat": 0}, {"chat", "code"})  # its queue drained: its last report counts
    assert q.demand() == {"chat": 4.0}
    clock.t += MAX_AGE_S + 0.1
    assert q.demand() == {}


def test_a_report_cannot_invent_models_grow_the_store_or_count_absurdly() -> None:
    q = PickerQueues(Clock())
    q.report("p", {"chat": 10**12, "nope": 5, "code": -3}, {"chat", "code"})
    assert q.demand() == {"chat": float(MAX_REQUESTS), "code": 0.0}
    for i in range(MAX_PICKERS * 3):
        q.report(f"p{i}" + "x" * 10_000, {"chat": 1}, {"chat"})
    assert len(q._reports) == MAX_PICKERS and all(len(k) <= 256 for k in q._reports)


def test_combined_sums_the_sources_per_model() -> None:
    total = combined(lambda: {"chat": 2.0}, None, lambda: {"chat": 1.0, "code": 4.0})
    assert total() == {"chat": 3.0, "code": 4.0}
