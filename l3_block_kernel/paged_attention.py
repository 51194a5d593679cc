"""L3's read path: decode attention that walks each sequence's block table.

    k_cache, v_cache (one layer)   [num_blocks, block_size, H_kv, D]
    ┌─────────┬─────────┬─────────┬─────────┬─────────┬─── ··· ─┐
    │ block 0 │ block 1 │ block 2 │ block 3 │ block 4 │         │
    └─────────┴─────────┴─────────┴─────────┴─────────┴─── ··· ─┘
    block_tables int32 [num_seqs, max_blocks]     context_lens int32 [num_seqs]
        seq 0: [ 3,  0,  0 ]                          seq 0: 20     (last 0: padding, never read)
        seq 1: [ 1,  4,  2 ]                          seq 1: 40
    with block_size 16, position 17 of seq 0 is row 17 % 16 = 1 of block 0 = block_tables[0, 17 // 16],
    i.e. slot 0 * 16 + 1 of the flat view [num_blocks * block_size, H_kv, D] that L2's writes use.

One algorithm, three implementations, and a stand-in:
- `paged_attention_reference`: PyTorch, runs anywhere; the oracle for the kernel.
- the CUDA kernel in csrc/paged_attention.cu, built on first use by `load_extension()`; the same
  source also runs on a CPU under csrc/cuda_emulation.h (backend "emulated", `load_emulation()`).
- csrc/paged_attention_cpu.cpp (backend "cpu", `load_cpu_kernel()`): the same walk written for a
  CPU's cores, float32; what L5's and L8's engines decode with on a CPU.
- `paged_attention_gather`: copies each sequence's blocks into a padded batch and calls SDPA once.
  The same result, by the copy the kernel exists to avoid; the engines' CPU fallback when no C++
  compiler is at hand (still faster there than the reference's Python loop over blocks).
`paged_attention` checks the inputs and picks one. All but the reference also take window_starts:
a sequence then attends to positions [window_starts[s], context_lens[s]) only (L13's sliding-window
layers), and its table entries before the window's first block are never read.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from l1_contiguous.errors import InputError

from .kernel_build import CSRC_DIR, KERNEL_SOURCE, load_cpu_kernel, load_emulation, load_extension  # noqa: F401

KERNEL_HEAD_DIMS = (32, 64, 128)
KERNEL_BLOCK_SIZES = (8, 16, 32, 64, 128)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # KvDtype in paged_attention.h
# KvCacheFormat in paged_attention.h: L12's one-byte codes; a cache of any other dtype is in q's (0).
_CACHE_FORMAT_CODES = {torch.float8_e4m3fn: 1, torch.int8: 2}
BACKENDS = ("auto", "kernel", "emulated", "cpu", "gather", "reference")
# Split-K (flash-decoding). Below SPLIT_K_MIN_BLOCKS single-pass thread blocks a GPU has idle SMs
# (an H100 has 132, each can hold 2 of these blocks); a context of at least two partitions then
# gains more from spreading its positions over several blocks than the merge costs.
SPLIT_K_PARTITION = 512
SPLIT_K_MIN_BLOCKS = 128


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    scale: float | None = None, backend: str = "auto", *,
                    check_values: bool = True, split_k: bool | None = None,
                    partition_size: int = SPLIT_K_PARTITION,
                    window_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention: each sequence's one query token attends to its first context_len positions.

    q [num_seqs, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D] (contiguous);
    block_tables int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs].
    Returns [num_seqs, H, D] in q's dtype. scale defaults to 1 / sqrt(D).

    backend: "kernel" (CUDA), "emulated" (the kernel's own code on a CPU, csrc/cuda_emulation.h),
    "cpu" (the algorithm in C++ for a CPU, float32), "reference" (PyTorch), "gather" (PyTorch),
    or "auto": the kernel when q is on CUDA, the kernel supports the shapes and it builds, else
    the reference (saying why, once).
    check_values: also check every length and every block id a sequence uses. On CUDA this reads
    the tables back to the host (a sync), so a hot loop whose tables were built and checked on
    the host passes False. The emulated and cpu backends always check (in C++ for cpu, at no
    measurable cost): a bad id would crash the process.
    split_k, partition_size: kernel and emulated only. None lets `use_split_k` decide; True or
    False forces split-K (partitions of partition_size positions, a multiple of 8) or the single pass.
    window_starts: int32 [num_seqs], each in [0, context_len): sequence s attends to positions
    [window_starts[s], context_lens[s]) only; its table entries before column window_starts[s] //
    block_size are never read (they may be -1). Every backend but "reference" takes them ("auto"
    picks "gather" where it would pick the reference).
    """
    check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    check_window_starts(q, window_starts)
    backend, scale = resolve_call(q, k_cache, block_tables, context_lens, backend, check_values, scale,
                                  window_starts)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if backend in ("kernel", "emulated"):
        return run_kernel(backend, q, k_cache, v_cache, block_tables, context_lens, scale, split_k, partition_size,
                          window_starts=window_starts)
    if backend == "cpu":
        return paged_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale, window_starts=window_starts)
    if backend == "gather":
        return paged_attention_gather(q, k_cache, v_cache, block_tables, context_lens, scale, window_starts)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


