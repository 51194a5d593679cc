"""One pool for every KV cache group: a block holds one group's layers, whichever group owns it.

    L3's pool     K[layer]  for each of the model's L layers        a block = L layers of K/V
    this pool     K[j]      for each of the g layers of one group   a block = g layers of K/V

    tensors        K[0]   K[1]          (g = 2: groups {0, 2} sliding and {1, 3} full)
    block 5        layer 0 layer 2      owned by the sliding group of request A
    block 6        layer 1 layer 3      owned by the full group of request A

A group shorter than the others (its kind's count is not a multiple of the group size) leaves
its last tensors' slots unused in the blocks it owns: padding (groups.group_size).
`K[layer]` and `k_blocks[layer]` are still indexed by model layer, as every earlier lesson's
attention indexes them; the layers at the same place in their groups are handed the same tensor.
Two groups never own one block, so their writes never meet.
"""

from __future__ import annotations

import dataclasses

import torch

from l3_block_kernel import BlockKvPool

from .groups import KvCacheGroup, kv_cache_groups, layer_slots


class GroupedKvPool(BlockKvPool):
    def __init__(self, cfg, num_blocks, block_size, dtype, device="cpu"):
        self.groups: list[KvCacheGroup] = kv_cache_groups(cfg)
        size = layer_slots(self.groups)
        super().__init__(dataclasses.replace(cfg, num_hidden_layers=size), num_blocks, block_size, dtype, device)
        self.k_tensors, self.v_tensors = self.K, self.V  # [num_slots, H_kv, D] each: g of them
        self.k_block_tensors, self.v_block_tensors = self.k_blocks, self.v_blocks
        self.group_of: dict[int, int] = {}  # model layer -> its group
        index = {}  # model layer -> its place in the group = the tensor holding it
        for gi, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                self.group_of[layer], index[layer] = gi, j
        layers = range(cfg.num_hidden_layers)
        self.K, self.V = [self.k_tensors[index[i]] for i in layers], [self.v_tensors[index[i]] for i in layers]
        self.k_blocks = [self.k_block_tensors[index[i]] for i in layers]
        self.v_blocks = [self.v_block_tensors[index[i]] for i in layers]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_tensors + self.v_tensors)

    @staticmethod
    def bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
        return 2 * layer_slots(kv_cache_groups(cfg)) * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
