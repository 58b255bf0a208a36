"""picker/choose.py with the precise prefix index: the blocks a server's events show cached
weigh against its expected time (pure)."""

from __future__ import annotations

from collections import Counter

import pytest
from envoy.config.core.v3 import health_check_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.kvcache import wire
from controlplane.kvcache.blocks import prompt_keys
from controlplane.picker.choose import KV_STALE_S, KvAsk, PickerState, ServerLoad
from tests.unit.test_picker_choose import _cla

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
PROMPT = list(range(1000, 1000 + 20 * 16))  # 20 blocks


def state_with(*servers: str, slots: float = 4.0, capacity: dict[str, float] | None = None) -> PickerState:
    state = PickerState()
    state.assign([_cla("m@v1", [(s, 10, health_check_pb2.HEALTHY) for s in servers])])
    capacity = capacity or {}
    state.observe({s: ServerLoad(0.0, 0.0, capacity.get(s, 1.0), running=0.0, waiting=0.0) for s in servers})
    state.kv_publishers = set(servers)
    for s in servers:
        state.slots[s] = slots
        # publishing (a block stored and evicted: its block size is known), empty
        events = [wire.stored([1], None, list(range(16)), 16), wire.removed([1])]
        state.kv.apply(s, wire.read(wire.frames(0, 0.0, events)), 0.0)
    return state


def hold(state: PickerState, server: str, tokens: list[int], seq: int = 1) -> None:
    n = len(tokens) // 16
    ev = wire.stored([hash((server, i)) % (1 << 62) for i in range(n)], None, tokens[: n * 16], 16)
    state.kv_event(server, wire.read(wire.frames(seq, 0.0, [ev])), 0.0)


def ask(tokens: list[int]) -> KvAsk:
    return KvAsk({16: prompt_keys(tokens, 16)}, len(tokens))


def test_the_server_holding_the_prompt_takes_it_and_the_pick_says_how_many_blocks() -> None:
    state = state_with(A, B, C)
    hold(state, B, PROMPT)
    got = state.pick("m@v1", 0.0, kv=ask(PROMPT))
    assert got.servers[0] == B and got.reason == "kv_hit" and got.kv_blocks == 20
    # A prompt sharing only its first 5 blocks still goes where those are.
    other = PROMPT[: 5 * 16] + list(range(9000, 9000 + 15 * 16))
    got = state.pick("m@v1", 0.0, kv=ask(other))
    assert got.servers[0] == B and got.kv_blocks == 5


def test_the_longer_match_wins_between_equal_servers() -> None:
    state = state_with(A, B)
    hold(state, A, PROMPT[: 4 * 16])
    hold(state, B, PROMPT[: 12 * 16])
    assert state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] == B


def test_a_hit_on_an_idle_slow_server_loses_to_an_idle_fast_one() -> None:
    state = state_with(A, B, capacity={A: 0.35, B: 1.0})
    hold(state, A, PROMPT)
    got = state.pick("m@v1", 0.0, kv=ask(PROMPT))
    assert got.servers[0] == B and got.reason == "least_loaded"
    # ...but not to a fast one only a little faster.
    state = state_with(A, B, capacity={A: 0.9, B: 1.0})
    hold(state, A, PROMPT)
    assert state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] == A


def timed(state: PickerState, times: dict[str, tuple[float, float]], capacity: dict[str, float]) -> None:
    """The servers' pages show (prefill s per uncached prompt token, decode s per request)."""
    state.observe(
        {
            s: ServerLoad(
                0.0, 0.0, capacity[s], running=0.0, waiting=0.0, prefill_s_per_token=p, decode_s_per_request=d
            )
            for s, (p, d) in times.items()
        }
    )


