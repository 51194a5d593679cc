"""L12's pool: L3's block tensors holding one-byte codes, plus the scales that give them values.

    K codes [layer]  [num_blocks, block_size, H_kv, D]   fp8 e4m3 or int8: 1 byte per element
    k_scales[layer]  [H_kv] float32                       fixed for the pool's life
    (V the same)

Writes quantize (`set_kv`); every reader dequantizes with the same scales. A block's bytes are
codes only: with scales per layer and head (not per block), the scales are one table of
2 * layers * H_kv floats for the whole pool, counted once in `nbytes`, not per block.
"""

from __future__ import annotations

import torch

from l1_contiguous import InputError
from l3_block_kernel import BlockKvPool

from .quantize import INT8_NAN_CODE, KvScales, quantize


def check_scales(scales: KvScales, cfg) -> None:
    """One positive, finite float32 scale per KV head of every layer, for K and V."""
    for name, layers in (("k", scales.k), ("v", scales.v)):
        if len(layers) != cfg.num_hidden_layers:
            raise InputError(f"{name} scales: {len(layers)} layers, the model has {cfg.num_hidden_layers}")
        for i, s in enumerate(layers):
            if s.dtype != torch.float32 or tuple(s.shape) != (cfg.num_key_value_heads,):
                raise InputError(f"{name} scales of layer {i} must be float32 [{cfg.num_key_value_heads}], "
                                 f"got {s.dtype} {tuple(s.shape)}")
            if not bool(torch.isfinite(s).all() & (s > 0).all()):
                raise InputError(f"{name} scales of layer {i} must be finite and > 0, got {s.tolist()}")


class QuantizedKvPool(BlockKvPool):
    def __init__(self, cfg, num_blocks: int, block_size: int, scales: KvScales, device="cpu"):
        check_scales(scales, cfg)
        super().__init__(cfg, num_blocks, block_size, scales.fmt.dtype, device)
        self.fmt = scales.fmt
        self.set_scales(scales)

    def set_scales(self, scales: KvScales) -> None:
        """New scales for every later write and read. Blocks already written keep codes made under the
        old ones: the engine's cache tag changes with them, so no cached block is reused (engine.py)."""
        if scales.fmt != self.fmt:
            raise InputError(f"this pool stores {self.fmt.name}; scales for {scales.fmt.name} do not fit it")
        self.scales = scales.to(self.K[0].device)
        self.tag = self.scales.tag()  # hashed once here, not at every lookup

    @property
    def k_scales(self) -> list[torch.Tensor]:
        return self.scales.k

    @property
    def v_scales(self) -> list[torch.Tensor]:
        return self.scales.v

    def set_kv(self, layer, slot_mapping, k, v):
        self.K[layer][slot_mapping] = quantize(k, self.k_scales[layer], self.fmt)
        self.V[layer][slot_mapping] = quantize(v, self.v_scales[layer], self.fmt)

    def fill_nan(self) -> None:
        """Every slot to the format's NaN code (tests: a slot read before it is written shows up)."""
        for t in self.K + self.V:
            if t.dtype == torch.int8:
                t.fill_(INT8_NAN_CODE)
            else:
                t.fill_(float("nan"))

    def nbytes(self) -> int:
        return super().nbytes() + sum(s.numel() * 4 for s in self.k_scales + self.v_scales)


class CalibrationPool(BlockKvPool):
    """A float pool that also records, per layer and KV head, the largest |K| and |V| ever written."""

    def __init__(self, cfg, num_blocks, block_size, dtype=torch.float32, device="cpu"):
        super().__init__(cfg, num_blocks, block_size, dtype, device)
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads)
        self.k_amax = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v_amax = torch.zeros(shape, dtype=torch.float32, device=device)

    def set_kv(self, layer, slot_mapping, k, v):
        """L2's write, and the running per-head amax of what was written (NaN must reach the amax:
        a calibration that saw a NaN is broken, and `scales_from_amax` refuses it)."""
        super().set_kv(layer, slot_mapping, k, v)
        # BEGIN SOLUTION
        for amax, x in ((self.k_amax, k), (self.v_amax, v)):  # x [T, H_kv, D]
            amax[layer] = torch.maximum(amax[layer], x.detach().float().abs().amax(dim=(0, 2)))
        # END SOLUTION
