"""L13's per-group block tables and the hybrid hit rule, checked against their contracts
(lessons/L13-sliding-window.md §2): grow_tables covers every group in one all-or-nothing
allocation, keeps what a table holds and replaces the tables, never edits them in place; free_behind_window gives back exactly the blocks no later
token reads; hybrid_hit_blocks finds the longest cached prefix whose next token finds everything it
reads. What a token reads is listed here from L1's window_mask, not from the lesson's formulas."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from l1_contiguous import Qwen3Config, window_mask
from l2_paged import BlockAllocator, blocks_needed
from l8_prefix import PrefixBlockAllocator, chain_keys
from l13_sliding_window import (NULL_BLOCK, HybridRequest, KvCacheGroup, attach_cached_prefix, blocks_at_peak,
                                free_behind_window, group_key, group_size, grow_tables, hybrid_hit_blocks, kv_cache_groups,
                                layer_slots, release_tables, window_block_bound)
from probes_l13 import TaggedAllocator, grow_watched

pytestmark = pytest.mark.l13

FULL, SLIDING = KvCacheGroup((1, 3), None), KvCacheGroup((0, 2), 6)


def request(prompt_len: int = 40) -> HybridRequest:
    return HybridRequest(list(range(1, prompt_len + 1)), max_new_tokens=8)


def live(req: HybridRequest) -> list[int]:
    return [b for table in req.tables for b in table if b != NULL_BLOCK]


def positions_read(window: int | None, position: int) -> set[int]:
    """The positions a query at `position` reads, listed from L1's mask (full attention: all before it)."""
    keys = torch.arange(position + 1)
    if window is None:
        return set(range(position + 1))
    return set(keys[window_mask(torch.tensor([position]), keys, window)[0]].tolist())


# ---------------------------------------------------------------- grow_tables

def grow(req: HybridRequest, groups, alloc, num_positions: int, runs_out: bool = False) -> int:
    """grow_tables(req, groups, alloc, num_positions), with its whole contract (§2.3) checked on this
    call: every group's table covers the positions, entries already there (NULL_BLOCK ones
    included) stay where they are, a table never shrinks, the new entries are fresh blocks from one
    `alloc_blocks` call, `req.blocks` is every live entry, and the tables were replaced, never
    edited in place (§2.2, pitfall 6: a shallow copy of the request taken before the call, what a
    failed step's rollback restores, still holds the old ones). With `runs_out` the call must raise
    OutOfBlocksError and leave the request and the allocator as they were. Returns the blocks taken."""
    bs, tables_before = alloc.block_size, req.tables
    old = [list(table) for table in tables_before]
    before = old or [[] for _ in groups]
    blocks, free = list(req.blocks), list(alloc.free_blocks)
    seen = grow_watched(req, groups, alloc, num_positions)
    case = f"grow_tables to {num_positions} positions (block size {bs}) from tables {old}"
    assert seen["copy_tables"] == old, (f"{case}: grow_tables edited a table in place; a shallow copy of the "
                                        f"request taken before now holds {seen['copy_tables']}")
    if runs_out:
        assert seen["raised"], f"{case}: {len(free)} blocks free, too few: OutOfBlocksError expected"
        assert req.tables == tables_before and req.blocks == blocks and alloc.free_blocks == free, \
            f"{case}: a failed grow_tables changed the request or the allocator"
        return 0
    assert not seen["raised"], f"{case}: OutOfBlocksError with {len(free)} blocks free"
    calls, taken = seen["alloc_calls"], seen["taken"]
    assert len(calls) <= 1 and sum(calls) == taken, \
        f"{case}: alloc_blocks was called {len(calls)} times (for {calls} blocks): the contract is one call"
    tables, want = [list(table) for table in req.tables], blocks_needed(num_positions, bs)
    assert len(tables) == len(groups), f"{case}: {len(tables)} tables for {len(groups)} groups"
    for g, (now, was) in enumerate(zip(tables, before)):
        assert len(now) == max(len(was), want), \
            f"{case}: group {g}'s table has {len(now)} entries; {max(len(was), want)} cover the positions"
        assert now[:len(was)] == was, f"{case}: group {g}'s entries {was} became {now[:len(was)]}"
    new = [b for now, was in zip(tables, before) for b in now[len(was):]]
    assert len(set(new)) == len(new) and set(new) <= set(free), f"{case}: the new entries {new} are not free blocks"
    assert taken == len(new), f"{case}: returned {taken}, took {len(new)} blocks"
    assert sorted(req.blocks) == sorted(b for table in tables for b in table if b != NULL_BLOCK), \
        f"{case}: req.blocks {req.blocks} is not the tables' live entries"
    assert alloc.num_free == len(free) - len(new), f"{case}: {alloc.num_free} blocks free after taking {len(new)}"
    return taken