def test_where_the_pages_show_prefill_dominating_a_slow_server_holding_the_prompt_wins() -> None:
    capacity = {A: 0.35, B: 1.0}
    # The prompt's 320 tokens take 0.32 s to compute, its decode 0.05 s: holding the prompt
    # saves 86% of the request's service, more than the slow server's speed costs it.
    state = state_with(A, B, capacity=capacity)
    timed(state, {A: (0.001, 0.05), B: (0.001, 0.05)}, capacity)
    hold(state, A, PROMPT)
    got = state.pick("m@v1", 0.0, kv=ask(PROMPT))
    assert got.servers[0] == A and got.reason == "kv_hit"
    # Where decode dominates (2 s a request), the prompt saves 14%: the idle fast server wins.
    state = state_with(A, B, capacity=capacity)
    timed(state, {A: (0.001, 2.0), B: (0.001, 2.0)}, capacity)
    hold(state, A, PROMPT)
    assert state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] == B


def test_a_server_without_times_is_weighed_with_its_peers_and_none_with_the_default_share() -> None:
    capacity = {A: 0.35, B: 1.0}
    state = state_with(A, B, capacity=capacity)
    state.observe(  # only the fast one's page shows them
        {
            A: ServerLoad(0.0, 0.0, 0.35, running=0.0, waiting=0.0),
            B: ServerLoad(
                0.0, 0.0, 1.0, running=0.0, waiting=0.0, prefill_s_per_token=0.001, decode_s_per_request=0.05
            ),
        }
    )
    hold(state, A, PROMPT)
    assert state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] == A  # B's figures stand for A's
    # Nonsense figures (negative, not finite) are unknown: the default share, and the fast one.
    state = state_with(A, B, capacity=capacity)
    timed(state, {A: (-1.0, 0.05), B: (float("nan"), 0.05)}, capacity)
    hold(state, A, PROMPT)
    assert state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] == B


def test_a_prompt_held_nowhere_goes_to_the_equal_server_holding_the_least() -> None:
    state = state_with(A, B, C)
    hold(state, A, list(range(5000, 5000 + 30 * 16)))  # other prompts: A holds 31 blocks,
    hold(state, C, list(range(7000, 7000 + 10 * 16)))  # C 11 and B 1
    got = state.pick("m@v1", 0.0, kv=ask(PROMPT))
    assert got.servers == (B, C, A) and got.reason == "least_loaded"
    # Load still comes first: a busier server holding less is not preferred.
    state.started(B, 0.0)
    state.started(C, 0.0)
    assert state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] == A


def test_a_hit_on_a_full_server_loses_to_a_free_one() -> None:
    state = state_with(A, B, slots=2.0)
    hold(state, A, PROMPT)
    state.started(A, 0.0)
    state.started(A, 0.0)  # A: 2 of 2 slots busy
    assert state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] == B


def test_where_a_clusters_prompts_are_mostly_cached_a_short_wait_where_it_is_held_wins() -> None:
    """A wait for a slot is a wait for the requests ahead, and where those are mostly cached
    they are short: the picker learns the share of a whole service its picks take."""
    state = state_with(A, B, slots=2.0)
    other = list(range(5000, 5000 + 20 * 16))
    hold(state, A, PROMPT)
    hold(state, B, other)
    assert state.kv_incurred.get("m@v1", 1.0) == 1.0  # nothing learnt: whole services
    for _ in range(100):  # prompts held where they go: each takes half a service (the default share)
        state.done(state.pick("m@v1", 0.0, kv=ask(other)).servers[0])
    assert 0.45 < state.kv_incurred["m@v1"] < 0.6
    state.started(A, 0.0)
    state.started(A, 0.0)  # A: 2 of 2 slots busy, and it holds the prompt
    assert state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] == A
    state.done(A)
    for _ in range(4):  # a long queue still loses to a free server
        state.started(A, 0.0)
    assert state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] == B


def test_prompts_held_nowhere_teach_whole_services() -> None:
    state = state_with(A, B)
    for i in range(50):
        prompt = list(range(100_000 * (i + 1), 100_000 * (i + 1) + 20 * 16))
        state.done(state.pick("m@v1", 0.0, kv=ask(prompt)).servers[0])
    assert state.kv_incurred["m@v1"] == pytest.approx(1.0)


