"""The emulator's prefix cache (pure), in the manner of vLLM's automatic prefix caching.

A prompt is cut into blocks of `BLOCK_TOKENS` tokens. A block is named by a hash of every
token up to its end, so a block is found only when the whole prompt before it matches too:
the cache answers "the longest cached prefix, in whole blocks". Blocks are kept in LRU order
up to `capacity_blocks` (the server's KV capacity over the block size); a lookup touches
the blocks it used and adds the prompt's other full blocks, evicting the least recently
used. Cached prompt tokens skip prefill: that is the time-to-first-token a server with the
right cache wins.

A request served by a LoRA adapter caches its blocks apart: vLLM keys a block by the adapter
too, so the same prompt under another adapter (or the base model) is another block.

Counters as vLLM exports them: `queries` (prompt tokens looked up) and `hits` (of those,
tokens found cached).

With a `listener` (sim/kv_publisher.py), every change is told as vLLM's KV events tell it:
the blocks a prompt stored (their hashes, the block before the first, their token ids, the
LoRA adapter if any) and the blocks evicted. A block's hash is the first 8 bytes of its key;
a token's id is the token itself where it is a number (a prompt tokenized with the model's
tokenizer), else a stable 31-bit hash of it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

BLOCK_TOKENS = 16  # vLLM's default block size


def block_keys(tokens: Sequence[str], adapter: str | None = None) -> list[bytes]:
    """The key of every full block: a running hash of the tokens up to its end (and of the
    LoRA adapter the prompt runs with, if any)."""
    keys = []
    h = hashlib.blake2b(digest_size=16)
    if adapter is not None:
        h.update(b"lora\x00" + adapter.encode() + b"\x00")
    for i in range(len(tokens) // BLOCK_TOKENS):
        for t in tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]:
            h.update(t.encode())
            h.update(b"\x00")
        keys.append(h.copy().digest())
    return keys


def block_hash(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")


def token_id(token: str) -> int:
    if token.isdigit() and len(token) < 10:
        return int(token)
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=4).digest(), "big") >> 1


class Listener(Protocol):
    def stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: str | None = None,
    ) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...


class PrefixCache:
    def __init__(self, capacity_blocks: int, listener: Listener | None = None) -> None:
        self.listener = listener
        self.capacity_blocks = max(0, capacity_blocks)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens found cached

    def __len__(self) -> int:
        return len(self._blocks)

    def peek(self, tokens: Sequence[str], adapter: str | None = None) -> int:
        """The cached prefix in tokens, without touching or adding anything."""
        cached = 0
        for k in block_keys(tokens, adapter):
            if k not in self._blocks:
                break
            cached += 1
        return cached * BLOCK_TOKENS

    def admit(self, tokens: Sequence[str], adapter: str | None = None) -> int:
        """Look the prompt up and cache its blocks (under `adapter`, the LoRA adapter it runs
        with, if any); return the cached prefix in tokens."""
        keys = block_keys(tokens, adapter)
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
        evicted = []
        while len(self._blocks) > self.capacity_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        if self.listener is not None and self.capacity_blocks:
            if len(keys) > cached:
                told = (
                    [block_hash(k) for k in keys[cached:]],
                    block_hash(keys[cached - 1]) if cached else None,
                    [token_id(t) for t in tokens[cached * BLOCK_TOKENS : len(keys) * BLOCK_TOKENS]],
                    BLOCK_TOKENS,
                )
                if adapter is None:
                    self.listener.stored(*told)
                else:  # as vLLM names the adapter of the blocks it stored (lora_name)
                    self.listener.stored(*told, lora=adapter)
            if evicted:
                self.listener.removed([block_hash(k) for k in evicted])
        hit = cached * BLOCK_TOKENS
        self.queries += len(tokens)
        self.hits += hit
        return hit
