"""Property-based fuzzing of the operator API's request validation (issue 16): any request
gives a valid spec or a precise refusal (INVALID_ARGUMENT), never another exception, and a
spec that passes has only finite numbers in range."""

from __future__ import annotations

import math
import os
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.admin.service import _start_request, check_request
from controlplane.rollout.controller import CommandRejected
from controlplane.rollout.machine import RolloutRejected
from controlplane.v1 import endpoint_pb2, rollout_pb2

N = int(os.environ.get("FUZZ_EXAMPLES", "300"))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64), st.just(0.0))
text = st.text(max_size=300)


@settings(max_examples=N, deadline=None)
@given(
    model=text,
    to_version=text,
    steps=st.lists(st.integers(0, 2**32 - 1), max_size=8),
    interval=floats,
    manual=st.booleans(),
    max_error_rate=st.one_of(st.none(), floats),
    max_latency_ratio=st.one_of(st.none(), floats),
    min_requests=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    ack=st.one_of(st.none(), floats),
    shadow=st.integers(0, 2**32 - 1),
)
def test_any_start_request_gets_a_spec_or_a_precise_refusal(
    model: str,
    to_version: str,
    steps: list[int],
    interval: float,
    manual: bool,
    max_error_rate: float | None,
    max_latency_ratio: float | None,
    min_requests: int | None,
    ack: float | None,
    shadow: int,
) -> None:
    req = rollout_pb2.StartRolloutRequest(
        model=model, to_version=to_version, steps=steps, interval_seconds=interval, manual=manual,
        shadow_percent=shadow,
    )  # fmt: skip
    if max_error_rate is not None:
        req.max_error_rate = max_error_rate
    if max_latency_ratio is not None:
        req.max_latency_ratio = max_latency_ratio
    if min_requests is not None:
        req.min_requests = min_requests
    if ack is not None:
        req.ack_deadline_seconds = ack
    try:
        check_request(req)
        spec = _start_request(req)
        spec = replace(spec, stable="the-stable")  # the controller fills it in from the fleet
        spec.check()
    except (CommandRejected, RolloutRejected) as e:
        assert e.code == "INVALID_ARGUMENT" or isinstance(e, CommandRejected), e
        assert str(e) and len(str(e)) < 2000  # precise, and never echoing a huge value
        return
    for v in (spec.interval_s, spec.max_error_rate, spec.max_latency_ratio, spec.ack_deadline_s):
        assert v is None or math.isfinite(v)
    assert spec.ack_deadline_s > 0 and 0 <= spec.max_error_rate <= 1 and spec.max_latency_ratio >= 1
    assert spec.steps[-1] == 100 and 0 <= spec.shadow_percent <= 100


@settings(max_examples=N, deadline=None)
@given(address=text, timeout=floats, reason=st.text(max_size=3000))
def test_any_drain_request_is_checked(address: str, timeout: float, reason: str) -> None:
    req = endpoint_pb2.DrainRequest(address=address, timeout_seconds=timeout, reason=reason)
    try:
        check_request(req)
    except CommandRejected as e:
        assert e.code == "INVALID_ARGUMENT" and len(str(e)) < 300
        return
    assert math.isfinite(req.timeout_seconds) and len(req.reason) <= 1024 and len(req.address) <= 256
