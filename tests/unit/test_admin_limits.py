"""The operator API checks what cpctl checks, and bounds what it stores and echoes (issue 16,
finding F11): non-finite numbers, negative deadlines, oversized reasons and names."""

from __future__ import annotations

import math

import pytest

from controlplane import limits
from controlplane.admin.service import _start_request, check_request
from controlplane.rollout.controller import CommandRejected
from controlplane.rollout.machine import RolloutRejected, RolloutSpec
from controlplane.v1 import endpoint_pb2, rollout_pb2


def rejected(request: object) -> str:
    with pytest.raises(CommandRejected) as e:
        check_request(request)
    assert e.value.code == "INVALID_ARGUMENT"
    return str(e.value)


@pytest.mark.parametrize(
    "field", ["interval_seconds", "max_latency_ratio", "max_error_rate", "ack_deadline_seconds"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(field: str, value: float) -> None:
    req = rollout_pb2.StartRolloutRequest(model="m", to_version="v2", **{field: value})
    assert rejected(req) == f"{field}: expected a finite number, got {value}"


def test_a_nan_drain_timeout_is_refused() -> None:
    assert "timeout_seconds: expected a finite number" in rejected(
        endpoint_pb2.DrainRequest(address="127.0.0.1:8000", timeout_seconds=math.nan)
    )


def test_oversized_reasons_and_names_are_refused_without_being_echoed() -> None:
    big = "x" * (limits.API_REASON_MAX_CHARS + 1)
    msg = rejected(endpoint_pb2.DrainRequest(address="127.0.0.1:8000", reason=big))
    assert msg == f"reason: at most {limits.API_REASON_MAX_CHARS} characters, got {len(big)}"
    msg = rejected(rollout_pb2.RolloutCommand(model="m" * 20_000, reason="ok"))
    assert msg == f"model: at most {limits.API_NAME_MAX_CHARS} characters, got 20000" and "mmm" not in msg
    check_request(rollout_pb2.RolloutCommand(model="m" * limits.API_NAME_MAX_CHARS, reason="r" * 1024))


def test_a_negative_ack_deadline_through_the_api_is_refused() -> None:
    spec = _start_request(
        rollout_pb2.StartRolloutRequest(model="m", to_version="v2", ack_deadline_seconds=-5)
    )
    with pytest.raises(RolloutRejected) as e:
        spec.check()
    assert str(e.value) == "--ack-deadline: must be greater than 0, got -5"


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"interval_s": math.nan}, "--interval: expected a finite number"),
        ({"max_latency_ratio": math.nan}, "--max-latency-ratio: expected a finite number"),
        ({"ack_deadline_s": math.inf}, "--ack-deadline: expected a finite number"),
        ({"min_requests": -1}, "--min-requests: must be 0 or more"),
    ],
)
def test_the_spec_itself_refuses_non_finite_values(kwargs: dict[str, float], why: str) -> None:
    with pytest.raises(RolloutRejected) as e:
        RolloutSpec("m", "v1", "v2", **kwargs).check()  # type: ignore[arg-type]
    assert str(e.value).startswith(why)
