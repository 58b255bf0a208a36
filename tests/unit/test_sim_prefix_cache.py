"""The emulator's prefix cache (sim/prefix_cache.py): whole blocks of a matching prefix hit,
an LRU bounded by the KV capacity evicts, and cached tokens skip prefill."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.sim.emulator_engine import LiveBatchingServer
from controlplane.sim.prefix_cache import BLOCK_TOKENS, PrefixCache
from controlplane.sim.service import ServerSpec

SYSTEM = [f"s{i}" for i in range(4 * BLOCK_TOKENS)]  # a 64-token system prompt


def test_a_shared_approximates_in_whole_blocks() -> None:
    c = PrefixCache(1000)
    assert c.admit([*SYSTEM, "hello", "there"]) == 0
    assert c.admit([*SYSTEM, "another", "question"]) == 4 * BLOCK_TOKENS
    assert c.admit(SYSTEM[:40]) == 2 * BLOCK_TOKENS  # a partial block never hits
    before = (c.queries, c.hits, len(c))
    assert c.peek([*SYSTEM, "x"]) == 4 * BLOCK_TOKENS and (c.queries, c.hits, len(c)) == before
    assert c.queries == 66 + 66 + 40 and c.hits == 64 + 32


def test_a_different_start_misses_even_with_the_same_later_text() -> None:
    c = PrefixCache(1000)
    c.admit(SYSTEM)
    assert c.admit(["other", *SYSTEM[1:]]) == 0


def test_the_least_recently_used_blocks_go_first() -> None:
    c = PrefixCache(4)  # four blocks: one 64-token prompt
    other = [f"o{i}" for i in range(4 * BLOCK_TOKENS)]
    c.admit(SYSTEM)
    c.admit(other)  # evicts SYSTEM's blocks
    assert len(c) == 4
    assert c.admit(SYSTEM) == 0
    assert PrefixCache(0).admit(SYSTEM) == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["a", "b", "c"]), max_size=80), max_size=20), st.integers(0, 20))
def test_hits_never_exceed_the_prompt_or_the_capacity(prompts: list[list[str]], capacity: int) -> None:
    c = PrefixCache(capacity)
    for p in prompts:
        hit = c.admit(p)
        assert 0 <= hit <= len(p) and hit % BLOCK_TOKENS == 0
        assert hit <= capacity * BLOCK_TOKENS
        assert len(c) <= capacity


def test_cached_tokens_skip_prefill() -> None:
    async def run() -> tuple[float, float]:
        engine = LiveBatchingServer(ServerSpec(slots=2, prefill_s_per_token=0.001, decode_s_per_token=0.001))
        async with engine.admit(500, 1) as cold:
            pass
        async with engine.admit(500, 1, cached_tokens=400) as warm:
            pass
        return cold.first_token - cold.started, warm.first_token - warm.started

    cold, warm = asyncio.run(run())
    assert abs(cold - 0.5) < 1e-9 and abs(warm - 0.1) < 1e-9
