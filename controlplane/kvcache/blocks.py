"""A prompt's blocks, keyed as a server's cached blocks are keyed here (pure).

A server caches a prompt in blocks of `block_size` tokens and names each by a hash of its
tokens chained to the block before (so a block matches only where the whole prompt before it
matches too: the answer is "the longest cached prefix, in whole blocks"). The servers' own
hashes are not reproducible here (vLLM seeds them per process, and may hash with sha256 of
pickled tuples), so the index keys a block by its own chain over the token ids the events
carry: `block_key(parent, tokens, extra)`, Python's 64-bit hash of the tuple (computed in C:
a block costs well under a microsecond). A tuple of integers hashes alike in every process
(only strings and bytes are seeded per process), so the index's process and the picker's
key a block alike; an adapter's root is a digest of its name for the same reason. What else
a server hashed (`extra`) may hold strings: such blocks are keyed per process, and no
request's keys (which never carry extra keys) match them anyway. A request's token ids, chunked by the
same size and chained the same way, give the same keys; a partial last block is never
cached, so it is not keyed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

ROOT = 0  # the parent of a prompt's first block


def root(lora: str | None) -> int:
    """The parent key of a prompt's first block: the base model's, or an adapter's (a server
    hashes the adapter into its blocks: the same tokens under another adapter are not a hit)."""
    if lora is None:
        return ROOT
    # Not hash(): a string's hash is seeded per process, and the index's keys are computed in
    # a process of its own (picker/kv_process.py) while a request's are computed in the picker.
    digest = hashlib.blake2b(b"lora\x00" + lora.encode(errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def block_key(parent: int, tokens: tuple[int, ...], extra: Hashable | None = None) -> int:
    """The key of a block of `tokens` after the block keyed `parent`."""
    return hash((parent, tokens)) if extra is None else hash((parent, tokens, extra))


def prompt_keys(token_ids: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
    """The keys of a prompt's full blocks, first to last."""
    ids = tuple(token_ids)
    keys: list[int] = []
    parent = root(lora)
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, ids[start : start + block_size]))
        keys.append(parent)
    return keys
