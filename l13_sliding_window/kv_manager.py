"""L8's KV manager on a hybrid model: one block table per KV cache group, windows freed as requests run.

What each part of the manager's contract (L5's, with L8's additions) becomes with groups:
  peak_blocks      summed over groups; a sliding group never needs more than its window's blocks
                   (plus a step's new tokens)
  blocks_for / allocate
                   counted and taken per group (grow_tables), copy-on-write per group
  attach_computed_prefix / prefix_in_flight
                   the hybrid hit rule (sharing.py): a hit needs only what the next token reads
  after_forward    full blocks keyed in every group that still holds them; then each sliding
                   group frees what fell behind its window (forgotten by the prefix cache unless
                   keep_behind_window)
  fork             the child takes the parent's tables too
  step_metadata    one set of block tables per group (meta.py); each layer reads its group's
"""

from __future__ import annotations

from l1_contiguous import InputError
from l2_paged import kv_positions_needed
from l8_prefix import PrefixKvManager, chain_keys

from .groups import NULL_BLOCK, blocks_at_peak
from .meta import build_grouped_meta
from .sharing import (attach_cached_prefix, copy_on_write_tables, group_key, hybrid_hit_blocks, shared_write_entries,
                      without_windows)
from .tables import HybridRequest, blocks_to_grow, free_behind_window, grow_tables, release_tables, set_tables


class HybridKvManager(PrefixKvManager):
    def __init__(self, alloc, pool, sharing: bool = True, hybrid_hit_rule: bool = True,
                 keep_behind_window: bool = False):
        super().__init__(alloc, pool, sharing)
        self.groups = pool.groups
        self.hit_groups = pool.groups if hybrid_hit_rule else without_windows(pool.groups)  # what a hit must hold
        self.keep_behind_window = keep_behind_window
        self.sliding = [g for g, group in enumerate(self.groups) if group.is_sliding]
        self.decode_window_peak = 0  # the most blocks one sliding table held during a decode forward

    # ------------------------------------------------------------------ sizing and taking blocks

    def peak_blocks(self, req: HybridRequest, step_tokens: int | None = None) -> int:
        positions = kv_positions_needed(len(req.prompt_ids), req.max_new_tokens)
        step = min(positions, step_tokens or positions)  # a step's new tokens, at most
        return blocks_at_peak(self.groups, positions, self.block_size, step)

    def blocks_for(self, req: HybridRequest, n: int) -> int:
        copies = len(shared_write_entries(req, self.alloc)) if self.sharing else 0
        return copies + blocks_to_grow(req, self.groups, self.block_size, req.cur_len + n)

    def allocate(self, req: HybridRequest, n: int) -> None:
        if self.sharing:
            self.counters.cow_copies += copy_on_write_tables(req, self.alloc, self.pool)
        grow_tables(req, self.groups, self.alloc, req.cur_len + n)

    # ------------------------------------------------------------------ the hybrid hit rule

    def _cached_blocks(self, req: HybridRequest) -> tuple[list[bytes], int]:
        keys = chain_keys(req.tokens[:-1], self.block_size)  # never the last token's block
        return keys, hybrid_hit_blocks(keys, self.hit_groups, self.alloc, self.block_size)

    def attach_computed_prefix(self, req: HybridRequest) -> int:
        if not self.sharing:
            return 0
        keys, hits = self._cached_blocks(req)
        attach_cached_prefix(req, keys, hits, self.groups, self.alloc)  # only what the next token reads
        return req.cur_len

    def release_computed_prefix(self, req: HybridRequest) -> None:
        release_tables(req, self.alloc)
        req.cur_len, req.block_keys = 0, []

    def prefix_in_flight(self, req: HybridRequest, in_flight: set[bytes]) -> bool:
        keys, hits = self._cached_blocks(req)
        return hits < len(keys) and keys[hits] in in_flight

    def adopt_blocks(self, req: HybridRequest, blocks: list[int]) -> None:
        raise InputError("a hybrid engine cannot adopt K/V computed elsewhere: it keeps one table per "
                         "group of layers, and the blocks it would get are one list")

    # ------------------------------------------------------------------ after each forward

    def after_forward(self, req: HybridRequest) -> None:
        super().after_forward(req)  # L8 keys the blocks that became full (sharing on)
        self._free_behind_window(req)

    def register_block(self, req: HybridRequest, i: int, key: bytes) -> None:
        for g, table in enumerate(req.tables):
            if table[i] != NULL_BLOCK:
                self.alloc.register(table[i], group_key(g, key))

    def _free_behind_window(self, req: HybridRequest) -> None:
        held = set(req.blocks)
        free_behind_window(req, self.groups, self.alloc)
        if not self.keep_behind_window:  # a cached block nobody holds any more: forget its key
            for block in held - set(req.blocks):
                if block in self.alloc.cached_free:
                    self.alloc.forget(block)

    def fork(self, child: HybridRequest, parent: HybridRequest) -> None:
        super().fork(child, parent)  # the parent's blocks, shared
        set_tables(child, parent.tables)
        self._free_behind_window(child)

    # ------------------------------------------------------------------ one forward

    def step_metadata(self, reqs, num_new, device, backend):
        for req, n in zip(reqs, num_new):
            if n == 1 and self.sliding:
                held = max(sum(b != NULL_BLOCK for b in req.tables[g]) for g in self.sliding)
                self.decode_window_peak = max(self.decode_window_peak, held)
        return build_grouped_meta(reqs, num_new, self.groups, self.block_size, device, backend)
