"""L13: decode attention from a window's start, on every backend that walks block tables.

A sliding layer's decode token at position p reads positions p - W + 1 .. p only, and the blocks
wholly behind that window went back to the pool (their table entries are NULL_BLOCK, -1). So
`paged_attention(..., window_starts=)` must read nothing before each sequence's start: neither a
table entry before the start's block (here -1 or an id past the pool, which a read would fail
on) nor a slot before the start in the window's first block (here NaN or inf, which would reach
the result). Checked against an independent float64 oracle over each window's positions, on
the kernel's own code (the CPU emulation, and the GPU where CUDA exists), the cpu walk and the
gather backend, single pass and split-K.
"""

from __future__ import annotations

import pytest
import torch

from l1_contiguous import InputError
from l3_block_kernel.paged_attention import paged_attention
from test_l3_kernel import FP32_TOL, needs_compiler

pytestmark = [pytest.mark.l13]

KERNEL_BACKENDS = [pytest.param("emulated", marks=needs_compiler), pytest.param("kernel", marks=pytest.mark.gpu)]
WINDOW_BACKENDS = KERNEL_BACKENDS + [pytest.param("cpu", marks=needs_compiler), "gather"]
# (context_len, window) pairs: a window starting mid-tile, on a tile's edge, on a block's edge (of
# 16), one position long, covering the whole context, longer than the context, and long ones.
CASES = [(100, 37), (100, 36), (97, 33), (50, 1), (40, 40), (20, 64), (1000, 64), (4097, 1024)]


