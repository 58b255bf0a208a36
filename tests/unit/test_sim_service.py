from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.sim.service import BatchingServer, ServerSpec

SPEC = ServerSpec(
    slots=2, speed=1.0, prefill_s_per_token=0.001, decode_s_per_token=0.01, kv_capacity_tokens=1000
)


def test_prefill_and_decode_times_scale_with_tokens_and_speed() -> None:
    fast = BatchingServer(SPEC)
    fast.submit(1, prompt_tokens=100, output_tokens=10, now=0.0)
    [done] = fast.advance(1.0)
    assert done.ttft_s == pytest.approx(0.1)
    assert done.latency_s == pytest.approx(0.2)
    slow = BatchingServer(ServerSpec(**{**SPEC.__dict__, "speed": 0.5}))
    slow.submit(1, prompt_tokens=100, output_tokens=10, now=0.0)
    [done] = slow.advance(1.0)
    assert done.latency_s == pytest.approx(0.4)


def test_requests_beyond_the_slots_queue_in_order() -> None:
    s = BatchingServer(SPEC)
    for i in range(4):
        s.submit(i, prompt_tokens=0, output_tokens=10, now=0.0)  # 0.1 s each
    assert (len(s.running), len(s.waiting)) == (2, 2)
    done = s.advance(0.15)
    assert [d.request_id for d in done] == [0, 1]
    assert (len(s.running), len(s.waiting)) == (2, 0)
    done = s.advance(1.0)
    assert [d.request_id for d in done] == [2, 3]
    assert all(d.started == pytest.approx(0.1) for d in done)  # started when slots freed


def test_kv_use_follows_tokens_in_flight() -> None:
    s = BatchingServer(SPEC)
    s.submit(1, prompt_tokens=300, output_tokens=100, now=0.0)  # prefill 0.3 s, decode 1 s
    s.advance(0.3)
    assert s.kv_use == pytest.approx(0.3)
    s.advance(0.8)
    assert s.kv_use == pytest.approx(0.35)  # 50 tokens generated
    s.advance(2.0)
    assert s.kv_use == 0.0


def test_time_does_not_go_backwards() -> None:
    s = BatchingServer(SPEC)
    s.advance(1.0)
    with pytest.raises(ValueError):
        s.advance(0.5)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.floats(0, 0.5), st.integers(0, 200), st.integers(1, 50)), max_size=30))
def test_every_request_completes_once_and_never_more_than_slots_run(
    reqs: list[tuple[float, int, int]],
) -> None:
    s = BatchingServer(SPEC)
    t = 0.0
    done = []
    for i, (gap, prompt, out) in enumerate(reqs):
        t += gap
        done += s.submit(i, prompt, out, t)
        assert len(s.running) <= SPEC.slots
    done += s.advance(t + 1000)
    assert sorted(d.request_id for d in done) == list(range(len(reqs)))
    assert all(d.submitted <= d.started <= d.first_token <= d.finished for d in done)
