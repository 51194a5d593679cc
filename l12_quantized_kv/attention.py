"""L12's attention: L5's (mixed steps), with the cache step writing codes and reading values.

Prefill rows: quantize and write, gather the histories' codes, dequantize them (L2's path, on
    one-byte rows: the gather moves a quarter of float32's bytes).
Decode rows: quantize and write, then hand the code blocks and their scales to a paged-attention
    backend that dequantizes each element as it reads it (paged_attention.py).
The new token's own K and V are read back quantized, like every other position: HF's oracle
cache (harness/quantized_cache.py) does the same, and a path that used the unquantized values
for the current token would differ from it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from l5_eviction.mixed import MixedBatchAttention

from .paged_attention import paged_attention_quantized
from .pool import QuantizedKvPool
from .quantize import dequantize


class QuantizedBlocks(NamedTuple):
    """What a decode `kv_step` returns for K (or V): the layer's code blocks and their scales."""

    codes: torch.Tensor  # [num_blocks, block_size, H_kv, D], fp8 or int8, a view of the pool
    scales: torch.Tensor  # [H_kv] float32


class QuantizedAttention(MixedBatchAttention):
    """Runs on a QuantizedKvPool, and on any float pool as L5's attention does (the float32
    baseline of the accuracy measurements, the calibration pass)."""

    def kv_step(self, k, v, pool, meta):
        """k, v [T, H_kv, D] written to meta.slot_mapping as codes. Prefill: the batch's histories
        [S, H_kv, D] in k's dtype (dequantized copies). Decode: QuantizedBlocks for K and for V."""
        if not isinstance(pool, QuantizedKvPool):
            return super().kv_step(k, v, pool, meta)
        # BEGIN SOLUTION
        layer = self.layer_idx
        pool.set_kv(layer, meta.slot_mapping, k, v)
        k_scales, v_scales = pool.k_scales[layer], pool.v_scales[layer]
        if meta.is_prefill:
            return (dequantize(pool.K[layer][meta.kv_indices], k_scales, k.dtype),
                    dequantize(pool.V[layer][meta.kv_indices], v_scales, v.dtype))
        return QuantizedBlocks(pool.k_blocks[layer], k_scales), QuantizedBlocks(pool.v_blocks[layer], v_scales)
        # END SOLUTION

    def attend(self, q, k_all, v_all, meta):
        if not isinstance(k_all, QuantizedBlocks):
            return super().attend(q, k_all, v_all, meta)
        return paged_attention_quantized(q, k_all.codes, v_all.codes, k_all.scales, v_all.scales,
                                         meta.block_tables, meta.context_lens, backend=meta.backend,
                                         check_values=False)
