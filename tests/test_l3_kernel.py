"""L3: paged attention over a block-tensor pool, the PyTorch reference and the CUDA kernel.

On any machine: the reference equals a naive gather-then-softmax in float64, positions past a
sequence's length never reach the result (even NaN/inf there), inputs are checked, and the
kernel source compiles with nvcc for sm_80 and sm_90. On a GPU: the kernel equals the reference.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import torch

from l3_block_kernel.paged_attention import (
    CSRC_DIR, KERNEL_SOURCE, load_extension, paged_attention, paged_attention_gather, paged_attention_reference)

pytestmark = [pytest.mark.l3]

BLOCK_SIZES = (8, 16, 32, 64, 128)
GQA_GROUPS = (1, 2, 4, 8)
MIXED_LENS = (17, 1, 1000, 16, 15)  # one past a block, one token, long, exactly a block, one short


def make_case(lens, block_size, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32,
              device="cpu", fill=None, pad=-1, seed=0):
    """Random q and pool; each sequence owns ceil(len / block_size) shuffled blocks.

    Tables are padded with `pad` (at least one pad column). fill: None leaves the unused slots
    random; a value (nan, inf) fills them, so that only the valid slots hold numbers.
    Returns q, k_cache, v_cache, block_tables, context_lens.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 3  # three blocks that no sequence owns
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(counts) + 1), pad, dtype=torch.int32)
    start = 0
    for s, count in enumerate(counts):
        tables[s, :count] = ids[start:start + count]
        start += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if fill is not None:
        valid = _valid_slots(tables, lens, block_size, num_blocks)
        k, v = (torch.where(valid[:, :, None, None], t, fill) for t in (k, v))
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), tables.to(device), lens_t.to(device))


