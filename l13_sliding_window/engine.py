"""L8's engine on a hybrid model: one block table per KV cache group, windows freed as requests run.

What changes against L8, and where:
  scheduler   a step's blocks are counted and taken per group (grow_tables, copy-on-write per
              group); a request too large for the pool is judged by its peak over groups (a
              sliding group never needs more than its window's blocks); a prefix hit follows the
              hybrid rule (sharing.py)
  engine      after each step, every request's sliding groups free what fell behind the window
              (forgotten by the prefix cache unless keep_behind_window); full blocks are keyed
              per group; forks take their parent's tables
  preemptor   recompute and swap move every group's live blocks; a swapped sliding group keeps
              its NULL_BLOCK entries, and only live blocks are copied
  model       each layer reads its own group's metadata (attention.py, meta.py)
Everything else (queues, policies, chunked prefill, holding for a prefix in flight, rollback of a
failed step) is L5's and L8's.
"""

from __future__ import annotations

import torch

from l1_contiguous import InputError
from l2_paged import kv_positions_needed
from l5_eviction import Preemptor, State, StepRunner, make_engine
from l5_eviction.lifecycle import SwappedKv
from l5_eviction.preempt import to_host
from l8_prefix import PrefixEngine, PrefixScheduler, block_key, chain_keys

from .attention import GroupedAttention
from .groups import NULL_BLOCK, blocks_at_peak, window_block_bound
from .meta import build_grouped_meta
from .pool import GroupedKvPool
from .sharing import (attach_cached_prefix, copy_on_write_tables, group_key, hybrid_hit_blocks, shared_write_entries,
                      without_windows)
from .tables import (HybridRequest, blocks_to_grow, free_behind_window, grow_tables, release_tables, set_tables,
                     trim_tables)


class HybridScheduler(PrefixScheduler):
    hit_groups = None  # the groups the hit rule sees (HybridEngine sets them: windows, or none)

    def _peak_blocks(self, req: HybridRequest) -> int:
        positions = kv_positions_needed(len(req.prompt_ids), req.max_new_tokens)
        step_tokens = min(positions, self.prefill_chunk or positions)  # a step's new tokens, at most
        return blocks_at_peak(self.pool.groups, positions, self.alloc.block_size, step_tokens)

    def _blocks_for(self, req: HybridRequest, n: int) -> int:
        copies = len(shared_write_entries(req, self.alloc)) if self.sharing else 0
        return copies + blocks_to_grow(req, self.pool.groups, self.alloc.block_size, req.cur_len + n)

    def _reserve(self, req: HybridRequest, n: int) -> None:
        if self.sharing:
            self.counters.cow_copies += copy_on_write_tables(req, self.alloc, self.pool)
        grow_tables(req, self.pool.groups, self.alloc, req.cur_len + n)

    def _cached_blocks(self, req: HybridRequest) -> tuple[list[bytes], int]:
        keys = chain_keys(req.tokens[:-1], self.alloc.block_size)  # never the last token's block
        return keys, hybrid_hit_blocks(keys, self.hit_groups, self.alloc, self.alloc.block_size)

    def _attach_cached_prefix(self, req: HybridRequest) -> int:
        keys, h = self._cached_blocks(req)
        attach_cached_prefix(req, keys, h, self.pool.groups, self.alloc)  # only what the next token reads
        return req.cur_len

    def _drop_cached_prefix(self, req: HybridRequest) -> None:
        release_tables(req, self.alloc)
        req.cur_len, req.block_keys = 0, []

    def _prefix_in_flight(self, req: HybridRequest, in_flight: set[bytes]) -> bool:
        keys, h = self._cached_blocks(req)
        return h < len(keys) and keys[h] in in_flight


class HybridRunner(StepRunner):
    """L5's runner on grouped metadata (the engine frees what fell behind a window after each step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sliding = [g for g, group in enumerate(self.pool.groups) if group.is_sliding]
        self.decode_window_peak = 0  # the most blocks one sliding table held during a decode forward

    def build_meta(self, reqs, num_new):
        for req, n in zip(reqs, num_new):
            if n == 1 and self.sliding:
                held = max(sum(b != NULL_BLOCK for b in req.tables[g]) for g in self.sliding)
                self.decode_window_peak = max(self.decode_window_peak, held)
        return build_grouped_meta(reqs, num_new, self.pool.groups, self.alloc.block_size,
                                  self.model.device, self.backend)

    def _missing_blocks(self, req, num_positions: int) -> int:
        return blocks_to_grow(req, self.pool.groups, self.alloc.block_size, num_positions)

    def _reserve_positions(self, req, num_positions: int) -> None:
        grow_tables(req, self.pool.groups, self.alloc, num_positions)


class HybridPreemptor(Preemptor):
    def drop_for_recompute(self, req: HybridRequest) -> None:
        super().drop_for_recompute(req)  # frees req.blocks: every group's live blocks
        set_tables(req, ())

    def discard(self, req: HybridRequest) -> None:
        super().discard(req)
        set_tables(req, ())

    def swap_out(self, req: HybridRequest) -> None:
        """L5's swap-out in every group: only live blocks travel; the tables' shape waits on the host."""
        # BEGIN SOLUTION
        trim_tables(req, self.alloc)  # only blocks holding K/V travel
        ids = torch.tensor(req.blocks, dtype=torch.int64, device=self.pool.K[0].device)
        pin = ids.is_cuda
        req.swapped = SwappedKv(k=[to_host(kb[ids], pin) for kb in self.pool.k_block_tensors],
                                v=[to_host(vb[ids], pin) for vb in self.pool.v_block_tensors])
        self.counters.preempted_swap += 1
        self.counters.bytes_swapped_out += req.swapped.nbytes
        self.alloc.free(req.blocks)
        req.swapped_tables = req.tables  # where each live block sat, NULL_BLOCK entries included
        set_tables(req, ())
        req.state = State.SWAPPED
        # END SOLUTION

    def blocks_to_swap_in(self, req: HybridRequest) -> int:
        return sum(b != NULL_BLOCK for table in req.swapped_tables for b in table)

    def swap_in(self, req: HybridRequest) -> None:
        """Fresh blocks at the swapped tables' live entries (all or nothing), their K/V copied back."""
        # BEGIN SOLUTION
        fresh = iter(self.alloc.alloc_blocks(self.blocks_to_swap_in(req)))  # raises before any change
        set_tables(req, [[b if b == NULL_BLOCK else next(fresh) for b in table] for table in req.swapped_tables])
        ids = torch.tensor(req.blocks, dtype=torch.int64, device=self.pool.K[0].device)
        for kb, vb, k, v in zip(self.pool.k_block_tensors, self.pool.v_block_tensors, req.swapped.k, req.swapped.v):
            kb[ids] = k.to(ids.device, non_blocking=True)
            vb[ids] = v.to(ids.device, non_blocking=True)
        self.counters.bytes_swapped_in += req.swapped.nbytes
        req.swapped, req.swapped_tables = None, ()
        req.state = State.RUNNING
        # END SOLUTION