def test_a_hot_prompt_spreads_instead_of_piling_up() -> None:
    state = state_with(A, B, C, slots=2.0)
    hold(state, A, PROMPT)
    firsts = Counter(state.pick("m@v1", 0.0, kv=ask(PROMPT)).servers[0] for _ in range(12))
    assert firsts[A] >= 2 and len(firsts) == 3, firsts
    assert max(firsts.values()) <= 6, firsts


def test_a_server_quiet_after_a_pick_that_should_have_stored_blocks_is_scored_by_the_approximate_index() -> (
    None
):
    state = state_with(A, B)
    first = state.pick("m@v1", 0.0, kv=ask(PROMPT))  # a miss: the server picked will store blocks
    chosen = first.servers[0]
    assert state.kv_fresh(chosen, KV_STALE_S)
    assert not state.kv_fresh(chosen, KV_STALE_S + 0.1)  # it never published them
    # Stale: its events say nothing; the approximate index (where the prompt went) does.
    again = state.pick("m@v1", KV_STALE_S + 0.1, kv=ask(PROMPT))
    assert again.servers[0] == chosen and again.reason == "approximate"
    assert state.kv_stale_picks == 1
    # It publishes again: fresh.
    hold(state, chosen, PROMPT, seq=1)
    assert state.kv_fresh(chosen, KV_STALE_S + 1)
    assert state.pick("m@v1", KV_STALE_S + 1, kv=ask(PROMPT)).reason == "kv_hit"


def test_servers_that_never_published_are_scored_by_the_approximate_index() -> None:
    state = PickerState()
    state.assign([_cla("m@v1", [(A, 10, health_check_pb2.HEALTHY), (B, 10, health_check_pb2.HEALTHY)])])
    first = state.pick("m@v1", 0.0, kv=ask(PROMPT))
    state.done(first.servers[0], 0.1)
    again = state.pick("m@v1", 0.2, kv=ask(PROMPT))
    assert again.servers[0] == first.servers[0] and again.reason == "approximate"


@settings(max_examples=80, deadline=None)
@given(
    st.dictionaries(st.sampled_from([A, B, C]), st.integers(0, 20), min_size=1),
    st.dictionaries(st.sampled_from([A, B, C]), st.integers(0, 6)),
    st.dictionaries(st.sampled_from([A, B, C]), st.sampled_from([0.35, 1.0, 2.0])),
)
def test_picks_are_total_and_never_name_a_server_twice(
    held: dict[str, int], busy: dict[str, int], capacity: dict[str, float]
) -> None:
    state = state_with(A, B, C, capacity=capacity)
    for server, n in held.items():
        hold(state, server, PROMPT[: n * 16])
    for server, n in busy.items():
        for _ in range(n):
            state.started(server, 0.0)
    got = state.pick("m@v1", 0.0, kv=ask(PROMPT))
    assert len(set(got.servers)) == len(got.servers) == 3
    assert got.reason in ("kv_hit", "least_loaded", "approximate")
    assert got.kv_blocks == held.get(got.servers[0], 0)


def test_the_operator_apis_prefill_and_decode_times_reach_the_picker() -> None:
    from controlplane.picker.service import server_loads
    from controlplane.v1 import endpoint_pb2

    shown = endpoint_pb2.Endpoint(
        address=A, running=1, prefill_seconds_per_token=0.001, decode_seconds_per_request=0.3
    )
    unshown = endpoint_pb2.Endpoint(address=B, running=1)
    loads = server_loads([shown, unshown], 10.0)
    assert (loads[A].prefill_s_per_token, loads[A].decode_s_per_request) == (0.001, 0.3)
    assert loads[A].decode_in_prompt_tokens() == pytest.approx(300.0)
    assert loads[B].prefill_s_per_token is None and loads[B].decode_in_prompt_tokens() is None