def window_case(cases, block_size, num_kv_heads=2, group=2, head_dim=64, fill=float("nan"), pad=-1, seed=0):
    """q, k_cache, v_cache, block_tables, context_lens, window_starts for sequences (len, window).

    A sequence owns blocks from its window start's block to its last position's, shuffled through
    the pool; its earlier table entries hold `pad`, as a sliding group's freed entries hold
    NULL_BLOCK. Every slot no sequence attends to holds `fill`, so a read of one shows.
    """
    gen = torch.Generator().manual_seed(seed)
    starts = [max(0, n - w) for n, w in cases]
    firsts = [s // block_size for s in starts]
    counts = [-(-n // block_size) - f for (n, _), f in zip(cases, firsts)]
    num_blocks = sum(counts) + 2
    ids = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(-(-n // block_size) for n, _ in cases)
    tables = torch.full((len(cases), max_blocks), pad, dtype=torch.int32)
    attended = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    taken = 0
    for s, ((n, _), first, count) in enumerate(zip(cases, firsts, counts)):
        tables[s, first:first + count] = ids[taken:taken + count].int()
        taken += count
        positions = torch.arange(starts[s], n)
        attended[tables[s, positions // block_size].long() * block_size + positions % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    mask = attended.view(num_blocks, block_size)[:, :, None, None]
    k, v = (torch.where(mask, torch.randn(shape, generator=gen), fill) for _ in range(2))
    q = torch.randn(len(cases), num_kv_heads * group, head_dim, generator=gen)
    return (q, k, v, tables, torch.tensor([n for n, _ in cases], dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32))


def naive_window_attention(q, k_cache, v_cache, block_tables, context_lens, window_starts):
    """Independent oracle: each sequence's window positions gathered one by one, softmax in float64."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    out = []
    for s, (start, n) in enumerate(zip(window_starts.tolist(), context_lens.tolist())):
        positions = torch.arange(start, n)
        blocks = block_tables[s, positions // block_size].long()
        k, v = (c[blocks, positions % block_size].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
                for c in (k_cache, v_cache))  # [n - start, H, D]
        scores = torch.einsum("hd,nhd->hn", q[s].double(), k) * head_dim ** -0.5
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def run_window(case, backend, dtype=torch.float32, split=None):
    """The backend's output (float64, on the CPU) and the oracle on the same rounded inputs."""
    q, k, v, tables, lens, starts = case
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    device = "cuda" if backend == "kernel" else "cpu"
    split_args = {} if split is None else dict(split_k=bool(split), partition_size=split or 512)
    out = paged_attention(q.to(device), k.to(device), v.to(device), tables.to(device), lens.to(device),
                          backend=backend, window_starts=starts.to(device), **split_args)
    assert out.dtype == dtype and out.shape == q.shape
    return out.cpu().double(), naive_window_attention(q, k, v, tables, lens, starts)


@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
def test_window_reads_only_its_positions(backend, block_size, fill, pad):
    case = window_case(CASES, block_size, group=4, fill=fill, pad=pad)
    out, expected = run_window(case, backend)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, **FP32_TOL)


@pytest.mark.parametrize("partition_size", [8, 24, 512])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)  # split-K exists on the kernel's code only
def test_split_k_skips_the_partitions_behind_the_window(backend, partition_size):
    """Partitions wholly before a window leave without writing; the merge reads only the ones from
    the window start's partition on (24: partitions end mid-block; 8: one tile each)."""
    case = window_case(CASES, 16, group=2, head_dim=32)
    torch.testing.assert_close(*run_window(case, backend, split=partition_size), **FP32_TOL)


@pytest.mark.parametrize("split", [0, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)  # split-K exists on the kernel's code only
def test_window_in_half_precision(backend, dtype, split):
    """As L3's half-precision test: one unit in the last place of the output, plus fp32 noise."""
    case = window_case(CASES, 16, group=4, head_dim=128)
    rtol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    out, expected = run_window(case, backend, dtype, split=split)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
def test_a_window_from_position_zero_is_plain_attention(backend):
    """window_starts of zeros equal no window_starts at all, bit for bit, on the same backend."""
    q, k, v, tables, lens, _ = window_case([(n, n) for n, _ in CASES], 16, fill=0.0)
    device = "cuda" if backend == "kernel" else "cpu"
    q, k, v, tables, lens = (t.to(device) for t in (q, k, v, tables, lens))
    plain = paged_attention(q, k, v, tables, lens, backend=backend)
    zeros = paged_attention(q, k, v, tables, lens, backend=backend, window_starts=torch.zeros_like(lens))
    assert torch.equal(plain, zeros)


def _window_mutations():
    """(name, change to window_starts, a fragment of the expected message)."""
    return [
        ("int64", lambda w: w.long(), "window_starts must be int32 [num_seqs=3]"),
        ("short", lambda w: w[:2], "window_starts must be int32 [num_seqs=3]"),
        ("negative", lambda w: w - 100, "window_starts must be in [0, context_len), got"),
        ("at the end", lambda w: w + 1000, "window_starts must be in [0, context_len), got"),
    ]


@pytest.mark.parametrize("backend", ["auto", "gather", pytest.param("cpu", marks=needs_compiler),
                                     pytest.param("emulated", marks=needs_compiler)])
@pytest.mark.parametrize("name, mutate, message", _window_mutations(), ids=[m[0] for m in _window_mutations()])
def test_bad_window_starts_raise_one_line_errors(backend, name, mutate, message):
    q, k, v, tables, lens, starts = window_case([(100, 37), (50, 1), (20, 64)], 16)
    with pytest.raises(InputError) as info:
        paged_attention(q, k, v, tables, lens, backend=backend, window_starts=mutate(starts))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_table_entry_inside_the_window_is_still_checked():
    """Only entries before the window's first block may be -1: one inside it is a bad table."""
    q, k, v, tables, lens, starts = window_case([(100, 37), (50, 1)], 16)
    tables[0, int(starts[0]) // 16] = -1
    with pytest.raises(InputError, match=r"block_tables\[0, 3\] = -1 is not a block id"):
        paged_attention(q, k, v, tables, lens, backend="gather", window_starts=starts)


def test_the_reference_takes_no_window_and_auto_on_a_cpu_gathers():
    """The reference is L3's oracle for whole contexts: asked for a window it says which backends
    take one; "auto" on a CPU, which would pick it, gathers instead."""
    case = window_case([(100, 37), (50, 1)], 16)
    q, k, v, tables, lens, starts = case
    with pytest.raises(InputError, match="backend='reference' .* takes no window_starts; use backend='gather'"):
        paged_attention(q, k, v, tables, lens, backend="reference", window_starts=starts)
    torch.testing.assert_close(*run_window(case, "auto"), **FP32_TOL)
