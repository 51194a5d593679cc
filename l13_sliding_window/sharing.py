"""Prefix sharing on a hybrid model: keys per group, the hybrid hit rule, copy-on-write per group.

Every group keys a full block under L8's chained key (it names the whole prefix) tagged with the
group, `group_key(g, key)`: block i of group 0 and block i of group 1 hold different layers' K/V.

A hit of h blocks (the prompt's first h * block_size tokens) is usable when the next token, at
position h * block_size, can be computed from what is cached:

    full group       blocks 0 .. h-1, every one
    sliding group    blocks first_needed_position(W, h * bs) // bs .. h-1: its window only

    block_size 4, W 6, h 4 (16 tokens cached; position 16 reads 11..16)
    full group     [a][b][c][d]      all four cached: needed
    sliding group  [ ][ ][e][f]      blocks 2 and 3 needed (positions 8..15); 0 and 1 never read

So the full groups bound h from above (their longest cached run), and the sliding groups may lower
it: their blocks behind a window are freed as requests run, so a long prompt's early sliding
blocks are usually gone while its late ones are cached. Asking for every block of every group
(the rule of a cache that does not know about windows) makes such a prompt miss entirely.
"""

from __future__ import annotations

import dataclasses

from l8_prefix import PrefixBlockAllocator

from .groups import NULL_BLOCK, KvCacheGroup, first_needed_position
from .pool import GroupedKvPool
from .tables import HybridRequest, set_tables


def group_key(g: int, key: bytes) -> bytes:
    """L8's block key, within group g: the key a group's block is cached under."""
    return g.to_bytes(2, "little") + key


def hybrid_hit_blocks(keys: list[bytes], groups: list[KvCacheGroup], alloc: PrefixBlockAllocator,
                      block_size: int) -> int:
    """How many of the prompt's leading full blocks (keys, L8's chained keys, first to last) a
    request may take from the cache: the largest h such that every block the next token reads,
    in every group, is cached (`alloc.lookup` finds it under group_key(g, key); the allocator is
    asked through `lookup` only, since one may keep its keys within a tag of its own, as L12's does).

    Contract: full groups need blocks 0..h-1; a sliding group needs only the blocks holding
    positions first_needed_position(W, h * block_size) .. h * block_size - 1; h = 0 always
    qualifies; a larger h that qualifies wins even when a smaller one does not.
    """
    # BEGIN SOLUTION
    h = len(keys)
    for g, group in enumerate(groups):
        if not group.is_sliding:
            h = min(h, len(alloc.lookup([group_key(g, key) for key in keys])))

    def window_cached(h: int) -> bool:
        for g, group in enumerate(groups):
            first = first_needed_position(group.window, h * block_size) // block_size
            needed = [group_key(g, key) for key in keys[first:h]]
            if group.is_sliding and len(alloc.lookup(needed)) < len(needed):
                return False
        return True

    while h > 0 and not window_cached(h):
        h -= 1
    return h
    # END SOLUTION


def without_windows(groups: list[KvCacheGroup]) -> list[KvCacheGroup]:
    """The groups as a cache that ignores windows sees them (the rule the hybrid one replaces)."""
    return [dataclasses.replace(group, window=None) for group in groups]


def attach_cached_prefix(req: HybridRequest, keys: list[bytes], h: int, groups: list[KvCacheGroup],
                         alloc: PrefixBlockAllocator) -> None:
    """Give `req` the cached blocks of its first h blocks that its next token reads, in every
    group (NULL_BLOCK before a sliding group's window); it computes from position h * block_size."""
    # BEGIN SOLUTION
    bs, tables = alloc.block_size, []
    for g, group in enumerate(groups):
        first = first_needed_position(group.window, h * bs) // bs
        tables.append([NULL_BLOCK] * first + alloc.lookup([group_key(g, key) for key in keys[first:h]]))
    held = [b for table in tables for b in table if b != NULL_BLOCK]
    alloc.acquire(held)
    set_tables(req, tables if h else ())
    req.block_keys, req.cur_len = list(keys[:h]), h * bs
    # END SOLUTION


def shared_write_entries(req: HybridRequest, alloc: PrefixBlockAllocator) -> list[int]:
    """Groups whose block for the next position is shared (a fork's partial last block)."""
    i = req.cur_len // alloc.block_size
    return [g for g, table in enumerate(req.tables)
            if i < len(table) and table[i] != NULL_BLOCK and alloc.ref_count[table[i]] > 1]


def copy_on_write_tables(req: HybridRequest, alloc: PrefixBlockAllocator, pool: GroupedKvPool) -> int:
    """L8's copy-on-write in every group: a private copy of each shared block the next token is
    written to; returns the copies made."""
    # BEGIN SOLUTION
    groups = shared_write_entries(req, alloc)
    if not groups:
        return 0
    i, tables = req.cur_len // alloc.block_size, [list(table) for table in req.tables]
    fresh = alloc.alloc_blocks(len(groups))
    for g, new in zip(groups, fresh):
        old = tables[g][i]
        for k, v in zip(pool.k_block_tensors, pool.v_block_tensors):
            k[new], v[new] = k[old], v[old]
        tables[g][i] = new
    alloc.free([req.tables[g][i] for g in groups])  # one reference fewer on each shared block
    set_tables(req, tables)
    return len(groups)
    # END SOLUTION
