"""L8 without a model: the chained block keys and the ref-counted allocator with its cached-free LRU."""

from __future__ import annotations

import pytest

from l2_paged import OutOfBlocksError
from l8_prefix import PrefixBlockAllocator, block_key, chain_keys
from probes_l8 import chain_keys_in_new_processes

pytestmark = [pytest.mark.l8]

X = [11, 12, 13, 14]  # one block's worth of tokens (block size 4)


# ---------------------------------------------------------------- the hash chain

# A key that names its whole prefix, not only its own tokens, is what makes a hit safe: most of
# block_key's points.
@pytest.mark.points(6)
def test_same_tokens_after_another_prefix_or_at_another_position_get_another_key():
    p1, p2 = [1, 2, 3, 4], [1, 2, 3, 5]
    k1, k2 = chain_keys(p1 + X, 4), chain_keys(p2 + X, 4)
    assert k1[1] != k2[1]  # block X after a different prefix: no match
    x_first, x_second = chain_keys(X + X, 4)
    assert x_first != x_second  # the same four tokens at positions 0..3 and 4..7
    assert chain_keys(p1 + [9, 9, 9, 9], 4)[0] == k1[0]  # a shared first block does match
    assert block_key(None, X) == block_key(b"", X) != block_key(k1[0], X)
    assert block_key(None, [1, 2, 3, 4]) != block_key(None, [257, 2, 3, 4])  # every bit of an id counts
    assert block_key(None, [70_000, 2, 3, 4]) != block_key(None, [70_000 + 2**32, 2, 3, 4])


@pytest.mark.points(1)
def test_only_full_blocks_get_keys():
    assert len(chain_keys(list(range(9)), 4)) == 2  # 4 + 4 + a partial block of 1
    assert len(chain_keys(list(range(3)), 4)) == 0
    assert chain_keys(list(range(9)), 4) == chain_keys(list(range(8)), 4)


@pytest.mark.points(1)
def test_keys_do_not_depend_on_token_boundaries_being_guessed():
    """Tokens are hashed as fixed-width integers: [1, 23] and [12, 3] must differ (a str join would not)."""
    assert block_key(None, [1, 23]) != block_key(None, [12, 3])
    assert block_key(None, [2**40]) != block_key(None, [0, 256])


@pytest.mark.points(1)
def test_keys_are_blake2b_128_over_the_parent_then_the_tokens_as_little_endian_int64():
    """L8 §2.1's packing, computed independently: the parent's bytes, then each token as `<q`."""
    import hashlib
    import struct

    def expected(parent: bytes, tokens: list[int]) -> bytes:
        return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()

    first = block_key(None, X)
    assert type(first) is bytes and first == expected(b"", X)
    assert block_key(first, [5, -1, 2**40, 0]) == expected(first, [5, -1, 2**40, 0])  # a negative id packs too
    assert block_key(None, [-1]) != block_key(None, [-2])


@pytest.mark.points(2)
def test_keys_are_the_same_in_another_process_with_another_hash_seed():
    tokens = list(range(1000, 1037))
    here = [k.hex() for k in chain_keys(tokens, 16)]
    outs = chain_keys_in_new_processes(tokens, 16, ["1", "12345"])
    assert outs[0] == outs[1] == here and len(here) == 2


# ---------------------------------------------------------------- the allocator

def keyed_blocks(alloc: PrefixBlockAllocator, tokens: list[int]) -> list[int]:
    """Allocate blocks for `tokens` (full blocks only) and key them, as the engine does after a forward."""
    keys = chain_keys(tokens, alloc.block_size)
    blocks = alloc.alloc_blocks(len(keys))
    for b, k in zip(blocks, keys):
        alloc.register(b, k)
    return blocks


@pytest.mark.points(2)
def test_a_freed_keyed_block_stays_cached_and_can_be_hit_again():
    alloc = PrefixBlockAllocator(6, 4)
    a = keyed_blocks(alloc, list(range(12)))
    alloc.free(a)
    assert alloc.num_free == 6 and alloc.num_used == 0 and list(alloc.cached_free) == a[::-1]
    assert alloc.lookup(chain_keys(list(range(12)), 4)) == a  # still findable
    assert alloc.lookup(chain_keys(list(range(8)) + [0, 0, 0, 0], 4)) == a[:2]  # longest run from the start
    alloc.acquire(a[:2])  # a hit revives them: out of the LRU, counted as used again
    assert [alloc.ref_count[b] for b in a] == [1, 1, 0] and list(alloc.cached_free) == [a[2]]
    assert alloc.num_used == 2
    alloc.check()