def _valid_slots(tables, lens, block_size, num_blocks):
    """[num_blocks, block_size] bool: True where some sequence stores a position."""
    valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for s, n in enumerate(lens):
        positions = torch.arange(n)
        valid[tables[s, positions // block_size].long() * block_size + positions % block_size] = True
    return valid.view(num_blocks, block_size)


def naive_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """Independent oracle: gather each history into one tensor, repeat KV heads, softmax in float64."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    scale = head_dim ** -0.5 if scale is None else scale
    out = []
    for s, n in enumerate(context_lens.tolist()):
        blocks = block_tables[s, :-(-n // block_size)].long()
        k, v = (c[blocks].flatten(0, 1)[:n].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
                for c in (k_cache, v_cache))  # [n, H, D]
        scores = torch.einsum("hd,nhd->hn", q[s].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


# ---------------------------------------------------------------- the reference, on any machine


@pytest.mark.points(3)
@pytest.mark.parametrize("group", GQA_GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_reference_matches_naive(block_size, group):
    case = make_case(MIXED_LENS, block_size, num_kv_heads=2, group=group, head_dim=64)
    out = paged_attention_reference(*case)
    assert out.dtype == torch.float32 and out.shape == case[0].shape
    torch.testing.assert_close(out.double(), naive_attention(*case), rtol=1e-4, atol=1e-5)


@pytest.mark.points(2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_reference_matches_naive_head_dims(head_dim, dtype):
    case = make_case(MIXED_LENS, 16, num_kv_heads=2, group=4, head_dim=head_dim, dtype=dtype)
    out = paged_attention_reference(*case)
    # float64 runs the whole algorithm in float64: the online softmax is exact math, not an estimate.
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.double(), naive_attention(*case), **tol)


@pytest.mark.points(2)
@pytest.mark.parametrize("block_size", [8, 128])
def test_reference_long_context(block_size):
    case = make_case([4097, 5], block_size, num_kv_heads=1, group=2, head_dim=32, dtype=torch.float64)
    torch.testing.assert_close(paged_attention_reference(*case), naive_attention(*case), rtol=1e-10, atol=1e-12)


@pytest.mark.points(2)
@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
def test_padding_entries_are_never_read(pad):
    case = make_case([15, 16, 33], 16, pad=pad)
    torch.testing.assert_close(paged_attention(*case).double(), naive_attention(*case), rtol=1e-4, atol=1e-5)


@pytest.mark.points(3)
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
def test_unused_slots_never_reach_the_result(fill):
    """The whole pool holds `fill` except the slots that sequences own (last blocks partly full)."""
    case = make_case(MIXED_LENS, 16, group=2, fill=fill)
    assert not case[1].isfinite().all()
    out = paged_attention_reference(*case)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), naive_attention(*case), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the gather backend (CPU speed)


@pytest.mark.points(2)
@pytest.mark.parametrize("group", GQA_GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_gather_backend_matches_naive(block_size, group):
    case = make_case(MIXED_LENS, block_size, num_kv_heads=2, group=group, head_dim=32, dtype=torch.float64)
    out = paged_attention(*case, backend="gather")
    assert out.dtype == torch.float64 and out.shape == case[0].shape
    torch.testing.assert_close(out, naive_attention(*case), rtol=1e-10, atol=1e-12)


@pytest.mark.points(2)
@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
def test_gather_backend_ignores_unused_slots_and_padding(fill, pad):
    case = make_case(MIXED_LENS, 16, group=4, fill=fill, pad=pad)
    out = paged_attention_gather(*case, scale=0.2)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), naive_attention(*case, scale=0.2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, paged_attention_reference(*case, scale=0.2), rtol=1e-5, atol=1e-6)


@pytest.mark.points(1)
def test_scale_and_output_dtype():
    case = make_case([3, 40], 8)
    torch.testing.assert_close(paged_attention(*case, scale=0.3).double(),
                               naive_attention(*case, scale=0.3), rtol=1e-4, atol=1e-5)
    q, k, v, tables, lens = case
    out = paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, lens)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, lens),
                               rtol=2**-7, atol=1e-3)  # only the output's rounding to bfloat16 differs


@pytest.mark.points(1)
def test_dispatcher_on_cpu_runs_the_reference():
    case = make_case(MIXED_LENS, 32)
    expected = paged_attention_reference(*case)
    assert torch.equal(paged_attention(*case), expected)
    assert torch.equal(paged_attention(*case, backend="reference", check_values=False), expected)
    empty = make_case([4], 8)
    empty = (empty[0][:0], empty[1], empty[2], empty[3][:0], empty[4][:0])
    assert paged_attention(*empty).shape == (0, 4, 64)


def _mutations():
    """(name, change to the valid case, a fragment of the expected message)."""
    def replace(i, fn):
        return lambda c: tuple(fn(t) if j == i else t for j, t in enumerate(c))
    return [
        ("tables int64", replace(3, lambda t: t.long()), "block_tables must be int32 [num_seqs=3, max_blocks]"),
        ("tables 1-d", replace(3, lambda t: t[:, 0]), "block_tables must be int32"),
        ("tables rows", replace(3, lambda t: t[:2]), "block_tables must be int32 [num_seqs=3"),
        ("lens int64", replace(4, lambda t: t.long()), "context_lens must be int32 [num_seqs=3]"),
        ("q 2-d", replace(0, lambda t: t[0]), "q must be a float [num_seqs, num_heads, head_dim]"),
        ("heads", replace(0, lambda t: t[:, :3]), "must be a multiple of k_cache's num_kv_heads (2)"),
        ("head_dim", replace(0, lambda t: t[..., :32]), "must have q's head_dim 32"),
        ("v shape", replace(2, lambda t: t[:, :8]), "v_cache must have k_cache's shape"),
        ("k dtype", replace(1, lambda t: t.double()), "k_cache must have q's dtype torch.float32"),
        ("k 3-d", replace(1, lambda t: t.flatten(0, 1)),
         "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim]"),
        ("v strided", replace(2, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
         "v_cache must be contiguous"),
        ("too long", replace(4, lambda t: t + 100), "context_lens must be in [1, 48]"),
        ("zero length", replace(4, lambda t: t * 0), "got 0 for sequence 0"),
        ("pad read", replace(3, lambda t: t.index_fill(1, torch.tensor([0]), -1)), "block_tables[0, 0] = -1"),
    ]


@pytest.mark.points(2)
@pytest.mark.parametrize("name, mutate, message", _mutations(), ids=[m[0] for m in _mutations()])
def test_bad_inputs_raise_one_line_value_errors(name, mutate, message):
    case = mutate(make_case([5, 17, 30], 16))
    with pytest.raises(ValueError) as info:
        paged_attention(*case)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.points(1)
def test_backend_choice_is_checked():
    case = make_case([5], 16)
    with pytest.raises(ValueError, match="backend must be one of auto, kernel, gather, reference"):
        paged_attention(*case, backend="triton")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="kernel needs CUDA; use backend='reference'"):
            paged_attention(*case, backend="kernel")


# ---------------------------------------------------------------- the CUDA source, without a GPU


@pytest.mark.points(1)
def test_kernel_source_is_plain_cuda():
    """The kernel and its header must compile without torch; only binding.cpp includes it."""
    for path in (KERNEL_SOURCE, CSRC_DIR / "paged_attention.h"):
        includes = [line for line in path.read_text().splitlines() if line.startswith("#include")]
        assert not any("torch" in line or "ATen" in line or "c10" in line for line in includes), path


@pytest.mark.points(3)
def test_kernel_compiles_for_sm80_and_sm90(tmp_path):
    """A syntax or template error in the kernel cannot land. Takes ~25 s on 2 cores (36 kernels, 2 archs)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: install the CUDA toolkit to compile-check the kernel")
    command = [nvcc, "-c", "-std=c++17", "-O3", str(KERNEL_SOURCE), "-o", str(tmp_path / "paged_attention.o"),
               "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "warning" not in result.stderr.lower(), result.stderr[-4000:]


# ---------------------------------------------------------------- the kernel, on a GPU

FP32_TOL = dict(rtol=1e-4, atol=1e-4)


def _on_gpu(case, dtype=torch.float32):
    q, k, v, tables, lens = case
    return q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), tables.cuda(), lens.cuda()


def _kernel_and_reference(case):
    """The kernel's output in float32, and the fp32 reference on the same (rounded) inputs."""
    out = paged_attention(*case, backend="kernel")
    q, k, v, tables, lens = case
    reference = paged_attention_reference(q.float(), k.float(), v.float(), tables, lens)
    return out.float(), reference


@pytest.mark.gpu
@pytest.mark.points(3)
@pytest.mark.parametrize("group", GQA_GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_kernel_matches_reference(block_size, group):
    case = _on_gpu(make_case(MIXED_LENS + (4097,), block_size, num_kv_heads=2, group=group, head_dim=128))
    torch.testing.assert_close(*_kernel_and_reference(case), **FP32_TOL)


@pytest.mark.gpu
@pytest.mark.points(2)
@pytest.mark.parametrize("group", [3, 6])  # blocks of 1 and 2 heads, each group read by several blocks
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_kernel_head_dims_and_odd_groups(head_dim, group):
    case = _on_gpu(make_case(MIXED_LENS, 16, num_kv_heads=2, group=group, head_dim=head_dim))
    torch.testing.assert_close(*_kernel_and_reference(case), **FP32_TOL)


@pytest.mark.gpu
@pytest.mark.points(3)
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_precision(dtype, block_size):
    """Same rounded inputs, fp32 math on both sides: only the output's final rounding differs.

    That rounding is at most half a unit in the last place, a relative 2^-8 for bfloat16 (8
    significant bits) and 2^-11 for float16 (11); rtol allows one whole unit, atol the fp32 noise.
    """
    case = _on_gpu(make_case(MIXED_LENS + (4097,), block_size, group=4, head_dim=128), dtype)
    rtol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(*_kernel_and_reference(case), rtol=rtol, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.points(3)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_kernel_unused_slots_never_reach_the_result(fill, dtype):
    case = _on_gpu(make_case(MIXED_LENS, 16, group=2, head_dim=128, fill=fill), dtype)
    out, reference = _kernel_and_reference(case)
    assert out.isfinite().all()
    torch.testing.assert_close(out, reference, rtol=2**-7, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.points(2)
def test_kernel_offsets_past_2_to_the_31_elements():
    """A pool of more than 2^31 elements (4.3 GB of bf16 per tensor): 32-bit offsets would wrap."""
    num_blocks, block_size, num_kv_heads, head_dim = 2**31 // (16 * 8 * 128) + 4, 16, 8, 128
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    small = make_case([40], block_size, num_kv_heads=num_kv_heads, group=2, head_dim=head_dim)
    q, k_small, v_small, _, lens = _on_gpu(small, torch.bfloat16)
    last = torch.arange(num_blocks - 3, num_blocks, device="cuda")  # the pool's last three blocks
    k[last], v[last] = k_small[:3], v_small[:3]
    tables = last.int()[None, :]
    out = paged_attention(q, k, v, tables, lens, backend="kernel")
    expected = paged_attention_reference(q.float(), k_small[:3].float(), v_small[:3].float(),
                                            torch.arange(3, dtype=torch.int32, device="cuda")[None], lens)
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.points(1)
def test_auto_runs_the_kernel_on_cuda_and_the_build_is_cached():
    case = _on_gpu(make_case(MIXED_LENS, 16, head_dim=128))
    module = load_extension()
    start = time.perf_counter()
    assert load_extension() is module and time.perf_counter() - start < 0.1
    assert torch.equal(paged_attention(*case), paged_attention(*case, backend="kernel"))
    tiny = _on_gpu(make_case([5], 16, head_dim=16))  # head_dim 16: no kernel, auto takes the reference
    assert torch.equal(paged_attention(*tiny), paged_attention_reference(*tiny))
