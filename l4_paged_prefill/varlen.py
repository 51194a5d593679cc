"""L4's read path: one paged attention for a ragged batch of queries, prefill chunks and decodes alike.

    q (flat)       [ a0 a1 a2 a3 | b0 | c0 c1 ]       cu_seqlens_q [0, 4, 5, 7]
    context_lens     a: 10          b: 7   c: 2       (keys in the pool, the new rows' own included)
    positions        6  7  8  9      6     0  1       row i of n new rows sits at context_len - n + i
    block_tables     a: [3, 8, 1]   b: [5, 2]   c: [4]     (block_size 4)

Row a2 (position 8) reads keys 0..8 of request a: block 3 whole, block 8 whole, row 0 of block 1.
Nothing is gathered and no [T, S] mask exists: each row walks its own request's table, block by
block, keeping a running softmax state (max, sum, weighted values), exactly as L3's decode does;
a decode is the case n = 1. A sliding layer (window W) reads only positions (p - W, p].

One algorithm, four implementations:
- `paged_prefill_reference`: PyTorch, runs anywhere; the oracle for the kernels.
- csrc/paged_prefill_cpu.cpp (backend "cpu"): the algorithm for a CPU's cores, float32.
- csrc/paged_prefill.cu (backend "kernel" on CUDA, "emulated" on a CPU under L3's emulation).
`paged_prefill_attention` checks the inputs and picks one. Every implementation can also return
each row's log-sum-exp, so that two partial attentions over disjoint keys can be merged
(`merge_states`): cascade attention (cascade.py) is built on that.
"""

from __future__ import annotations

import torch

from l1_contiguous.errors import InputError
from l3_block_kernel.paged_attention import check_block_ids, check_explicit_backend, expect_tensor

from .kernel_build import load_cpu_kernel, load_emulation, load_extension

BACKENDS = ("auto", "reference", "cpu", "emulated", "kernel")
KERNEL_HEAD_DIMS = (32, 64, 128)
KERNEL_MAX_GROUP = 16  # query heads per KV head: the CUDA kernel's tile holds 16 (row, head) pairs
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # PrefillDtype in paged_prefill.h
# L12's one-byte caches: the CPU kernel's cache_format codes (kv_codes.h's CacheFormat).
CODE_FORMATS = {torch.float8_e4m3fn: 1, torch.int8: 2}


