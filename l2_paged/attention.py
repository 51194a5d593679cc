"""L2's attention: L1's, with the cache step reading and writing the shared pool.

Compared with L1's `kv_step` three lines change: the write goes to the slots in
`meta.slot_mapping` instead of a contiguous range, and the read gathers `meta.kv_indices`
instead of slicing up to the valid length. Everything else is inherited.
"""

from __future__ import annotations

from l1_contiguous import Qwen3Attention


class PagedAttention(Qwen3Attention):
    reads_windows = False  # the gathered keys are not positions 0..S-1: L13 masks windows over pages

    def kv_step(self, k, v, pool, meta):
        """k, v [T, H_kv, D] -> K, V [S, H_kv, D]: the gathered histories of the batch (a copy)."""
        # BEGIN SOLUTION
        pool.set_kv(self.layer_idx, meta.slot_mapping, k, v)
        return pool.K[self.layer_idx][meta.kv_indices], pool.V[self.layer_idx][meta.kv_indices]
        # END SOLUTION