class HybridEngine(PrefixEngine):
    request_cls = HybridRequest
    scheduler_cls = HybridScheduler
    pool_cls = GroupedKvPool
    runner_cls = HybridRunner
    preemptor_cls = HybridPreemptor

    def __init__(self, model, pool, alloc, hybrid_hit_rule: bool = True, keep_behind_window: bool = False,
                 **kwargs):
        """hybrid_hit_rule: a prefix hit needs only what the next token reads (False: every block of
        every group, as a cache that ignores windows asks); keep_behind_window: blocks freed behind a
        window stay cached for later hits (False: they go back to the pool as plain free blocks)."""
        if not isinstance(pool, GroupedKvPool):
            raise InputError(f"a HybridEngine needs a GroupedKvPool (make_hybrid_engine builds one), "
                             f"got {type(pool).__name__}")
        bad = sorted({type(layer.self_attn).__name__ for layer in model.model.layers
                      if not isinstance(layer.self_attn, GroupedAttention)})
        if bad:
            raise InputError(f"the hybrid engine's layers read their group's tables, which {', '.join(bad)} "
                             f"cannot; load the model with l13_sliding_window.load_hybrid_model")
        self.keep_behind_window = keep_behind_window
        super().__init__(model, pool, alloc, **kwargs)
        self.scheduler.hit_groups = pool.groups if hybrid_hit_rule else without_windows(pool.groups)

    def _register_full_blocks(self, req: HybridRequest) -> None:
        """Key each block that became full, in every group that still holds it."""
        bs = self.alloc.block_size
        while len(req.block_keys) < req.cur_len // bs:
            i = len(req.block_keys)
            key = block_key(req.block_keys[-1] if req.block_keys else None, req.tokens[i * bs:(i + 1) * bs])
            for g, table in enumerate(req.tables):
                if table[i] != NULL_BLOCK:
                    self.alloc.register(table[i], group_key(g, key))
            req.block_keys.append(key)

    def _commit(self, plan, tokens) -> None:
        super()._commit(plan, tokens)  # keys new full blocks (sharing), forks, appends, finishes
        for req, _ in plan:
            if req.state is not State.FINISHED:
                self._free_behind_window(req)

    def _free_behind_window(self, req: HybridRequest) -> None:
        held = set(req.blocks)
        free_behind_window(req, self.pool.groups, self.alloc)
        if not self.keep_behind_window:  # a cached block nobody holds any more: forget its key
            for block in held - set(req.blocks):
                if block in self.alloc.cached_free:
                    self.alloc.forget(block)

    def _fork(self, parent: HybridRequest, logits_row) -> None:
        """L8's forks hold the parent's blocks; here they also take its tables."""
        first_new = len(self.requests)
        super()._fork(parent, logits_row)
        for child in list(self.requests.values())[first_new:]:
            if child.state is not State.FINISHED:
                set_tables(child, parent.tables)
                self._free_behind_window(child)

    def summary(self) -> dict:
        bs, groups = self.alloc.block_size, self.pool.groups
        windows = sorted({g.window for g in groups if g.is_sliding})
        return {**super().summary(), "kv_cache_groups": len(groups), "layers_per_group": len(groups[0].layers),
                "sliding_windows": windows, "bytes_per_block": self.pool.bytes_per_block(self.model.config, bs,
                                                                                           self.model.dtype),
                "decode_window_blocks_peak": self.runner.decode_window_peak,
                "decode_window_block_bound": max((window_block_bound(w, bs) for w in windows), default=0)}


def make_hybrid_engine(model, num_blocks: int, block_size: int = 16, **kwargs) -> HybridEngine:
    return make_engine(model, num_blocks, block_size, engine_cls=HybridEngine, **kwargs)