def resolve_call(q, k_cache, block_tables, context_lens, backend: str, check_values: bool, scale,
                 window_starts=None):
    """The backend a checked call runs on (after the table checks it needs) and its softmax scale."""
    if window_starts is not None and backend == "reference":
        raise InputError("backend='reference' attends from position 0 and takes no window_starts; "
                         "use backend='gather', 'cpu', 'emulated' or 'kernel'")
    backend = _pick_backend(backend, q, k_cache)
    if window_starts is not None and backend == "reference":  # what "auto" falls back to
        backend = "gather"
    if backend == "emulated" or (check_values and backend != "cpu"):  # cpu checks them in C++
        check_table_values(k_cache, block_tables, context_lens, window_starts)
    return backend, q.shape[-1] ** -0.5 if scale is None else float(scale)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor,
                              scale: float | None = None) -> torch.Tensor:
    """The kernel's algorithm in PyTorch: walk the block tables block by block, online softmax.

    Shapes as in `paged_attention`. All sequences and heads move together; the loop runs over
    block index j, up to the longest sequence's block count. Math in float32 (float64 for
    float64 inputs, so that a test can check the algorithm to 1e-12).
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    # BEGIN SOLUTION
    math_dtype = torch.promote_types(q.dtype, torch.float32)
    group = num_heads // num_kv_heads
    # [S, H_kv, G, D]: query head h is row h % G of KV head h // G's group, as in the kernel.
    q_grouped = q.to(math_dtype).view(num_seqs, num_kv_heads, group, head_dim) * scale
    lens = context_lens.long()
    m = torch.full(q_grouped.shape[:3], float("-inf"), dtype=math_dtype, device=q.device)  # running max
    l = torch.zeros_like(m)                                     # running sum of exp(score - m)
    acc = torch.zeros_like(q_grouped)                           # running sum of exp(score - m) * v
    max_len = int(lens.max()) if num_seqs else 0
    for j in range(-(-max_len // block_size)):
        k, v, valid = _read_block(k_cache, v_cache, block_tables, lens, j, math_dtype)
        scores = torch.einsum("skgd,sbkd->skgb", q_grouped, k)  # [S, H_kv, G, block_size]
        scores = torch.where(valid[:, None, None, :], scores, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        rescale = torch.exp(m - m_new)                           # 0 at j = 0, where m = -inf
        p = torch.exp(scores - m_new[..., None])                 # 0 where masked
        l = l * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + torch.einsum("skgb,sbkd->skgd", p, v)
        m = m_new
    return (acc / l[..., None]).reshape(num_seqs, num_heads, head_dim).to(q.dtype)
    # END SOLUTION


def _read_block(k_cache, v_cache, block_tables, lens, j, math_dtype):
    """Block j of every sequence: k, v [S, block_size, H_kv, D] and valid [S, block_size].

    A sequence shorter than j + 1 blocks has padding at block_tables[:, j] (maybe -1), so block 0
    stands in for it, fully masked. Masked V rows are zeroed: their slots may hold NaN, and a
    weight of 0 times NaN is still NaN.
    """
    # BEGIN SOLUTION
    block_size = k_cache.shape[1]
    positions = j * block_size + torch.arange(block_size, device=lens.device)  # [block_size]
    valid = positions[None, :] < lens[:, None]                                  # [S, block_size]
    block_ids = torch.where(valid[:, 0], block_tables[:, j].long(), 0)          # [S]
    k = k_cache[block_ids].to(math_dtype)
    v = torch.where(valid[:, :, None, None], v_cache[block_ids].to(math_dtype), 0.0)
    return k, v, valid
    # END SOLUTION


def paged_attention_gather(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float | None = None, window_starts: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention as the reference, computed as gather-then-SDPA: fast on CPU, not a kernel.

    Copies every table column's block (columns a sequence does not read take block 0) into K, V
    [S, H_kv, L, D] with L = max_blocks * block_size, zeroes the positions outside each sequence's
    [window start, length) (their slots may hold NaN, and a masked score of NaN stays NaN), and
    masks them out of one batched SDPA call.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    length = block_tables.shape[1] * block_size
    positions = torch.arange(length, device=q.device)
    valid = positions[None, :] < context_lens[:, None].long()  # [S, L]
    column_read = valid[:, ::block_size]                       # [S, max_blocks]: its first position is
    if window_starts is not None:                              # below the length, its last at or past
        starts = window_starts[:, None].long()                 # the window start
        valid = valid & (positions[None, :] >= starts)
        column_read = column_read & (positions[None, block_size - 1::block_size] >= starts)
    block_ids = torch.where(column_read, block_tables.long(), 0).flatten()  # [S * max_blocks]
    # Rows of the copy to zero. On CUDA, nonzero waits for the GPU: this backend is for CPUs.
    past_end = (~valid).flatten().nonzero().squeeze(1)

    def gather(cache):  # -> [S, H_kv, L, D]
        # index_select and index_fill_ copy or clear whole rows: on a CPU several times faster than
        # cache[block_ids] and a masked_fill_ with a broadcast mask.
        rows = cache.index_select(0, block_ids).view(num_seqs * length, num_kv_heads * head_dim)
        rows.index_fill_(0, past_end, 0.0)
        return rows.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(q[:, :, None, :], gather(k_cache), gather(v_cache),
                                         attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0]  # [S, H, D]


def paged_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                        k_scales=None, v_scales=None, window_starts=None) -> torch.Tensor:
    """Runs csrc/paged_attention_cpu.cpp on up to torch.get_num_threads() of torch's own OpenMP
    threads (the calling thread alone where it is built without OpenMP). Inputs checked, float32,
    on the CPU; lengths, window starts and block ids are checked in C++ before anything is read. The
    caches are float32, or L12's fp8/int8 codes with k_scales, v_scales float32 [num_kv_heads] (contiguous)."""
    q, block_tables, context_lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    window_starts = None if window_starts is None else window_starts.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    error = load_cpu_kernel().l3_cpu_paged_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        block_tables.shape[1], k_cache.shape[0], scale, torch.get_num_threads(),
        _CACHE_FORMAT_CODES.get(k_cache.dtype, 0), *_pointers(k_scales, v_scales, window_starts))
    if error is not None:
        raise InputError(error.decode())
    return out


