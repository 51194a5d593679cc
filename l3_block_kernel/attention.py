"""L3's attention: L2's, with the decode read path replaced by paged attention over block tables.

Prefill:  write K/V to their slots, gather the histories, masked SDPA        (inherited from L2)
Decode:   write K/V to their slots, attend *in place* by walking each request's block table:
          no gathered copy of the history, no [T, S] mask.
"""

from __future__ import annotations

from l2_paged import PagedAttention

from .paged_attention import paged_attention


class BlockTableAttention(PagedAttention):
    def kv_step(self, k, v, pool, meta):
        if meta.is_prefill:
            return super().kv_step(k, v, pool, meta)
        # BEGIN SOLUTION
        pool.set_kv(self.layer_idx, meta.slot_mapping, k, v)
        return pool.k_blocks[self.layer_idx], pool.v_blocks[self.layer_idx]  # views, not copies
        # END SOLUTION

    def attend(self, q, k_all, v_all, meta):
        """Decode: q [B, H, D]; k_all, v_all [num_blocks, block_size, H_kv, D] -> [B, H, D]."""
        if meta.is_prefill:
            return super().attend(q, k_all, v_all, meta)
        # The tables were built on the host from allocator-owned blocks: skip the per-layer value
        # check, which on CUDA would copy them back to the host (a sync) in every layer.
        return paged_attention(q, k_all, v_all, meta.block_tables, meta.context_lens,
                               backend=meta.backend, check_values=False, window_starts=meta.window_starts)
