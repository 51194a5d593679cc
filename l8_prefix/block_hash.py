"""Keys for full blocks: a hash of the block's tokens chained with the previous block's key.

    block 0 tokens ──► key0 = H(b""   ‖ tokens[0:16])
    block 1 tokens ──► key1 = H(key0  ‖ tokens[16:32])
    block 2 tokens ──► key2 = H(key1  ‖ tokens[32:48])

key_i depends on every token before the block's end, so equal keys mean equal whole prefixes:
the same 16 tokens after a different prefix (or at a different position) get another key.
BLAKE2b over the tokens' little-endian int64 bytes is the same in every process and Python
version, and 128 bits make an accidental collision negligible; Python's hash() of a tuple is 64
bits, collides by design for some ints (hash(-1) == hash(-2)), and is not promised to be stable.
"""

from __future__ import annotations

import hashlib
import struct


def block_key(parent: bytes | None, tokens: list[int]) -> bytes:
    # BEGIN SOLUTION
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()
    # END SOLUTION


def chain_keys(tokens: list[int], block_size: int, parent: bytes | None = None) -> list[bytes]:
    """Keys of every *full* block of `tokens`; a partial tail has no key."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start:start + block_size])
        keys.append(parent)
    return keys


def tagged_key(tag: bytes, key: bytes) -> bytes:
    """`key` inside the namespace `tag`: equal only for an equal prefix under an equal tag. How a
    key that names tokens comes to name their K/V in one cache format too (L12's scales, L14's
    model and dtype), for any key, without the tokens."""
    return hashlib.blake2b(tag + key, digest_size=16).digest()
