"""L12's number formats: K and V stored as one byte per element, with a float32 scale per KV head.

    stored code  c = quantize(x / scale)        one byte: fp8 e4m3 or int8
    read value   x' = float32(c) * scale        the only value attention ever sees

    fp8 e4m3 (torch.float8_e4m3fn)   s eeee mmm    bias 7, no infinities, NaN = s 1111 111
        largest 448 = 1.75 * 2^8, smallest normal 2^-6, smallest subnormal 2^-9
        relative step 2^-3 near every power of two: 3 mantissa bits (4 significant with the implicit
        leading one), about 6% worst-case rounding error
    int8 (symmetric)                 -127..127      one step = scale, the same everywhere
        code -128 is never produced by a finite value: it stands for NaN

A scale maps the values a head really holds onto the format's range: with amax the largest
|x| a head writes, scale = amax / 448 (fp8) or amax / 127 (int8) uses every code. Scale 1.0 on
fp8 stores small values with few significant bits or as subnormals, and lets an |x| above 448
saturate; that is the silent accuracy loss engines warn about.

Scales are fixed for a pool's life (static quantization, as vLLM's kv_cache_dtype=fp8 with
calibrated scales): per tensor (one scale per layer for K, one for V) or per KV head.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from l1_contiguous import InputError


@dataclass(frozen=True)
class KvFormat:
    name: str
    dtype: torch.dtype  # what the pool stores
    max_code: float  # the largest magnitude a code can hold


FP8_E4M3 = KvFormat("fp8", torch.float8_e4m3fn, 448.0)
INT8 = KvFormat("int8", torch.int8, 127.0)
FORMATS = {f.name: f for f in (FP8_E4M3, INT8)}
INT8_NAN_CODE = -128  # the one int8 code a finite value never maps to
GRANULARITIES = ("tensor", "head", "one")  # one: scale 1.0 everywhere, no calibration (the trap)


def kv_format(name: str) -> KvFormat:
    if name not in FORMATS:
        raise InputError(f"unknown KV format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def quantize(x: torch.Tensor, scales: torch.Tensor, fmt: KvFormat) -> torch.Tensor:
    """x [T, H_kv, D] (any float dtype), scales [H_kv] float32 -> codes [T, H_kv, D] in fmt.dtype.

    Contract: each element is divided by its head's scale in float32; values beyond the format's
    range (infinities too) saturate to +-max_code; int8 rounds half to even; NaN stays NaN (fp8's
    NaN code, int8's INT8_NAN_CODE), so a NaN written upstream is still visible when read.
    """
    # BEGIN SOLUTION
    scaled = x.float() / scales.view(1, -1, 1)
    clamped = scaled.clamp(-fmt.max_code, fmt.max_code)  # clamp keeps NaN, saturates +-inf
    if fmt.dtype == torch.int8:
        codes = torch.round(clamped).nan_to_num(nan=INT8_NAN_CODE)  # round(): half to even
        return codes.to(torch.int8)
    return clamped.to(fmt.dtype)  # float32 -> e4m3 rounds to nearest even
    # END SOLUTION


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., H_kv, D] in a KvFormat's dtype, scales [H_kv] float32 -> values in `dtype`.

    Contract: float32(code) * scale, one float32 multiply per element (every read path and the
    HF oracle compute exactly this), then cast to dtype; int8's INT8_NAN_CODE reads as NaN.
    """
    # BEGIN SOLUTION
    values = codes.float() * scales.view(-1, 1)
    if codes.dtype == torch.int8:
        values = values.masked_fill(codes == INT8_NAN_CODE, float("nan"))
    return values.to(dtype)
    # END SOLUTION


@dataclass
class KvScales:
    """One float32 scale per layer and KV head for K and for V: k[layer] [H_kv], v[layer] [H_kv]."""

    fmt: KvFormat
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    granularity: str = "head"

    def to(self, device) -> "KvScales":
        return KvScales(self.fmt, [s.to(device) for s in self.k], [s.to(device) for s in self.v],
                        self.granularity)

    def tag(self) -> bytes:
        return cache_tag(self.fmt, self.k, self.v)


def scales_from_amax(amax: torch.Tensor, granularity: str, fmt: KvFormat) -> torch.Tensor:
    """amax [L, H_kv] (the largest |value| each layer's head wrote in calibration) -> scales [L, H_kv].

    Contract: "head" maps each head's amax onto max_code; "tensor" gives every head of a layer
    the scale of that layer's largest amax; "one" is 1.0 everywhere. A head that only ever wrote
    zeros gets scale 1.0 (any scale stores zeros exactly, and dividing by 0 would not); an amax
    that is NaN, infinite or negative is a broken calibration: InputError, nothing returned.
    """
    # BEGIN SOLUTION
    if granularity not in GRANULARITIES:
        raise InputError(f"unknown scale granularity {granularity!r}; choose one of {', '.join(GRANULARITIES)}")
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise InputError("calibration gave a NaN, infinite or negative amax; check the calibration text "
                         "and the model (a NaN in K or V poisons every scale)")
    amax = amax.float()
    if granularity == "one":
        return torch.ones_like(amax)
    if granularity == "tensor":
        amax = amax.amax(dim=1, keepdim=True).expand_as(amax)
    scales = amax / fmt.max_code
    return torch.where(scales > 0, scales, torch.ones_like(scales))
    # END SOLUTION


def cache_tag(fmt: KvFormat, k_scales: list[torch.Tensor], v_scales: list[torch.Tensor]) -> bytes:
    """16 bytes that name how a pool's blocks were written: the format and every scale's exact bits.

    L12's block keys chain from this tag (it is block 0's parent), so a block written under other
    scales (a recalibrated engine, another engine's pool) never matches. Contract: equal for equal
    format and scales in any process; different if the format or any one scale differs, by
    however little (one ulp), K's or V's, in any layer.
    """
    # BEGIN SOLUTION
    h = hashlib.blake2b(digest_size=16)
    h.update(fmt.name.encode())
    for which, layers in ((b"K", k_scales), (b"V", v_scales)):  # swapping K's and V's scales changes it
        for scales in layers:
            values = scales.detach().float().cpu().flatten().tolist()
            h.update(which + struct.pack(f"<I{len(values)}f", len(values), *values))
    return h.digest()
    # END SOLUTION