@pytest.mark.points(2)
def test_grow_tables_covers_every_group_with_distinct_blocks():
    alloc, req = BlockAllocator(32, 4), request()
    assert grow(req, [FULL, SLIDING], alloc, 10) == 6  # 3 blocks each
    assert grow(req, [FULL, SLIDING], alloc, 17) == 4  # 5 blocks each now
    assert grow(req, [FULL, SLIDING], alloc, 20) == 0, "5 blocks of 4 cover positions 0..19"
    assert grow(req, [FULL, SLIDING], alloc, 12) == 0, "a table never shrinks in grow_tables"
    assert [len(t) for t in req.tables] == [5, 5] and alloc.num_used == 10 and len(set(req.blocks)) == 10


@pytest.mark.points(3)
def test_grow_tables_is_all_or_nothing_when_the_pool_runs_out():
    alloc, req = BlockAllocator(7, 4), request()
    grow(req, [FULL, SLIDING], alloc, 4)
    grow(req, [FULL, SLIDING], alloc, 8)  # 2 + 2 blocks, 3 free
    grow(req, [FULL, SLIDING], alloc, 16, runs_out=True)  # 4 more needed


@pytest.mark.points(2)
def test_grow_tables_keeps_null_entries_behind_the_window():
    alloc, req = BlockAllocator(32, 4), request()
    grow(req, [FULL, SLIDING], alloc, 15)
    req.cur_len = 14  # the next token (position 14) reads 9..14: blocks 0 and 1 of the sliding table go
    assert free_behind_window(req, [FULL, SLIDING], alloc) == 2
    grow(req, [FULL, SLIDING], alloc, 24)
    assert list(req.tables[1][:2]) == [NULL_BLOCK] * 2 and NULL_BLOCK not in req.tables[1][2:]
    assert len(req.tables[1]) == len(req.tables[0]) == 6, "entry i of every table is positions 4i..4i+3"
    assert NULL_BLOCK not in req.blocks and len(req.blocks) == 6 + 4 and alloc.num_used == 10


# ---------------------------------------------------------------- free_behind_window

@pytest.mark.points(5)
def test_free_behind_window_frees_exactly_the_blocks_no_later_token_reads():
    rng = random.Random(13)
    for _ in range(300):
        bs, window = rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 40)
        groups = [KvCacheGroup((0,), None), KvCacheGroup((1,), window), KvCacheGroup((2,), window)]
        cur_len = rng.randint(0, 90)
        alloc, req = BlockAllocator(300, bs), request(max(cur_len, 1))
        grow_tables(req, groups, alloc, cur_len + 1)
        req.cur_len = cur_len
        tables_before, free_before = req.tables, alloc.num_free
        # What any later token reads: a query at cur_len or after reads nothing before this.
        oldest = min(positions_read(window, cur_len))
        expect = {b for i, b in enumerate(tables_before[1] + tables_before[2])
                  if (i % len(tables_before[1]) + 1) * bs <= oldest}
        freed = free_behind_window(req, groups, alloc)
        case = f"block_size {bs}, window {window}, next position {cur_len}"
        assert freed == len(expect), f"{case}: freed {freed} blocks, {len(expect)} fall behind the window"
        assert alloc.num_free == free_before + len(expect), case
        assert req.tables[0] == tables_before[0], f"{case}: a full-attention table changed"
        for g in (1, 2):
            assert len(req.tables[g]) == len(tables_before[g]), f"{case}: a sliding table changed length"
            for i, (now, was) in enumerate(zip(req.tables[g], tables_before[g])):
                behind = (i + 1) * bs <= oldest
                assert now == (NULL_BLOCK if behind else was), f"{case}: entry {i} of group {g} is {now}"
        assert set(req.blocks) == set(live(req)), f"{case}: req.blocks is not the live blocks"
        assert free_behind_window(req, groups, alloc) == 0, f"{case}: a second call freed more"


