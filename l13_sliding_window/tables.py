"""A request's block tables, one per KV cache group, and the three ways they change.

    grow      every group's table covers the positions the next step writes (one allocation)
    free      a sliding group returns the blocks wholly behind its window (NULL_BLOCK stays)
    release   everything goes back (finish, abort, preemption by recompute)

The tables are tuples, replaced whole and never edited in place: the engine undoes a failed step
by restoring each request's attributes from a shallow copy, which an in-place edit would defeat.
`req.blocks` is every block the request holds, across groups; `set_tables` keeps it in step, so
what earlier lessons read from it (a policy's memory share, a release) stays true.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from l2_paged import BlockAllocator, blocks_needed
from l8_prefix import PrefixRequest

from .groups import NULL_BLOCK, KvCacheGroup, first_needed_position


@dataclass
class HybridRequest(PrefixRequest):
    tables: tuple[tuple[int, ...], ...] = ()  # one per group (entry i: positions i*bs..); () holds nothing
    swapped_tables: tuple[tuple[int, ...], ...] = ()  # while swapped: the tables its host copy fills


def set_tables(req: HybridRequest, tables) -> None:
    """Replace the request's tables; `req.blocks` becomes the live blocks of every group."""
    req.tables = tuple(tuple(table) for table in tables)
    req.blocks = [b for table in req.tables for b in table if b != NULL_BLOCK]
    req.slot_indices = []  # per group now: see meta.py


def grow_tables(req: HybridRequest, groups: list[KvCacheGroup], alloc: BlockAllocator, num_positions: int) -> int:
    """Make every group's table cover positions 0..num_positions-1; returns the blocks taken.

    Contract: the new blocks come from one `alloc.alloc_blocks` call, so an OutOfBlocksError
    leaves the request and the allocator as they were; entries already in a table (NULL_BLOCK
    ones included) are kept where they are; a table never shrinks here.
    """
    # BEGIN SOLUTION
    tables = req.tables or ((),) * len(groups)
    want = blocks_needed(num_positions, alloc.block_size)
    missing = [max(0, want - len(table)) for table in tables]
    fresh = iter(alloc.alloc_blocks(sum(missing)))  # raises before anything changes
    set_tables(req, [table + tuple(next(fresh) for _ in range(m)) for table, m in zip(tables, missing)])
    return sum(missing)
    # END SOLUTION


def blocks_to_grow(req: HybridRequest, groups: list[KvCacheGroup], block_size: int, num_positions: int) -> int:
    """How many blocks `grow_tables(req, ..., num_positions)` would take."""
    want = blocks_needed(num_positions, block_size)
    tables = req.tables or ((),) * len(groups)
    return sum(max(0, want - len(table)) for table in tables)


def free_behind_window(req: HybridRequest, groups: list[KvCacheGroup], alloc: BlockAllocator) -> int:
    """Give back every block of a sliding group that no later token of the request can read;
    returns how many. The next token is at position `req.cur_len`.

    Contract: a block is freed only when all its positions are before the oldest position the next
    token reads through the group's window; its entry becomes NULL_BLOCK (the table keeps its
    length); full-attention groups are untouched; one `alloc.free` call for all of them.
    """
    # BEGIN SOLUTION
    behind, tables = [], []
    for group, table in zip(groups, req.tables):
        first_kept = first_needed_position(group.window, req.cur_len) // alloc.block_size
        behind += [b for b in table[:first_kept] if b != NULL_BLOCK]
        tables.append((NULL_BLOCK,) * min(first_kept, len(table)) + table[first_kept:])
    if behind:
        alloc.free(behind)
        set_tables(req, tables)
    return len(behind)
    # END SOLUTION


def release_tables(req: HybridRequest, alloc: BlockAllocator) -> None:
    """Every block the request holds goes back; it holds no table."""
    if req.blocks:
        alloc.free(req.blocks)
    set_tables(req, ())


def trim_tables(req: HybridRequest, alloc: BlockAllocator) -> None:
    """Free entries reserved beyond the positions that hold K/V (before a swap: only K/V travels)."""
    keep = blocks_needed(req.cur_len, alloc.block_size)
    extra = [b for table in req.tables for b in table[keep:] if b != NULL_BLOCK]
    if extra:
        alloc.free(extra)
    set_tables(req, [table[:keep] for table in req.tables])


class TableSlots(Sequence):
    """The pool slot of every position a table covers (L2's `slot_indices`), computed when read:
    a decode reads one slot, so no list of the whole history is built each step. Reading a position
    whose block was freed behind the window is an error, never a stale slot."""

    def __init__(self, table: tuple[int, ...], block_size: int):
        self.table, self.block_size = table, block_size

    def __len__(self) -> int:
        return len(self.table) * self.block_size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        block = self.table[index // self.block_size]
        if block == NULL_BLOCK:
            raise ValueError(f"position {index} is behind the window: its block was freed")
        return block * self.block_size + index % self.block_size