def query_positions(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal offset: (position [T] int64, request [T] int64) of every query row.

    Rows [cu_seqlens_q[r], cu_seqlens_q[r + 1]) are request r's n_r new tokens, the last n_r of
    its context_lens[r] keys; a request may have no rows at all.
    """
    # BEGIN SOLUTION
    cu = cu_seqlens_q.long()
    query_lens = cu[1:] - cu[:-1]
    request = torch.repeat_interleave(torch.arange(len(query_lens), device=cu.device), query_lens)
    first_position = context_lens.long() - query_lens  # of each request's first new row
    index_in_request = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1][request]
    return first_position[request] + index_in_request, request
    # END SOLUTION


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and over disjoint keys B -> attention over A and B together.

    out_* [T, H, D], each the softmax-weighted mean of its keys' values; lse_* [T, H], the
    log of the sum of exp(score) over its keys (-inf: the row saw no key there, and its out is
    ignored). Returns (out [T, H, D], lse [T, H]) in float32 (float64 for float64 lse); a row with no key on either side
    gets out 0 and lse -inf, never NaN.
    """
    # BEGIN SOLUTION
    dtype = torch.promote_types(lse_a.dtype, torch.float32)
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    seen = torch.maximum(lse_a, lse_b) > float("-inf")          # [T, H]: a key on either side
    shift = torch.where(seen, torch.maximum(lse_a, lse_b), 0.0)  # the larger: exp never overflows
    weight_a, weight_b = torch.exp(lse_a - shift), torch.exp(lse_b - shift)  # a side with no key: 0
    total = torch.where(seen, weight_a + weight_b, 1.0)
    lse = torch.where(seen, shift + torch.log(total), float("-inf"))

    def share(out, weight):  # a side with no key adds 0, even if its out holds NaN
        return torch.where(weight[..., None] > 0, out.to(dtype) * (weight / total)[..., None], 0.0)

    return share(out_a, weight_a) + share(out_b, weight_b), lse
    # END SOLUTION


def paged_prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float | None = None, window: int | None = None, *, key_begin: int = 0,
                            causal: bool = True, k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The algorithm in PyTorch: (out [T, H, D] in q's dtype, lse [T, H] float32, float64 for float64 q).
    A cache of L12's codes is read as float(code) * its KV head's scale (k_scales, v_scales [H_kv]).

    All rows move together; the loop runs over block columns j. Block j of each row's request
    gives a partial state (its softmax-weighted values and log-sum-exp over the keys of that block
    the row reads), and `merge_states` folds it into the running one: online softmax, one block at
    a time. Math in float32 (float64 for float64 inputs).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    math_dtype = torch.promote_types(q.dtype, torch.float32)
    group = num_heads // num_kv_heads
    positions, request = query_positions(cu_seqlens_q, context_lens)
    first, end = key_bounds(positions, context_lens.long()[request], window, key_begin, causal)  # [T] each
    q_grouped = q.to(math_dtype).view(num_tokens, num_kv_heads, group, head_dim) * scale
    out = torch.zeros(num_tokens, num_kv_heads, group, head_dim, dtype=math_dtype, device=q.device)
    lse = torch.full((num_tokens, num_kv_heads, group), float("-inf"), dtype=math_dtype, device=q.device)
    last_end = int(end.max()) if num_tokens else 0
    for j in range(-(-last_end // block_size)):
        key_pos = j * block_size + torch.arange(block_size, device=q.device)           # [block_size]
        visible = (key_pos[None, :] >= first[:, None]) & (key_pos[None, :] < end[:, None])  # [T, block_size]
        block_ids = torch.where(visible.any(1), block_tables[request, j].long(), 0)    # unread: block 0
        k = read_rows(k_cache, block_ids, k_scales, math_dtype)                        # [T, bs, H_kv, D]
        v = torch.where(visible[:, :, None, None], read_rows(v_cache, block_ids, v_scales, math_dtype), 0.0)
        scores = torch.einsum("tkgd,tbkd->tkgb", q_grouped, k)
        scores = torch.where(visible[:, None, None, :], scores, float("-inf"))
        block_lse = torch.logsumexp(scores, -1)                                        # [T, H_kv, G]
        weights = torch.exp(scores - torch.where(torch.isinf(block_lse), 0.0, block_lse)[..., None])
        block_out = torch.einsum("tkgb,tbkd->tkgd", weights, v)
        out, lse = merge_states(out, lse, block_out, block_lse)
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype), lse.reshape(num_tokens, num_heads)


def read_rows(cache, block_ids, scales, math_dtype):
    """cache[block_ids] as numbers: [n, block_size, H_kv, D], codes times their head's scale."""
    rows = cache[block_ids].to(math_dtype)
    return rows if scales is None else rows * scales.to(math_dtype)[:, None]


def key_bounds(positions, context_lens, window: int | None, key_begin: int, causal: bool):
    """The key positions [first, end) each query row reads: [T] int64 each (paged_prefill.h's key_range)."""
    first = torch.full_like(positions, key_begin)
    if window is not None:
        first = torch.maximum(first, positions - window + 1)
    return first, positions + 1 if causal else context_lens


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float | None = None, window: int | None = None, *, backend: str = "auto",
                            max_query_len: int | None = None, key_begin: int = 0, causal: bool = True,
                            return_lse: bool = False, check_values: bool = True,
                            k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None):
    """Attention of a ragged batch of query rows, each reading its request's keys through its block table.

    q [T, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D] (contiguous, q's dtype);
    cu_seqlens_q int32 [B + 1]; context_lens int32 [B]; block_tables int32 [B, max_blocks].
    Returns out [T, H, D] in q's dtype, and with return_lse also lse float32 [T, H].
    window: a sliding layer's W (a query at p reads (p - W, p]), or None.
    key_begin, causal: cascade's two passes (cascade.py); the defaults read every earlier key.
    max_query_len: the longest request's row count (the CUDA grid's size); computed from
    cu_seqlens_q when None, which on CUDA reads it back to the host.
    check_values: also check lengths, row offsets and every block id a row reads (on CUDA a sync;
    an engine whose tables came from its allocator passes False). The cpu and emulated backends
    always check, in C++, before reading anything.
    backend: "cpu", "emulated", "kernel" (CUDA), "reference", or "auto": the kernel on CUDA, the
    CPU kernel for float32 on a CPU, else the reference.
    k_scales, v_scales: float32 [H_kv] when the caches hold L12's one-byte codes (torch.float8_e4m3fn
    or torch.int8), read as float(code) * scale; the "cpu" and "reference" backends take them.
    """
    check_prefill_inputs(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    check_scales(q, k_cache, k_scales, v_scales)
    check_window(window, causal)
    backend = pick_backend(backend, q, k_cache)
    if k_scales is not None and backend in ("kernel", "emulated"):
        raise InputError(f"backend={backend!r} reads float caches only; a cache of codes takes backend='cpu' or "
                         "'reference' (L12 dequantizes the blocks a step reads for the CUDA kernel)")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if len(context_lens) else 0
    if check_values and backend in ("reference", "kernel"):
        check_prefill_values(q.shape[0], k_cache, cu_seqlens_q, context_lens, block_tables, max_query_len, causal,
                             window, key_begin)
    if backend == "reference":
        out, lse = paged_prefill_reference(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                           window, key_begin=key_begin, causal=causal, k_scales=k_scales,
                                           v_scales=v_scales)
    elif backend == "kernel":
        out, lse = load_extension().forward(q.contiguous(), k_cache, v_cache, cu_seqlens_q.contiguous(),
                                            context_lens.contiguous(), block_tables.contiguous(), max_query_len,
                                            scale, window or 0, key_begin, causal)
    else:
        out, lse = run_on_host(backend, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                               window, key_begin, causal, max_query_len, k_scales, v_scales)
    return (out, lse) if return_lse else out


def check_window(window, causal: bool = True) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise InputError(f"window must be None or a positive int (a sliding layer's size), got {window!r}")
    if window is not None and not causal:
        raise InputError("causal=False (cascade's prefix pass) takes no window: a sliding layer is not cascaded")


def run_on_host(backend, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window, key_begin,
                causal, max_query_len, k_scales=None, v_scales=None):
    """Backend "cpu" or "emulated": the C++ library through ctypes, on contiguous CPU tensors
    (codes with their scales: "cpu" only)."""
    cu_seqlens_q, context_lens, block_tables = (t.contiguous() for t in (cu_seqlens_q, context_lens, block_tables))
    scales = None if k_scales is None else (k_scales.contiguous(), v_scales.contiguous())
    run, tail = host_kernel(backend, q, k_cache, scales)
    shared = table_arguments(q, k_cache, cu_seqlens_q, context_lens, block_tables, max_query_len, scale)
    return call_host(run, q, k_cache, v_cache, shared, (window or 0, key_begin, int(causal), *tail))


def host_kernel(backend, q, k_cache, scales):
    """The C++ function for `backend` and its last arguments (threads, cache format, scale pointers)."""
    if backend == "cpu":
        pointers = (None, None) if scales is None else (scales[0].data_ptr(), scales[1].data_ptr())
        return load_cpu_kernel().l4_cpu_paged_prefill, (torch.get_num_threads(), CODE_FORMATS.get(k_cache.dtype, 0),
                                                          *pointers)
    return load_emulation().l4_emulated_paged_prefill, (_DTYPE_CODES[q.dtype],)


def table_arguments(q, k_cache, cu_seqlens_q, context_lens, block_tables, max_query_len, scale) -> tuple:
    """The C++ call's arguments every layer of a step shares: the metadata's pointers and the sizes."""
    return (cu_seqlens_q.data_ptr(), context_lens.data_ptr(), block_tables.data_ptr(), len(context_lens),
            q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], block_tables.shape[1],
            k_cache.shape[0], max_query_len, scale)


def call_host(run, q, k_cache, v_cache, shared: tuple, tail: tuple, want_lse: bool = True):
    """-> out [T, H, D], and lse [T, H] (None unless want_lse: the kernel then writes none)."""
    q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32) if want_lse else None
    error = run(out.data_ptr(), None if lse is None else lse.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                v_cache.data_ptr(), *shared, *tail)
    if error is not None:
        raise InputError(error.decode())
    return out, lse


class PagedPrefillPlan:
    """One step's attention, planned once for all its layers (FlashInfer's plan/run split).

    Every layer of a step attends over the same rows, lengths and tables; only q, the layer's
    caches and its window differ. `paged_prefill_attention` checks each input on every call, which
    for a decode of a small model costs more than the kernel itself. `run` makes its checks on the
    first call and notes what the call looked like; that call and every later one alike (shapes,
    dtypes, device, contiguous caches) go straight to the host kernel with the metadata's arguments
    laid out once; a call that looks different is checked and planned again. Other backends take
    the dispatcher on every call. The metadata tensors must not change while the plan is used (a
    step's never do).
    """

    def __init__(self, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                 max_query_len: int, backend: str = "auto"):
        self.cu_seqlens_q, self.context_lens, self.block_tables = cu_seqlens_q, context_lens, block_tables
        self.max_query_len, self.backend = max_query_len, backend
        self.alike = None  # what the checked call looked like; None: no call checked yet
        self.run_host = self.shared = self.tail = None  # run_host None: the dispatcher takes the calls

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None = None):
        """paged_prefill_attention(q, k_cache, v_cache, <the plan's metadata>, window=window) -> [T, H, D]."""
        looks = (q.shape, q.dtype, q.is_cpu, k_cache.shape, k_cache.dtype, v_cache.shape, v_cache.dtype,
                 k_cache.is_contiguous() and v_cache.is_contiguous())
        if looks != self.alike:
            self.plan_call(q, k_cache, v_cache, window, looks)
        if self.run_host is None:
            return paged_prefill_attention(q, k_cache, v_cache, self.cu_seqlens_q, self.context_lens,
                                           self.block_tables, window=window, backend=self.backend,
                                           max_query_len=self.max_query_len, check_values=False)
        return call_host(self.run_host, q, k_cache, v_cache, self.shared, (window or 0, *self.tail),
                         want_lse=False)[0]

    def plan_call(self, q, k_cache, v_cache, window, looks) -> None:
        """paged_prefill_attention's checks of this call, and what later calls that look the same
        take: the host kernel with its arguments laid out (backend "cpu" or "emulated", float
        caches), else the dispatcher."""
        check_prefill_inputs(q, k_cache, v_cache, self.cu_seqlens_q, self.context_lens, self.block_tables)
        check_window(window)
        backend = pick_backend(self.backend, q, k_cache)
        self.run_host, self.alike = None, looks
        if backend not in ("cpu", "emulated") or k_cache.dtype in CODE_FORMATS:
            return
        self.cu_seqlens_q, self.context_lens, self.block_tables = (
            t.contiguous() for t in (self.cu_seqlens_q, self.context_lens, self.block_tables))
        self.run_host, host_tail = host_kernel(backend, q, k_cache, None)
        self.shared = table_arguments(q, k_cache, self.cu_seqlens_q, self.context_lens, self.block_tables,
                                      self.max_query_len, q.shape[-1] ** -0.5)
        self.tail = (0, 1, *host_tail)  # key_begin 0, causal


