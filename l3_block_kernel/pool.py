"""L3's pool: the same memory as L2's, seen as blocks.

    token-flat (L2)   K[layer]  [num_slots, H_kv, D]                 writes: K[slot] = k
    block-tensor (L3) K[layer]  [num_blocks, block_size, H_kv, D]    reads:  K[block, within]

A contiguous [num_blocks * block_size, H_kv, D] tensor *is* a [num_blocks, block_size, H_kv, D]
tensor: `.view` changes the indexing, not the bytes. So L3 keeps L2's token-flat write path
(slot = block * block_size + within) and adds block views for the kernel to walk.
"""

from __future__ import annotations

from l2_paged import KvPool


class BlockKvPool(KvPool):
    def __init__(self, cfg, num_blocks, block_size, dtype, device="cpu"):
        super().__init__(cfg, num_blocks, block_size, dtype, device)
        heads, dim = cfg.num_key_value_heads, cfg.head_dim
        self.k_blocks = [k.view(num_blocks, block_size, heads, dim) for k in self.K]  # same storage
        self.v_blocks = [v.view(num_blocks, block_size, heads, dim) for v in self.V]
