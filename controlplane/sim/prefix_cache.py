"""The emulator's prefix cache (pure), in the manner of vLLM's automatic prefix caching.

A prompt is cut into blocks of `BLOCK_TOKENS` tokens. A block is named by a hash of every
token up to its end, so a block is found only when the whole prompt before it matches too:
the cache answers "the longest cached prefix, in whole blocks". Blocks are kept in LRU order
up to `capacity_blocks` (the server's KV capacity over the block size); a lookup touches
the blocks it used and adds the prompt's other full blocks, evicting the least recently
used. Cached prompt tokens skip prefill: that is the time-to-first-token a server with the
right cache wins.

Counters as vLLM exports them: `queries` (prompt tokens looked up) and `hits` (of those,
tokens found cached).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 16  # vLLM's default block size


def block_keys(tokens: Sequence[str]) -> list[bytes]:
    """The key of every full block: a running hash of the tokens up to its end."""
    keys = []
    h = hashlib.blake2b(digest_size=16)
    for i in range(len(tokens) // BLOCK_TOKENS):
        for t in tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]:
            h.update(t.encode())
            h.update(b"\x00")
        keys.append(h.copy().digest())
    return keys


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(0, capacity_blocks)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens found cached

    def __len__(self) -> int:
        return len(self._blocks)

    def peek(self, tokens: Sequence[str]) -> int:
        """The cached prefix in tokens, without touching or adding anything."""
        cached = 0
        for k in block_keys(tokens):
            if k not in self._blocks:
                break
            cached += 1
        return cached * BLOCK_TOKENS

    def admit(self, tokens: Sequence[str]) -> int:
        """Look the prompt up and cache its blocks; return the cached prefix in tokens."""
        keys = block_keys(tokens)
        cached = 0
        for k in keys:
            if k not in self._blocks:
                break
            cached += 1
        for k in keys:
            if k in self._blocks:
                self._blocks.move_to_end(k)
            elif self.capacity_blocks:
                self._blocks[k] = None
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        hit = cached * BLOCK_TOKENS
        self.queries += len(tokens)
        self.hits += hit
        return hit
