"""L4's attention: every row of a step, prefill chunk or decode, reads K/V in place through the tables.

    kv_step   write the new rows' K/V to their slots; hand on the layer's block views (no copy)
    attend    one call over the ragged batch (varlen.py; planned once per step, run per layer),
              or the cascade (cascade.py) when the step's requests share leading blocks
A model run with L2's or L3's metadata (ForwardMeta, BlockForwardMeta) takes their paths, unchanged.
"""

from __future__ import annotations

from l1_contiguous import InputError
from l3_block_kernel import BlockTableAttention

from .cascade import cascade_attention
from .meta import PagedStepMeta
from .varlen import PagedPrefillPlan


class PagedPrefillAttention(BlockTableAttention):
    reads_windows = True  # L4's attention applies a sliding layer's window; L2's and L3's paths refuse one

    def kv_step(self, k, v, pool, meta):
        if not isinstance(meta, PagedStepMeta):
            return super().kv_step(k, v, pool, meta)
        pool.set_kv(self.layer_idx, meta.slot_mapping, k, v)
        return pool.k_blocks[self.layer_idx], pool.v_blocks[self.layer_idx]  # views, not copies

    def attend(self, q, k_all, v_all, meta):
        """q [T, H, D]; k_all, v_all [num_blocks, block_size, H_kv, D] -> [T, H, D]."""
        if not isinstance(meta, PagedStepMeta):
            if self.window is not None:
                raise InputError(f"layer {self.layer_idx} is a sliding layer (window {self.window}), which only "
                                 "L4's metadata (build_paged_meta) reads; run it with L4's runner or an engine")
            return super().attend(q, k_all, v_all, meta)
        # The tables come from the allocator's own blocks: no per-layer value check (a GPU sync).
        args = (q, k_all, v_all, meta.cu_seqlens_q, meta.context_lens, meta.block_tables)
        if meta.num_common_blocks and self.window is None:
            return cascade_attention(*args, meta.num_common_blocks, backend=meta.backend,
                                     max_query_len=meta.max_query_len, check_values=False)
        if meta.plan is None:  # the first layer of the step: its call is checked, the others reuse it
            meta.plan = PagedPrefillPlan(*args[3:], meta.max_query_len, meta.backend)
        return meta.plan.run(q, k_all, v_all, window=self.window)
