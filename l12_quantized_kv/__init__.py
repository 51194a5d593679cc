"""L12: a quantized KV cache: K and V stored in fp8 (e4m3) or int8 with per-head scales."""

from .quantize import (FORMATS, FP8_E4M3, GRANULARITIES, INT8, INT8_NAN_CODE, KvFormat, KvScales, cache_tag,
                       dequantize, kv_format, quantize, scales_from_amax)

__all__ = [
    "FORMATS", "FP8_E4M3", "GRANULARITIES", "INT8", "INT8_NAN_CODE", "KvFormat", "KvScales", "cache_tag",
    "dequantize", "kv_format", "quantize", "scales_from_amax",
]