def check_prefill_inputs(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables) -> None:
    """Shapes, dtypes and devices (no GPU sync); InputError naming what was expected. Each message
    is made only for a check that fails: a step runs these checks, and formatting its dozen
    messages (dtypes, devices) cost more than the checks themselves."""
    expect_tensor(q.dim() == 3 and q.dtype.is_floating_point, "q must be a float [num_tokens, num_heads, head_dim]", q)
    expect_tensor(k_cache.dim() == 4 and k_cache.shape[3] == q.shape[2],
                  lambda: f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim={q.shape[2]}]", k_cache)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        expect_tensor(cache.shape == k_cache.shape and cache.dtype in (q.dtype, *CODE_FORMATS)
                      and cache.dtype == k_cache.dtype and cache.is_contiguous(),
                      lambda: f"{name} must be contiguous, shaped like k_cache, in q's dtype {q.dtype} (or both "
                              "hold fp8/int8 codes)", cache)
    expect_tensor(q.shape[1] % k_cache.shape[2] == 0,
                  lambda: f"q's num_heads must be a multiple of the caches' num_kv_heads {k_cache.shape[2]}", q)
    num_seqs = len(context_lens)
    expect_tensor(context_lens.dtype == torch.int32 and context_lens.dim() == 1, "context_lens must be int32 [B]",
                  context_lens)
    expect_tensor(cu_seqlens_q.dtype == torch.int32 and tuple(cu_seqlens_q.shape) == (num_seqs + 1,),
                  lambda: f"cu_seqlens_q must be int32 [B + 1 = {num_seqs + 1}]", cu_seqlens_q)
    expect_tensor(block_tables.dtype == torch.int32 and block_tables.dim() == 2 and len(block_tables) == num_seqs,
                  lambda: f"block_tables must be int32 [B = {num_seqs}, max_blocks]", block_tables)
    device = q.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cu_seqlens_q", cu_seqlens_q),
                    ("context_lens", context_lens), ("block_tables", block_tables)):
        expect_tensor(t.device == device, lambda: f"{name} must be on q's device {device}", t)


