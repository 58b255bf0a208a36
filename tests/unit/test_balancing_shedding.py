from __future__ import annotations

import pytest

from controlplane.balancing.shedding import saturation, shed_classes
from controlplane.fleet.model import PriorityClass
from controlplane.signals.load import EndpointLoad

CLASSES = (
    PriorityClass("premium", high=True),
    PriorityClass("standard", shed_at=1.0),
    PriorityClass("batch", shed_at=0.5),
)


def test_saturation_is_the_queue_against_the_batch_of_ready_servers() -> None:
    loads = [
        EndpointLoad("a", running=4, waiting=2),
        EndpointLoad("b", running=4, waiting=6),
        EndpointLoad("cold", ready=False, running=0, waiting=50),
    ]
    assert saturation(loads) == 1.0
    assert saturation([EndpointLoad("a", running=0, waiting=3)]) == 3.0  # nothing runs: per one
    assert saturation([EndpointLoad("a", running=8)]) == 0.0  # busy but no queue


@pytest.mark.parametrize(
    ("level", "before", "after"),
    [
        (0.0, set(), set()),
        (0.5, set(), {"batch"}),
        (0.99, set(), {"batch"}),
        (1.0, set(), {"batch", "standard"}),
        (0.6, {"batch", "standard"}, {"batch", "standard"}),  # hysteresis: not below half yet
        (0.49, {"batch", "standard"}, {"batch"}),
        (0.24, {"batch"}, set()),
        (100.0, set(), {"batch", "standard"}),  # premium is never shed by the signals
    ],
)
def test_shed_classes_with_hysteresis(level: float, before: set[str], after: set[str]) -> None:
    assert shed_classes(CLASSES, level, frozenset(before)) == after


def test_a_lower_class_is_always_shed_when_a_higher_one_is() -> None:
    for level in [x / 20 for x in range(0, 60)]:
        for before in (frozenset(), frozenset({"batch"}), frozenset({"batch", "standard"})):
            out = shed_classes(CLASSES, level, before)
            assert "standard" not in out or "batch" in out
