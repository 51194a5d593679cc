"""The L12 oracle: HF's Qwen3 running a cache that stores K and V the way a quantized pool does.

`QuantizingCache` is a DynamicCache whose update replaces each new K/V row by the value a
quantized pool would give back for it: float32(code) * scale, with code the saturated, rounded
x / scale in fp8 e4m3 or int8 (int8 NaN: code -128, read as NaN). HF then attends over exactly
the values a correct quantized engine attends over, so greedy ids must be equal, not close.

This is written here, from the rule in lessons/L12-quantized-kv.md, and never imports the
lesson's package: a wrong quantize in the lesson cannot make its own oracle agree with it.

Why not HF's own QuantizedCache (quanto / HQQ backends): it keeps the most recent tokens
unquantized in a residual buffer (the first update returns the states as given), quantizes in
groups along the head dimension with scales it computes per call, and so per request: neither
the values nor the scales are what a pool with fixed per-head scales stores.
"""

from __future__ import annotations

import torch

_MAX_CODE = {"fp8": 448.0, "int8": 127.0}


def stored_value(x: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [B, H_kv, T, D], scales [H_kv] -> what the pool returns for x, in x's dtype."""
    s = scales.to(x.device, torch.float32).view(1, -1, 1, 1)
    limit = _MAX_CODE[fmt]
    y = torch.clamp(x.float() / s, -limit, limit)
    if fmt == "fp8":
        y = y.to(torch.float8_e4m3fn).float()
    else:
        y = torch.round(y)  # NaN stays NaN: the -128 code reads back as NaN
    return (y * s).to(x.dtype)


class QuantizingCache:
    """Factory of fresh caches (one per request): `QuantizingCache(fmt, k_scales, v_scales)()`."""

    def __init__(self, fmt: str, k_scales: list[torch.Tensor], v_scales: list[torch.Tensor]):
        if fmt not in _MAX_CODE:
            raise ValueError(f"unknown format {fmt!r}")
        self.fmt, self.k_scales, self.v_scales = fmt, k_scales, v_scales

    def __call__(self):
        from transformers import DynamicCache

        spec = self

        class _Cache(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                key_states = stored_value(key_states, spec.k_scales[layer_idx], spec.fmt)
                value_states = stored_value(value_states, spec.v_scales[layer_idx], spec.fmt)
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)

        return _Cache()