def check_inputs(q, k_cache, v_cache, block_tables, context_lens, cache_dtype=None) -> None:
    """Shapes, dtypes and devices (no GPU sync); raises InputError (a ValueError) naming what was expected.
    The caches must have q's dtype, or cache_dtype where given (L12's one-byte codes)."""
    _check_pool(q, k_cache, v_cache, cache_dtype)
    num_seqs = q.shape[0]
    expect_tensor(block_tables.dtype == torch.int32 and block_tables.dim() == 2 and len(block_tables) == num_seqs,
            f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks]", block_tables)
    expect_tensor(context_lens.dtype == torch.int32 and tuple(context_lens.shape) == (num_seqs,),
            f"context_lens must be int32 [num_seqs={num_seqs}]", context_lens)
    named = {"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "context_lens": context_lens}
    for name, t in named.items():
        expect_tensor(t.device == q.device, f"{name} must be on q's device {q.device}", t)


def _check_pool(q, k_cache, v_cache, cache_dtype=None) -> None:
    expect_tensor(q.dim() == 3 and q.dtype.is_floating_point, "q must be a float [num_seqs, num_heads, head_dim]", q)
    num_heads, head_dim = q.shape[1:]
    expect_tensor(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim]", k_cache)
    expect_tensor(v_cache.shape == k_cache.shape, f"v_cache must have k_cache's shape {tuple(k_cache.shape)}", v_cache)
    dtype = q.dtype if cache_dtype is None else cache_dtype
    expected = f"q's dtype {q.dtype}" if cache_dtype is None else f"dtype {cache_dtype}"
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        expect_tensor(cache.dtype == dtype, f"{name} must have {expected}", cache)
        expect_tensor(cache.is_contiguous(), f"{name} must be contiguous (the kernel walks its memory)", cache)
    expect_tensor(k_cache.shape[3] == head_dim, f"k_cache must have q's head_dim {head_dim} as its last size", k_cache)
    expect_tensor(num_heads % k_cache.shape[2] == 0,
            f"q's num_heads ({num_heads}) must be a multiple of k_cache's num_kv_heads ({k_cache.shape[2]})", q)


def check_window_starts(q, window_starts) -> None:
    """window_starts is None or int32 [num_seqs] on q's device (values: `check_table_values`)."""
    if window_starts is not None:
        expect_tensor(window_starts.dtype == torch.int32 and tuple(window_starts.shape) == (q.shape[0],)
                and window_starts.device == q.device,
                f"window_starts must be int32 [num_seqs={q.shape[0]}] on q's device {q.device}", window_starts)


def check_table_values(k_cache, block_tables, context_lens, window_starts=None) -> None:
    """Each length in [1, max_blocks * block_size]; each window start in [0, length); each block id
    a sequence reads (from its window start's block to its last position's) in [0, num_blocks)."""
    num_blocks, block_size = k_cache.shape[:2]
    capacity = block_tables.shape[1] * block_size
    lens = context_lens.long()
    bad_len = ((lens < 1) | (lens > capacity)).nonzero()
    if len(bad_len):
        s = int(bad_len[0])
        raise InputError(f"context_lens must be in [1, {capacity}] (block_tables has {block_tables.shape[1]} "
                         f"columns of block_size {block_size}), got {int(lens[s])} for sequence {s}")
    starts = torch.zeros_like(lens) if window_starts is None else window_starts.long()
    bad_start = ((starts < 0) | (starts >= lens)).nonzero()
    if len(bad_start):
        s = int(bad_start[0])
        raise InputError(f"window_starts must be in [0, context_len), got {int(starts[s])} for sequence {s} "
                         f"(context_len {int(lens[s])})")
    check_block_ids(block_tables, lens, starts, num_blocks, block_size)


def check_block_ids(block_tables, lens, first_positions, num_blocks: int, block_size: int,
                    reads=None, what: str = "sequence") -> None:
    """InputError naming the first table entry that a row reads and that is not a block id in
    [0, num_blocks): row s reads the columns from first_positions[s]'s block to its length's last
    (and none where reads[s] is False). L4's checks use it too (`what`: "request")."""
    columns = torch.arange(block_tables.shape[1], device=lens.device)
    # [num_seqs, max_blocks]
    used = ((columns[None, :] < -(-lens[:, None] // block_size))
            & (columns[None, :] >= first_positions[:, None] // block_size))
    if reads is not None:
        used = used & reads[:, None]
    bad_id = (used & ((block_tables < 0) | (block_tables >= num_blocks))).nonzero()
    if len(bad_id):
        s, j = (int(i) for i in bad_id[0])
        raise InputError(f"block_tables[{s}, {j}] = {int(block_tables[s, j])} is not a block id in "
                         f"[0, {num_blocks}), but {what} {s} (context_len {int(lens[s])}) reads it")


def kernel_unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the kernel (on CUDA or emulated) cannot take these (already checked) shapes, or None."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype} is not one of float32, float16, bfloat16"
    if q.shape[-1] not in KERNEL_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of {KERNEL_HEAD_DIMS}"
    if k_cache.shape[1] not in KERNEL_BLOCK_SIZES:
        return f"block_size {k_cache.shape[1]} is not one of {KERNEL_BLOCK_SIZES}"
    return None


def heads_per_block(group: int) -> int:
    """Query heads one thread block serves: the largest of 8, 4, 2, 1 dividing the GQA group."""
    return next(n for n in (8, 4, 2, 1) if group % n == 0)


def use_split_k(num_seqs: int, num_heads: int, num_kv_heads: int, capacity: int) -> bool:
    """The dispatch rule: split-K when the single pass would launch fewer than SPLIT_K_MIN_BLOCKS
    thread blocks and the tables can hold at least two partitions (capacity = max_blocks *
    block_size, known on the host without reading the lengths back from the GPU)."""
    blocks = num_seqs * num_heads // heads_per_block(num_heads // num_kv_heads)
    return blocks < SPLIT_K_MIN_BLOCKS and capacity >= 2 * SPLIT_K_PARTITION


def _check_partition_size(partition_size: int) -> int:
    if not isinstance(partition_size, int) or partition_size <= 0 or partition_size % 8:
        raise InputError(f"partition_size must be a positive multiple of 8 (the kernel's tile), got {partition_size!r}")
    return partition_size


def check_alignment(q, k_cache, v_cache) -> None:
    """The widest load a lane issues is head_dim / 32 elements: each base pointer must be aligned to
    that many of its own elements (head_dim / 32 bytes for L12's one-byte caches)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        alignment = t.element_size() * t.shape[-1] // 32
        if t.data_ptr() % alignment:
            raise InputError(f"{name} must start on a {alignment}-byte boundary (the kernel loads head_dim / 32 "
                             f"elements at once), got address {t.data_ptr():#x}; pass a fresh tensor or .clone()")


def run_kernel(backend, q, k_cache, v_cache, block_tables, context_lens, scale: float, split_k, partition_size,
               k_scales=None, v_scales=None, window_starts=None) -> torch.Tensor:
    """Backend "kernel" or "emulated" on checked inputs: alignment, the split-K choice, the launch.
    k_scales, v_scales: float32 [num_kv_heads] for L12's fp8/int8 caches, else None; window_starts
    as in `paged_attention`."""
    q = q.contiguous()
    check_alignment(q, k_cache, v_cache)
    if split_k is None:
        split_k = use_split_k(q.shape[0], q.shape[1], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1])
    partition = _check_partition_size(partition_size) if split_k else 0
    run = load_extension().forward if backend == "kernel" else paged_attention_emulated
    window_starts = None if window_starts is None else window_starts.contiguous()
    return run(q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(), scale, partition,
               k_scales, v_scales, window_starts)


def paged_attention_emulated(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                             partition_size: int = 0, k_scales=None, v_scales=None,
                             window_starts=None) -> torch.Tensor:
    """Runs csrc/paged_attention.cu on the CPU (see cuda_emulation.h). Inputs checked and contiguous;
    k_scales, v_scales, window_starts as in `run_kernel`."""
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    partial_ml = partial_acc = None
    if partition_size:
        max_partitions = -(-block_tables.shape[1] * k_cache.shape[1] // partition_size)
        partial_ml = torch.empty(num_seqs, num_heads, max_partitions, 2)
        partial_acc = torch.empty(num_seqs, num_heads, max_partitions, head_dim)
    error = load_emulation().l3_emulated_paged_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        block_tables.shape[1], scale, _DTYPE_CODES[q.dtype], _CACHE_FORMAT_CODES.get(k_cache.dtype, 0),
        *_pointers(k_scales, v_scales), partition_size, *_pointers(partial_ml, partial_acc, window_starts))
    if error is not None:
        raise InputError(error.decode())
    return out


def _pointers(*tensors):
    """Each tensor's data pointer for ctypes, None (a null pointer) for None."""
    return tuple(None if t is None else t.data_ptr() for t in tensors)


_fallbacks_reported: set[str] = set()


def _fall_back(reason: str) -> str:
    """backend='auto' on CUDA without the kernel: take the reference, and say why once per reason."""
    if reason not in _fallbacks_reported:
        _fallbacks_reported.add(reason)
        warnings.warn(f"paged_attention: backend='auto' uses the PyTorch reference: {reason}", stacklevel=4)
    return "reference"


def _pick_backend(backend: str, q: torch.Tensor, k_cache: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    reason = kernel_unsupported_reason(q, k_cache)
    if backend == "auto":
        if not q.is_cuda:
            return "reference"
        if reason is not None:
            return _fall_back(reason)
        try:
            load_extension()
        except InputError as exc:  # remembered: the build is not tried again
            return _fall_back(str(exc))
        return "kernel"
    check_explicit_backend(backend, q, reason, instead="'gather' or 'reference'")
    return backend


def check_explicit_backend(backend: str, q: torch.Tensor, reason: str | None, instead: str) -> None:
    """The rules a backend asked for by name obeys (L4's dispatcher applies them too): the kernel
    needs CUDA, the emulation and the C++ CPU kernel the CPU, the CPU kernel float32, and the
    kernel and its emulation shapes they support (`reason`: why not, or None). `instead`: the
    PyTorch backends to suggest."""
    if backend == "kernel" and not q.is_cuda:
        raise InputError(f"backend='kernel' needs CUDA tensors, got {q.device}; use backend='emulated' "
                         f"(the kernel's code on the CPU) or {instead}")
    if backend in ("emulated", "cpu") and q.device.type != "cpu":
        raise InputError(f"backend={backend!r} runs on the CPU, got tensors on {q.device}; use backend='kernel'")
    if backend == "cpu" and q.dtype != torch.float32:
        raise InputError(f"backend='cpu' runs float32, got {q.dtype}; use backend={instead}")
    if backend in ("kernel", "emulated") and reason is not None:
        raise InputError(f"backend={backend!r} cannot run this call: {reason}; use backend='reference'")


def expect_tensor(ok: bool, what, tensor: torch.Tensor) -> None:
    """InputError saying `what` was expected and what `tensor` is, unless `ok` (L4's and L12's
    checks use it too). `what` is the message, or a function making it, for a check run every
    step: formatting dtypes and devices costs more than checking them."""
    if not ok:
        raise InputError(f"{what() if callable(what) else what}, got {tensor.dtype} {tuple(tensor.shape)} "
                         f"on {tensor.device}")