def check_scales(q, k_cache, k_scales, v_scales) -> None:
    """Scales come with a cache of codes, and only with one: float32 [H_kv], contiguous, on q's device."""
    codes = k_cache.dtype in CODE_FORMATS
    if codes != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise InputError("k_scales and v_scales go with caches of fp8/int8 codes, and both must be given "
                         f"(the caches hold {k_cache.dtype})")
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales is not None:
            expect_tensor(scales.dtype == torch.float32 and tuple(scales.shape) == (k_cache.shape[2],)
                          and scales.device == q.device,
                          f"{name} must be float32 [num_kv_heads={k_cache.shape[2]}] on q's device {q.device}", scales)


def check_prefill_values(num_tokens: int, k_cache, cu_seqlens_q, context_lens, block_tables, max_query_len: int,
                         causal: bool = True, window: int | None = None, key_begin: int = 0) -> None:
    """The checks paged_prefill.h's check_prefill_tables makes in C++, for the reference and CUDA paths:
    row offsets, lengths, and every block id some row reads."""
    num_blocks, block_size = k_cache.shape[:2]
    capacity = block_tables.shape[1] * block_size
    cu, lens = cu_seqlens_q.long().cpu(), context_lens.long().cpu()
    query_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise InputError(f"cu_seqlens_q must start at 0 and end at the number of query rows {num_tokens}, "
                         f"got {int(cu[0])} and {int(cu[-1])}")
    bad = ((query_lens < 0) | (query_lens > max_query_len)).nonzero()
    if len(bad):
        raise InputError(f"request {int(bad[0])} has {int(query_lens[bad[0]])} query rows (cu_seqlens_q must be "
                         f"non-decreasing, max_query_len {max_query_len})")
    too_short = query_lens > lens if causal else torch.zeros_like(lens, dtype=torch.bool)
    bad = ((lens < 1) | (lens > capacity) | too_short).nonzero()
    if len(bad):
        r = int(bad[0])
        raise InputError(f"context_lens[{r}] = {int(lens[r])} must be in [max(1, its {int(query_lens[r])} query "
                         f"rows), {capacity}] (block_tables has {block_tables.shape[1]} columns of block_size "
                         f"{block_size})")
    first_key, _ = key_bounds(lens - query_lens if causal else lens - 1, lens, window, key_begin, causal)
    check_block_ids(block_tables.cpu(), lens, first_key, num_blocks, block_size, reads=query_lens > 0, what="request")


def kernel_unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the CUDA kernel (on a GPU or emulated) cannot take these shapes, or None."""
    if q.dtype not in _DTYPE_CODES:
        return f"dtype {q.dtype} is not one of float32, float16, bfloat16"
    if k_cache.dtype in CODE_FORMATS:
        return f"it reads float caches, not {k_cache.dtype} codes"
    if q.shape[-1] not in KERNEL_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of {KERNEL_HEAD_DIMS}"
    if q.shape[1] // k_cache.shape[2] > KERNEL_MAX_GROUP:
        return f"a GQA group of {q.shape[1] // k_cache.shape[2]} query heads is more than {KERNEL_MAX_GROUP}"
    return None


def pick_backend(backend: str, q: torch.Tensor, k_cache: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    reason = kernel_unsupported_reason(q, k_cache)
    if backend == "auto":
        if q.is_cuda:
            return "kernel" if reason is None else "reference"
        return "cpu" if q.dtype == torch.float32 and cpu_kernel_builds() else "reference"
    check_explicit_backend(backend, q, reason, instead="'reference'")
    return backend


def cpu_kernel_builds() -> bool:
    try:
        load_cpu_kernel()
    except InputError:
        return False
    return True
