"""L12's attention: L5's (every row on L4's paged path), with the cache step writing codes.

kv_step   quantize the new rows' K and V and write the codes to their slots; hand attention the
          layer's code blocks and their scales (QuantizedBlocks), never a float copy
attend    L4's paged attention reading the codes in place, each element dequantized as it is read
          (paged_attention.py says which backend does what)
The new token's own K and V are read back quantized, like every other position: HF's oracle
cache (harness/quantized_cache.py) does the same, and a path that used the unquantized values
for the current token would differ from it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from l5_eviction.mixed import MixedBatchAttention

from .paged_attention import paged_step_attention_quantized
from .pool import QuantizedKvPool


class QuantizedBlocks(NamedTuple):
    """What `kv_step` returns for K (or V): the layer's code blocks and their scales."""

    codes: torch.Tensor  # [num_blocks, block_size, H_kv, D], fp8 or int8, a view of the pool
    scales: torch.Tensor  # [H_kv] float32


class QuantizedAttention(MixedBatchAttention):
    """Runs on a QuantizedKvPool, and on any float pool as L5's attention does (the float32
    baseline of the accuracy measurements, the calibration pass)."""

    def kv_step(self, k, v, pool, meta):
        """k, v [T, H_kv, D] written to meta.slot_mapping as codes; returns QuantizedBlocks for K and
        for V: the layer's own code blocks (views of the pool) and scales."""
        if not isinstance(pool, QuantizedKvPool):
            return super().kv_step(k, v, pool, meta)
        # BEGIN SOLUTION
        layer = self.layer_idx
        pool.set_kv(layer, meta.slot_mapping, k, v)
        k_scales, v_scales = pool.k_scales[layer], pool.v_scales[layer]
        return QuantizedBlocks(pool.k_blocks[layer], k_scales), QuantizedBlocks(pool.v_blocks[layer], v_scales)
        # END SOLUTION

    def attend(self, q, k_all, v_all, meta):
        if not isinstance(k_all, QuantizedBlocks):
            return super().attend(q, k_all, v_all, meta)
        return paged_step_attention_quantized(q, k_all.codes, v_all.codes, k_all.scales, v_all.scales, meta)
