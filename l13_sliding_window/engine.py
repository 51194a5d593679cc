"""L8's engine on a hybrid model: one block table per KV cache group, windows freed as requests run.

What changes against L8, and where:
  KV manager  everything about blocks (kv_manager.py): a step's blocks counted and taken per
              group, a request's peak over groups, the hybrid hit rule, keys per group, windows
              freed after each forward, forks taking their parent's tables, grouped metadata
  preemptor   recompute and swap move every group's live blocks; a swapped sliding group keeps
              its NULL_BLOCK entries, and only live blocks are copied (below)
  model       each layer reads its own group's metadata (attention.py, meta.py)
Everything else (scheduler, queues, policies, chunked prefill, holding for a prefix in flight,
rollback of a failed step) is L5's and L8's, unchanged.
"""

from __future__ import annotations

import torch

from l1_contiguous import InputError
from l5_eviction import Preemptor, State, make_engine
from l5_eviction.lifecycle import SwappedKv
from l5_eviction.preempt import to_host
from l8_prefix import PrefixEngine

from .attention import GroupedAttention
from .groups import NULL_BLOCK, layer_slots, window_block_bound
from .kv_manager import HybridKvManager
from .pool import GroupedKvPool
from .tables import HybridRequest, set_tables, trim_tables


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


class HybridParts:
    """What makes an engine run a hybrid model, mixed in before the engine class it adapts
    (HybridEngine: L8's; speculative.py: L10's). It builds parts (the grouped pool's preemptor and
    the KV manager, with the options below) and adds the groups' figures; it changes no step."""

    pool_cls = GroupedKvPool
    preemptor_cls = HybridPreemptor
    kv_manager_cls = HybridKvManager

    def __init__(self, model, pool, alloc, hybrid_hit_rule: bool = True, keep_behind_window: bool = False,
                 **kwargs):
        """hybrid_hit_rule: a prefix hit needs only what the next token reads (False: every block of
        every group, as a cache that ignores windows asks); keep_behind_window: blocks freed behind a
        window stay cached for later hits (False: they go back to the pool as plain free blocks)."""
        check_hybrid_parts(model, pool)
        self.hybrid_options = {"hybrid_hit_rule": hybrid_hit_rule, "keep_behind_window": keep_behind_window}
        super().__init__(model, pool, alloc, **kwargs)

    def make_kv_manager(self) -> HybridKvManager:
        return self.kv_manager_cls(self.alloc, self.pool, self.sharing, **self.hybrid_options)

    def summary(self) -> dict:
        return {**super().summary(), **hybrid_summary(self)}


class HybridEngine(HybridParts, PrefixEngine):
    request_cls = HybridRequest


def check_hybrid_parts(model, pool) -> None:
    """InputError unless the pool is grouped and every layer reads its group's tables."""
    if not isinstance(pool, GroupedKvPool):
        raise InputError(f"a hybrid engine needs a GroupedKvPool (make_hybrid_engine builds one), "
                         f"got {type(pool).__name__}")
    bad = sorted({type(layer.self_attn).__name__ for layer in model.model.layers
                  if not isinstance(layer.self_attn, GroupedAttention)})
    if bad:
        raise InputError(f"the hybrid engine's layers read their group's tables, which {', '.join(bad)} "
                         f"cannot; load the model with l13_sliding_window.load_hybrid_model")


def hybrid_summary(engine) -> dict:
    """The groups' figures of an engine on a grouped pool (any engine with a HybridKvManager)."""
    bs, groups, pool = engine.alloc.block_size, engine.pool.groups, engine.pool
    windows = sorted({g.window for g in groups if g.is_sliding})
    slots = layer_slots(groups)
    return {"kv_cache_groups": len(groups), "layers_per_group": slots, "sliding_windows": windows,
            "padding_layer_slots": sum(slots - len(g.layers) for g in groups),
            "bytes_per_block": pool.bytes_per_block(engine.model.config, bs, engine.model.dtype),
            "decode_window_blocks_peak": engine.kv.decode_window_peak,
            "decode_window_block_bound": max((window_block_bound(w, bs) for w in windows), default=0)}


def make_hybrid_engine(model, num_blocks: int, block_size: int = 16, **kwargs) -> HybridEngine:
    return make_engine(model, num_blocks, block_size, engine_cls=HybridEngine, **kwargs)