@pytest.mark.points(2)
def test_free_behind_window_off_by_one_at_the_window_edge():
    """bs 4, W 6: position 14 reads 9..14, so block 2 (8..11) stays although 8 is behind."""
    for cur_len, kept_from in ((12, 1), (13, 2), (14, 2), (15, 2), (16, 2), (17, 3)):
        alloc, req = BlockAllocator(32, 4), request()
        grow_tables(req, [FULL, SLIDING], alloc, cur_len + 1)
        req.cur_len = cur_len
        free_behind_window(req, [FULL, SLIDING], alloc)
        table = req.tables[1]
        assert table[:kept_from] == (NULL_BLOCK,) * kept_from and NULL_BLOCK not in table[kept_from:], \
            f"next position {cur_len} (reads {cur_len - 5}..{cur_len}): sliding table {table}"


@pytest.mark.points(1)
def test_a_sliding_group_holds_at_most_its_window_bound_at_every_decode():
    alloc, req = BlockAllocator(64, 4), request(3)
    for position in range(60):
        grow_tables(req, [FULL, SLIDING], alloc, position + 1)
        req.cur_len = position
        free_behind_window(req, [FULL, SLIDING], alloc)
        held = sum(b != NULL_BLOCK for b in req.tables[1])
        assert held <= window_block_bound(6, 4), f"position {position}: the sliding group holds {held} blocks"
    assert sum(b != NULL_BLOCK for b in req.tables[0]) == 15


# ---------------------------------------------------------------- provided: groups and release

def test_release_tables_returns_every_live_block():
    alloc, req = BlockAllocator(32, 4), request()
    grow_tables(req, [FULL, SLIDING], alloc, 30)
    req.cur_len = 29
    free_behind_window(req, [FULL, SLIDING], alloc)
    release_tables(req, alloc)
    assert alloc.num_free == 32 and req.tables == () and req.blocks == []


def config(num_layers: int, sliding: tuple[int, ...], window: int | None = 8) -> Qwen3Config:
    return Qwen3Config(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=num_layers,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4, rope_theta=1e4,
                       rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
                       sliding_layers=sliding, sliding_window=window if sliding else None)


@pytest.mark.parametrize("num_layers, sliding, sizes", [
    (4, (0, 2), [2, 2]), (6, (0, 1, 2, 3, 4), [1] * 6), (12, tuple(i for i in range(12) if i % 6 != 5), [2] * 6),
    (4, (), [4]), (3, (0, 1, 2), [3]),
    (62, tuple(i for i in range(62) if i % 6 != 5), [10] + [9, 9, 9, 9, 8, 8]),  # Gemma-3-like: 52 + 10
    (9, (0, 2, 4, 6, 8), [4, 5])])  # 5 under 1.5 x 4: one group per kind, the full one padded
def test_groups_have_one_kind_bounded_sizes_and_cover_every_layer_once(num_layers, sliding, sizes):
    cfg = config(num_layers, sliding)
    groups = kv_cache_groups(cfg)
    assert [len(g.layers) for g in groups] == sizes
    counts = [sum(cfg.window_of(i) is None for i in range(num_layers)), len(sliding)]
    assert max(sizes) == group_size([c for c in counts if c]) == layer_slots(groups)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(num_layers))
    for g in groups:
        assert {cfg.window_of(layer) for layer in g.layers} == {g.window}
    assert not groups[0].is_sliding or not any(not g.is_sliding for g in groups), "full groups come first"


def test_blocks_at_peak_counts_a_whole_history_for_full_groups_and_a_window_for_sliding_ones():
    groups = [FULL, SLIDING]
    assert blocks_at_peak(groups, 100, 4, 1) == 25 + window_block_bound(6, 4)
    assert blocks_at_peak(groups, 100, 4, 32) == 25 + blocks_needed(6 - 1 + 32, 4) + 1
    assert blocks_at_peak(groups, 5, 4, 5) == 2 + 2, "a short request never needs more than its own blocks"
    assert blocks_at_peak([dataclasses.replace(FULL)], 100, 4, 1) == 25


# ---------------------------------------------------------------- hybrid_hit_blocks

