"""L12's read paths: L3's decode attention and L4's attention for a whole step, over one-byte codes.

    k_codes, v_codes (one layer)   [num_blocks, block_size, H_kv, D]   fp8 e4m3 or int8
    k_scales, v_scales             [H_kv] float32
    the value of an element        float32(code) * scale[kv_head]      (quantize.dequantize)

The backends are L3's, given the cache's format and scales:
- "kernel", "emulated": csrc/paged_attention.cu with a one-byte cache type; each lane decodes its
  codes in registers as it loads them, K's scale folded into the query, V's into the output.
- "cpu": csrc/paged_attention_cpu.cpp; each K and V row is dequantized into float scratch once,
  for all the query heads of its GQA group.
- "reference", "gather": dequantize the blocks the tables use into a compact float cache (a copy:
  what the kernel exists to avoid) and run L3's PyTorch algorithm on it, the oracle for the others.

A step of the engine (decodes and prefill chunks, L4's metadata) goes through
`paged_step_attention_quantized`: L4's CPU kernel and L4's reference read the codes in place;
on CUDA (and emulated) a step of decodes only takes L3's kernel above, and a step with prefill
rows dequantizes the blocks it reads and runs L4's kernel on them (L4's CUDA kernel reads float
caches only: teaching it codes is the same change L3's kernel got, and an exercise).
"""

from __future__ import annotations

import torch

from l1_contiguous import InputError
from l3_block_kernel.paged_attention import (SPLIT_K_PARTITION, expect_tensor, check_inputs, paged_attention_cpu,
                                             paged_attention_gather, paged_attention_reference, resolve_call,
                                             run_kernel)

from l4_paged_prefill import PagedStepMeta, paged_prefill_attention

from .quantize import FORMATS, dequantize

CODE_DTYPES = tuple(f.dtype for f in FORMATS.values())


def paged_attention_quantized(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                              k_scales: torch.Tensor, v_scales: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor,
                              scale: float | None = None, backend: str = "auto", *,
                              check_values: bool = True, split_k: bool | None = None,
                              partition_size: int = SPLIT_K_PARTITION) -> torch.Tensor:
    """Decode attention over a quantized cache; as L3's `paged_attention` otherwise.

    q [num_seqs, H, D] (float32, float16 or bfloat16 for the kernels; float32 for "cpu");
    k_codes, v_codes [num_blocks, block_size, H_kv, D] contiguous, both torch.float8_e4m3fn or both
    torch.int8; k_scales, v_scales float32 [H_kv] contiguous on q's device, finite and > 0;
    block_tables int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs].
    Returns [num_seqs, H, D] in q's dtype: attention over the values float32(code) * scale. Slots
    past a sequence's length may hold any code (NaN codes too) and never reach the result.

    check_values: also check every length, every block id a sequence uses, and that the scales are
    finite and positive; on CUDA that reads them back (a sync), so a hot loop over a pool that
    checked its scales when they were set passes False (the engine does: QuantizedKvPool checks
    them in set_scales). A bad scale gives wrong numbers, never a read outside the pool.
    backend, split_k, partition_size: as in L3's `paged_attention`.
    """
    expect_tensor(k_codes.dtype in CODE_DTYPES,
            "k_codes must hold fp8 (torch.float8_e4m3fn) or int8 codes; a float cache goes to "
            "l3_block_kernel.paged_attention", k_codes)
    expect_tensor(v_codes.dtype == k_codes.dtype, f"v_codes must have k_codes' dtype {k_codes.dtype}", v_codes)
    check_inputs(q, k_codes, v_codes, block_tables, context_lens, cache_dtype=k_codes.dtype)
    num_kv_heads = k_codes.shape[2]
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        expect_tensor(scales.dtype == torch.float32 and tuple(scales.shape) == (num_kv_heads,)
                and scales.device == q.device and scales.is_contiguous(),
                f"{name} must be a contiguous float32 [num_kv_heads={num_kv_heads}] on q's device {q.device}",
                scales)
        if check_values and not bool((torch.isfinite(scales) & (scales > 0)).all()):
            raise InputError(f"{name} must be finite and > 0 (a scale of 0 or NaN makes every code of its head "
                             f"0 or NaN), got {scales.tolist()}; recalibrate or use scales_from_amax")
    backend, scale = resolve_call(q, k_codes, block_tables, context_lens, backend, check_values, scale)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if backend in ("kernel", "emulated"):
        return run_kernel(backend, q, k_codes, v_codes, block_tables, context_lens, scale, split_k, partition_size,
                          k_scales, v_scales)
    if backend == "cpu":
        return paged_attention_cpu(q, k_codes, v_codes, block_tables, context_lens, scale, k_scales, v_scales)
    k_cache, v_cache, compact_tables = _dequantize_used_blocks(q, k_codes, v_codes, k_scales, v_scales,
                                                               block_tables, context_lens)
    attend = paged_attention_gather if backend == "gather" else paged_attention_reference
    return attend(q, k_cache, v_cache, compact_tables, context_lens, scale)


def _dequantize_used_blocks(q, k_codes, v_codes, k_scales, v_scales, block_tables, context_lens):
    """The blocks the sequences read, dequantized in q's dtype, as a compact cache [n_used, ...] and
    tables remapped to it (padding columns: 0, which L3 never reads). Dequantizing the whole pool
    would cost a float copy of every block on every call."""
    block_size = k_codes.shape[1]
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = columns[None, :] < -(-context_lens.long()[:, None] // block_size)  # [num_seqs, max_blocks]
    ids, compact_ids = torch.unique(block_tables[used].long(), return_inverse=True)
    compact_tables = torch.zeros_like(block_tables)
    compact_tables[used] = compact_ids.to(block_tables.dtype)
    k_cache = dequantize(k_codes[ids], k_scales, q.dtype)
    v_cache = dequantize(v_codes[ids], v_scales, q.dtype)
    return k_cache, v_cache, compact_tables


def paged_step_attention_quantized(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                                   k_scales: torch.Tensor, v_scales: torch.Tensor, meta: PagedStepMeta) -> torch.Tensor:
    """One step's attention (L4's metadata: decodes and prefill chunks) over a quantized cache:
    q [T, H, D] -> [T, H, D]. The pool's scales were checked when they were set, the tables come
    from the allocator: no value checks here (on CUDA they would sync)."""
    tables, lens, backend = meta.block_tables, meta.context_lens, meta.backend
    if backend in ("cpu", "reference"):
        return paged_prefill_attention(q, k_codes, v_codes, meta.cu_seqlens_q, lens, tables, backend=backend,
                                       max_query_len=meta.max_query_len, check_values=False, k_scales=k_scales,
                                       v_scales=v_scales)
    if meta.max_query_len == 1:  # one row per request: L3's kernel reads the codes in place
        return paged_attention_quantized(q, k_codes, v_codes, k_scales, v_scales, tables, lens, backend=backend,
                                         check_values=False)
    k_cache, v_cache, compact_tables = _dequantize_used_blocks(q, k_codes, v_codes, k_scales, v_scales, tables, lens)
    return paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, lens, compact_tables, backend=backend,
                                   max_query_len=meta.max_query_len, check_values=False)
