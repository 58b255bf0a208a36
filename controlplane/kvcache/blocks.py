"""A prompt's blocks, keyed as a server's cached blocks are keyed here (pure).

A server caches a prompt in blocks of `block_size` tokens and names each by a hash of its
tokens chained to the block before (so a block matches only where the whole prompt before it
matches too: the answer is "the longest cached prefix, in whole blocks"). The servers' own
hashes are not reproducible here (vLLM seeds them per process, and may hash with sha256 of
pickled tuples), so the index keys a block by its own chain over the token ids the events
carry: `block_key(parent, tokens, lora, extra)`, 8 bytes of BLAKE2b. A request's token ids,
chunked by the same size and chained the same way, give the same keys; a partial last block
is never cached, so it is not keyed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence

ROOT = 0  # the parent of a prompt's first block


def root(lora: str | None) -> int:
    """The parent key of a prompt's first block: the base model's, or an adapter's (a server
    hashes the adapter into its blocks: the same tokens under another adapter are not a hit)."""
    if lora is None:
        return ROOT
    return int.from_bytes(hashlib.blake2b(lora.encode(errors="surrogatepass"), digest_size=8).digest(), "big")


def block_key(parent: int, tokens: Sequence[int], extra: Hashable | None = None) -> int:
    """The key of a block of `tokens` after the block keyed `parent`."""
    h = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    h.update(array("I", tokens).tobytes())
    if extra is not None:
        h.update(b"\x00extra")
        h.update(repr(extra).encode(errors="surrogatepass"))
    return int.from_bytes(h.digest(), "big")


def prompt_keys(token_ids: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
    """The keys of a prompt's full blocks, first to last."""
    keys: list[int] = []
    parent = root(lora)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