def cached_allocator(groups, cached: set[tuple[int, int]], keys: list[bytes], bs: int,
                     tagged: bool = False) -> PrefixBlockAllocator:
    """An allocator whose cache holds block i of group g (under group_key) for each (g, i) in `cached`."""
    alloc = (TaggedAllocator if tagged else PrefixBlockAllocator)(len(cached) + 1, bs)
    for g, i in sorted(cached):
        (block,) = alloc.alloc_blocks(1)
        alloc.register(block, group_key(g, keys[i]))
        alloc.free([block])  # cached free: still found by its key
    return alloc


def usable(h: int, groups, cached, bs: int) -> bool:
    """Every block holding a position the token at h * bs reads is cached, in every group (the
    positions listed from L1's mask; the token's own position is computed, not cached)."""
    return all((g, p // bs) in cached for g, group in enumerate(groups)
               for p in positions_read(group.window, h * bs) if p < h * bs)


@pytest.mark.points(5)
def test_hybrid_hit_blocks_is_the_longest_prefix_whose_next_token_finds_everything_it_reads():
    rng = random.Random(31)
    keys = chain_keys(list(range(200)), 1)  # any distinct keys: the rule only looks them up
    for _ in range(300):
        bs = rng.choice([1, 2, 4])
        groups = [KvCacheGroup((0,), None)] + [KvCacheGroup((g,), rng.randint(1, 12)) for g in (1, 2)][:rng.randint(0, 2)]
        n = rng.randint(0, 12)
        density = rng.random()
        cached = {(g, i) for g in range(len(groups)) for i in range(n) if rng.random() < density}
        if rng.random() < 0.5:  # the common shape: full groups whole, sliding groups only at the end
            cached |= {(0, i) for i in range(n)} | {(g, i) for g in range(1, len(groups)) for i in range(n // 2, n)}
        alloc = cached_allocator(groups, cached, keys, bs, tagged=rng.random() < 0.5)
        expect = max(h for h in range(n + 1) if usable(h, groups, cached, bs))
        got = hybrid_hit_blocks(keys[:n], groups, alloc, bs)
        assert got == expect, (f"block_size {bs}, windows {[g.window for g in groups]}, {n} keys, cached "
                               f"{sorted(cached)}: {got} blocks, the longest usable prefix is {expect}")


@pytest.mark.points(1)
def test_hybrid_hit_blocks_needs_only_the_window_of_a_sliding_group():
    bs, keys = 4, chain_keys(list(range(64)), 4)
    groups = [FULL, SLIDING]  # W 6: the token at position 16 reads 11..16, blocks 2 and 3
    cached = {(0, i) for i in range(4)} | {(1, 2), (1, 3)}
    assert hybrid_hit_blocks(keys[:4], groups, cached_allocator(groups, cached, keys, bs), bs) == 4
    cached = (cached - {(1, 2)}) | {(1, 0), (1, 1)}  # position 16 and 12 need block 2; 8 reads 3..8
    assert hybrid_hit_blocks(keys[:4], groups, cached_allocator(groups, cached, keys, bs), bs) == 2


@pytest.mark.points(1)
def test_attach_cached_prefix_takes_the_windows_blocks_through_lookup_one_reference_each():
    """Also from an allocator that keeps its keys within a tag (L12's): only `lookup` finds them."""
    bs, keys = 4, chain_keys(list(range(64)), 4)
    groups = [FULL, SLIDING]  # W 6: the token at position 16 reads 11..16, blocks 2 and 3
    cached = {(0, i) for i in range(4)} | {(1, i) for i in range(4)}
    for tagged in (False, True):
        alloc = cached_allocator(groups, cached, keys, bs, tagged)
        block_of = {(g, i): alloc.lookup([group_key(g, keys[i])])[0] for g, i in cached}
        req = request(20)
        attach_cached_prefix(req, keys[:4], 4, groups, alloc)
        assert req.tables == (tuple(block_of[0, i] for i in range(4)),
                              (NULL_BLOCK, NULL_BLOCK, block_of[1, 2], block_of[1, 3])), f"tagged: {tagged}"
        assert req.cur_len == 16 and req.block_keys == keys[:4]
        assert sorted(alloc.ref_count[b] for b in block_of.values()) == [0, 0] + [1] * 6
        alloc.check()