# The eviction order is what makes a prefix cache hit: it carries most of alloc_blocks' points.
@pytest.mark.points(4)
def test_cached_blocks_are_evicted_least_recently_used_first_and_tail_first():
    alloc = PrefixBlockAllocator(8, 4)
    tokens_a, tokens_b = list(range(12)), list(range(100, 112))
    a = keyed_blocks(alloc, tokens_a)
    b = keyed_blocks(alloc, tokens_b)
    alloc.free(a)  # A finishes first ...
    alloc.free(b)  # ... then B
    assert len(alloc.free_blocks) == 2 and len(alloc.cached_free) == 6
    with pytest.raises(OutOfBlocksError):  # more than free + cached: refused before evicting anything
        alloc.alloc_blocks(9)
    assert len(alloc.cached_free) == 6 and alloc.evicted_cached == 0
    new = alloc.alloc_blocks(3)  # 2 plain free blocks, then 1 eviction: A's, and A's last block
    assert a[2] in new and alloc.evicted_cached == 1
    assert alloc.lookup(chain_keys(tokens_a, 4)) == a[:2]  # A's head still hits
    assert alloc.lookup(chain_keys(tokens_b, 4)) == b
    more = alloc.alloc_blocks(2)  # the rest of A goes before any of B
    assert sorted(more) == sorted(a[:2]) and alloc.evicted_cached == 3
    assert alloc.lookup(chain_keys(tokens_a, 4)) == [] and alloc.lookup(chain_keys(tokens_b, 4)) == b
    assert not set(a) & set(alloc.key_of)  # no stale key entries for evicted blocks
    alloc.check()


@pytest.mark.points(2)
def test_a_touched_cached_block_moves_to_the_recent_end():
    alloc = PrefixBlockAllocator(4, 4)
    a = keyed_blocks(alloc, list(range(4)))
    b = keyed_blocks(alloc, list(range(50, 54)))
    alloc.free(a)
    alloc.free(b)
    alloc.acquire(a)  # A is used again (a cache hit) ...
    alloc.free(a)  # ... and released: now B is the older one
    alloc.alloc_blocks(3)
    assert alloc.key_of.get(a[0]) is not None and b[0] not in alloc.key_of


@pytest.mark.points(2)
def test_shared_blocks_need_every_reference_dropped():
    alloc = PrefixBlockAllocator(4, 4)
    a = keyed_blocks(alloc, list(range(8)))
    alloc.acquire(a)  # a second table holds them
    assert alloc.num_shared == 2 and alloc.num_used == 2
    alloc.free(a)
    assert [alloc.ref_count[b] for b in a] == [1, 1] and not alloc.cached_free
    alloc.free(a)
    assert [alloc.ref_count[b] for b in a] == [0, 0] and list(alloc.cached_free) == a[::-1]  # tail first
    alloc.check()


# A reference dropped twice frees a block another request still reads: most of free's points.
@pytest.mark.points(4)
def test_bad_frees_change_nothing_double_repeated_or_unknown():
    alloc = PrefixBlockAllocator(4, 4)
    a = keyed_blocks(alloc, list(range(8)))
    alloc.free(a)
    before = (list(alloc.ref_count), list(alloc.cached_free), list(alloc.free_blocks))
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a[0]])
    (c,) = alloc.alloc_blocks(1)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([c, c])  # one reference, dropped twice in one call
    with pytest.raises(ValueError, match="not in this pool"):
        alloc.free([c, 99])
    assert alloc.ref_count[c] == 1 and all(n >= 0 for n in alloc.ref_count)
    alloc.free([c])
    assert (list(alloc.ref_count), sorted(alloc.cached_free), sorted(alloc.free_blocks)) == \
        (before[0], sorted(before[1]), sorted(before[2]))
    alloc.check()


@pytest.mark.points(1)
def test_alloc_counts_cached_blocks_as_free_but_never_more():
    alloc = PrefixBlockAllocator(3, 4)
    alloc.free(keyed_blocks(alloc, list(range(12))))
    assert alloc.num_free == 3
    with pytest.raises(OutOfBlocksError):
        alloc.alloc_blocks(4)
    assert len(alloc.cached_free) == 3 and alloc.evicted_cached == 0  # a refused request evicts nothing
    assert len(alloc.alloc_blocks(3)) == 3 and alloc.evicted_cached == 3 and not alloc.block_of


@pytest.mark.points(1)
def test_register_keeps_the_first_block_for_a_key():
    alloc = PrefixBlockAllocator(4, 4)
    key = chain_keys(X, 4)[0]
    first, second = alloc.alloc_blocks(2)  # two requests computed the same block independently
    alloc.register(first, key)
    alloc.register(second, key)
    assert alloc.block_of[key] == first and second not in alloc.key_of
    alloc.free([first, second])
    assert list(alloc.cached_free) == [first] and second in alloc.free_blocks  # the duplicate is plain free
    alloc.check()
