"""L3: paged attention over a block-tensor pool, the PyTorch reference and the CUDA kernel.

On any machine: the reference equals a naive gather-then-softmax in float64, positions past a
sequence's length never reach the result (even NaN/inf there), inputs are checked, and the
kernel source compiles with nvcc for sm_75 to sm_90. The kernel's own code, single pass and
split-K, runs against the naive oracle through the CPU emulation (backend "emulated", needs a
C++20 compiler) and, where CUDA exists, on the GPU as well (backend "kernel").
"""

from __future__ import annotations

import ctypes
import importlib
import subprocess
import time
import warnings
from pathlib import Path

import prebuild
import pytest
import torch

from l1_contiguous import InputError
from l3_block_kernel.kernel_build import LAUNCH_HEADER, host_compiler
from l3_block_kernel.paged_attention import (
    CSRC_DIR, KERNEL_SOURCE, load_emulation, load_extension, paged_attention, paged_attention_gather,
    paged_attention_reference)
from l4_paged_prefill.kernel_build import CSRC_DIR as L4_CSRC_DIR

pa = importlib.import_module("l3_block_kernel.paged_attention")  # the module; the package exports the function
pytestmark = [pytest.mark.l3]

BLOCK_SIZES = (8, 16, 32, 64, 128)
GQA_GROUPS = (1, 2, 4, 8)
MIXED_LENS = (17, 1, 1000, 16, 15)  # one past a block, one token, long, exactly a block, one short
PAST_END = "past-end"  # make_case's pad: the pool's size, the first id outside it
needs_compiler = pytest.mark.skipif(host_compiler() is None,
                                    reason="backends 'emulated' and 'cpu' need a C++ compiler (g++ or clang++, or set CXX)")


def make_case(lens, block_size, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32,
              device="cpu", fill=None, pad=-1, seed=0):
    """Random q and pool; each sequence owns ceil(len / block_size) shuffled blocks.

    Tables are padded with `pad` (at least one pad column; PAST_END: the first id outside the
    pool, which a read would fail on). fill: None leaves the unused slots
    random; a value (nan, inf) fills them, so that only the valid slots hold numbers.
    Returns q, k_cache, v_cache, block_tables, context_lens.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 3  # three blocks that no sequence owns
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(counts) + 1), num_blocks if pad == PAST_END else pad, dtype=torch.int32)
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


# Padding ids outside the pool: a reader that looks them up fails (-1 would quietly read the last block).
@pytest.mark.points(2)
@pytest.mark.parametrize("pad", [PAST_END, 2**31 - 1])
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


@pytest.mark.parametrize("group", GQA_GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_gather_backend_matches_naive(block_size, group):
    case = make_case(MIXED_LENS, block_size, num_kv_heads=2, group=group, head_dim=32, dtype=torch.float64)
    out = paged_attention(*case, backend="gather")
    assert out.dtype == torch.float64 and out.shape == case[0].shape
    torch.testing.assert_close(out, naive_attention(*case), rtol=1e-10, atol=1e-12)


@pytest.mark.points(2)
@pytest.mark.parametrize("pad", [PAST_END, 2**31 - 1])
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


@pytest.mark.parametrize("backend", ["auto", pytest.param("cpu", marks=needs_compiler)])
@pytest.mark.parametrize("name, mutate, message", _mutations(), ids=[m[0] for m in _mutations()])
def test_bad_inputs_raise_one_line_value_errors(name, mutate, message, backend):
    """The cpu backend checks lengths and block ids in C++, with the same messages."""
    case = mutate(make_case([5, 17, 30], 16))
    with pytest.raises(ValueError) as info:
        paged_attention(*case, backend=backend)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_backend_choice_is_checked():
    case = make_case([5], 16)
    with pytest.raises(ValueError, match="backend must be one of auto, kernel, emulated, cpu, gather, reference"):
        paged_attention(*case, backend="triton")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend='kernel' needs CUDA tensors, got cpu; use backend='emulated'"):
            paged_attention(*case, backend="kernel")


# ---------------------------------------------------------------- the cpu backend (C++, the engines' CPU path)


@needs_compiler
@pytest.mark.parametrize("group", GQA_GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_cpu_backend_matches_naive(block_size, group):
    case = make_case(MIXED_LENS, block_size, num_kv_heads=2, group=group)
    out = paged_attention(*case, backend="cpu")
    assert out.dtype == torch.float32 and out.shape == case[0].shape
    torch.testing.assert_close(out.double(), naive_attention(*case), rtol=1e-4, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("head_dim", [8, 36, 128, 256])  # 36: not a multiple of the 8 partial sums
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lens", [[1000], [17, 1, 1000, 16, 15], [5] * 9])  # one sequence: its heads split
def test_cpu_backend_head_dims_threads_and_batch_shapes(head_dim, threads, lens):
    case = make_case(lens, 16, num_kv_heads=8, group=2, head_dim=head_dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention(*case, backend="cpu", scale=0.3)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), naive_attention(*case, scale=0.3), rtol=1e-4, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
def test_cpu_backend_ignores_unused_slots_and_padding(fill, pad):
    case = make_case(MIXED_LENS, 16, group=4, fill=fill, pad=pad)
    out = paged_attention(*case, backend="cpu")
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), naive_attention(*case), rtol=1e-4, atol=1e-5)


@needs_compiler
def test_cpu_backend_threads_are_torchs_own():
    """Built with OpenMP, the kernel must run on the libgomp torch already loaded: a second OpenMP
    runtime would bring a second set of threads competing with torch's for the same cores."""
    from l3_block_kernel import kernel_build
    if not kernel_build._torch_runs_on_gnu_openmp():
        pytest.skip("torch does not run on GNU OpenMP here: the kernel is built to use the calling thread")
    assert "-fopenmp" in kernel_build.CPU_KERNEL_OPTIONAL_FLAGS
    case = make_case([1000] * 4, 16, num_kv_heads=8, group=2, head_dim=64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = paged_attention(*case, backend="cpu")
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), naive_attention(*case), rtol=1e-4, atol=1e-5)
    # Whose OpenMP each library calls: the file its omp_get_max_threads resolves to (dlsym through its
    # handle). Other packages may load OpenMP runtimes of their own (sentencepiece's wheel does):
    # what matters is that the kernel shares torch's.
    kernel = kernel_build.load_cpu_kernel()
    torch_cpu = ctypes.CDLL(next(path for _, _, path in mapped_files() if Path(path).name.startswith("libtorch_cpu")))
    kernels_runtime, torchs_runtime = (mapped_file(ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value)
                                       for lib in (kernel, torch_cpu))
    assert "libgomp" in torchs_runtime and kernels_runtime == torchs_runtime, (kernels_runtime, torchs_runtime)


def mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file mapped into this process (/proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/"):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            out.append((start, end, fields[5]))
    return out


def mapped_file(address: int) -> str:
    """The file mapped at `address` in this process."""
    return next((path for start, end, path in mapped_files() if start <= address < end), "(not a mapped file)")


@needs_compiler
def test_a_compiler_without_openmp_still_builds_the_cpu_kernel(monkeypatch, tmp_path):
    """A compiler that refuses -fopenmp gets a second try without it: the kernel then runs on the
    calling thread, and gives the same answers."""
    import importlib

    from l3_block_kernel import kernel_build
    pa = importlib.import_module("l3_block_kernel.paged_attention")  # the module; the package exports the function
    if "-fopenmp" not in kernel_build.CPU_KERNEL_OPTIONAL_FLAGS:
        pytest.skip("the kernel is built without OpenMP here")
    fake = tmp_path / "no-openmp-c++"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "error: no -fopenmp" >&2; exit 1; }; done\n'
                    f'exec {kernel_build.host_compiler()} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("L3_EMULATION_CACHE", str(tmp_path / "cache"))
    library = kernel_build.build_host(kernel_build.CPU_KERNEL_BUILD)
    monkeypatch.setattr(pa, "load_cpu_kernel", lambda: library)
    case = make_case([1000, 7, 300], 16, num_kv_heads=8, group=2, head_dim=64)
    torch.testing.assert_close(paged_attention(*case, backend="cpu").double(), naive_attention(*case),
                               rtol=1e-4, atol=1e-5)


def test_a_compiler_that_fails_silently_is_one_line(monkeypatch, tmp_path):
    from l3_block_kernel import kernel_build
    monkeypatch.setenv("CXX", "false")  # exits 1 and prints nothing
    monkeypatch.setenv("L3_EMULATION_CACHE", str(tmp_path))
    with pytest.raises(InputError) as info:
        kernel_build.build_host(kernel_build.CPU_KERNEL_BUILD)
    assert str(info.value) == "cannot build the L3 CPU kernel with false (it needs C++17): exit status 1, no message"


@needs_compiler
def test_cpu_backend_takes_float32_on_the_cpu_only():
    case = make_case([5, 9], 16, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="backend='cpu' runs float32, got torch.bfloat16; use backend='gather'"):
        paged_attention(*case, backend="cpu")
    q, k, v, tables, lens = make_case([5, 9], 16)
    out = paged_attention(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, tables.t().contiguous().t(), lens,
                          backend="cpu")  # strided q and tables are made contiguous first
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, tables, lens), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the CUDA source, without a GPU


def test_kernel_source_is_plain_cuda():
    """The kernels (L3's and L4's) and their headers compile without torch; only binding.cpp
    includes it. The one launch syntax the emulation cannot parse, <<<...>>>, appears only in the
    LAUNCH_KERNEL macro, which both kernels take from cuda_launch.h."""
    l4_source = L4_CSRC_DIR / "paged_prefill.cu"
    sources = (KERNEL_SOURCE, CSRC_DIR / "paged_attention.h", l4_source, L4_CSRC_DIR / "paged_prefill.h", LAUNCH_HEADER)
    for path in sources:
        includes = [line for line in path.read_text().splitlines() if line.startswith("#include")]
        assert not any("torch" in line or "ATen" in line or "c10" in line for line in includes), path
    launches = [line for path in sources for line in path.read_text().splitlines()
                if "<<<" in line and not line.startswith("//")]
    assert len(launches) == 1 and launches[0].startswith("#define LAUNCH_KERNEL"), launches
    for kernel in (KERNEL_SOURCE, l4_source):
        assert any(line.startswith("#include") and "cuda_launch.h" in line for line in kernel.read_text().splitlines())


def _compile(tmp_path, archs, flags=(), code="sm", started: subprocess.Popen | None = None):
    command = prebuild.nvcc_command(tmp_path / "paged_attention.o", archs, *flags, code=code)
    if command is None:
        pytest.skip("nvcc is not on PATH: install the CUDA toolkit to compile-check the kernel")
    if started is not None:  # began with the session (tests/prebuild.py): collect its result
        output, returncode = started.communicate(timeout=900)[0], started.returncode
    else:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
        output, returncode = result.stdout, result.returncode
    assert returncode == 0, output[-4000:]
    assert "warning" not in output.lower(), output[-4000:]


def test_kernel_compiles_for_the_oldest_supported_arch(tmp_path):
    """Turing (T4), the oldest: no native bf16 arithmetic, the arch most likely to reject an
    intrinsic, which the front end does, so to PTX only; head_dim 128 only
    (PAGED_ATTENTION_COMPILE_CHECK: every dtype, L12's cache formats and group size, 63 kernels;
    the other head dims differ only in constants, and the emulation build compiles all of them).
    About 16 s on 2 idle cores, started with the session beside the other tests. The slow test
    below compiles every kernel to machine code; the kernel itself ran on an H100."""
    _compile(tmp_path, **prebuild.OLDEST_ARCH_CHECK, started=prebuild.take_nvcc_check())


@pytest.mark.slow
def test_kernel_compiles_for_every_supported_arch(tmp_path):
    """Turing (T4), Ampere (A100), Ada (L4, RTX 40xx), Hopper (H100), every kernel (189): one nvcc
    call, its --threads 0 compiling the architectures side by side. Several minutes on 2 cores."""
    _compile(tmp_path, ["75", "80", "89", "90"])


# ---------------------------------------------------------------- the kernel's own code: emulated here, real on a GPU

KERNEL_BACKENDS = [pytest.param("emulated", marks=needs_compiler), pytest.param("kernel", marks=pytest.mark.gpu)]
# split: False runs the single pass; a number forces split-K with partitions of that many
# positions. 24 is one and a half 16-position blocks, so partitions end mid-block.
SPLITS = [pytest.param(False, id="single"), pytest.param(24, id="split24")]
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(params=KERNEL_BACKENDS)
def backend(request):
    return request.param


def run_kernel(case, backend, dtype=torch.float32, split=False, scale=None):
    """The kernel's output (float64, on the CPU) and the naive float64 oracle on the same rounded inputs."""
    q, k, v, tables, lens = case
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    device = "cuda" if backend == "kernel" else "cpu"
    split_args = dict(split_k=True, partition_size=split) if split else dict(split_k=False)
    out = paged_attention(q.to(device), k.to(device), v.to(device), tables.to(device), lens.to(device),
                          scale, backend=backend, **split_args)
    assert out.dtype == dtype and out.shape == q.shape
    return out.cpu().double(), naive_attention(q, k, v, tables, lens, scale)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("group", GQA_GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_kernel_matches_naive(backend, block_size, group, split):
    case = make_case(MIXED_LENS, block_size, num_kv_heads=2, group=group, head_dim=128)
    torch.testing.assert_close(*run_kernel(case, backend, split=split), **FP32_TOL)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("group", [3, 5, 6, 7])  # blocks of 1 or 2 heads; each KV head read by several blocks
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_kernel_head_dims_and_odd_groups(backend, head_dim, group, split):
    case = make_case((17, 1, 200, 16), 16, num_kv_heads=2, group=group, head_dim=head_dim)
    torch.testing.assert_close(*run_kernel(case, backend, split=split, scale=0.3), **FP32_TOL)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_precision(backend, dtype, block_size, split):
    """Same rounded inputs, exact math in the oracle: only fp32 noise and the output's rounding differ.

    That rounding is at most half a unit in the last place, a relative 2^-8 for bfloat16 (8
    significant bits) and 2^-11 for float16 (11); rtol allows one whole unit, atol the fp32 noise.
    """
    case = make_case(MIXED_LENS + (4097,), block_size, group=4, head_dim=128)
    rtol = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(*run_kernel(case, backend, dtype, split=split), rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("split", [False, 512])  # 4097 = 8 * 512 + 1: the last partition holds one position
@pytest.mark.parametrize("block_size", [8, 128])
def test_kernel_long_context(backend, block_size, split):
    case = make_case([4097, 4096, 1], block_size, num_kv_heads=1, group=2, head_dim=64)
    torch.testing.assert_close(*run_kernel(case, backend, split=split), **FP32_TOL)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("pad", [-1, 2**31 - 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
def test_kernel_unused_slots_and_padding_never_reach_the_result(backend, fill, dtype, pad, split):
    case = make_case(MIXED_LENS, 16, group=2, head_dim=64, fill=fill, pad=pad)
    out, expected = run_kernel(case, backend, dtype, split=split)
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=1e-4)


@pytest.mark.parametrize("partition_size", [8, 24, 40])
def test_split_k_partition_edges(backend, partition_size):
    """Lengths that end a partition exactly, one past it (a partition of one position), mid-block
    and mid-tile; partitions of 8 hold a single tile each."""
    p = partition_size
    case = make_case([1, p, p + 1, 2 * p - 3, 3 * p + 1, 7 * p + 5], 16, group=4, head_dim=32)
    out, expected = run_kernel(case, backend, split=partition_size)
    torch.testing.assert_close(out, expected, **FP32_TOL)


@needs_compiler
@pytest.mark.parametrize("partition_size", [0, 8])
def test_emulated_kernel_writes_zeros_for_a_zero_length(partition_size):
    """The wrapper rejects a length below 1; the kernel itself, called anyway, writes zeros, not NaN."""
    q, k, v, tables, lens = make_case([5, 20], 8, head_dim=32)
    lens = torch.tensor([0, -3], dtype=torch.int32)
    out = pa.paged_attention_emulated(q, k, v, tables, lens, 0.2, partition_size)
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(InputError, match="context_lens must be in"):
        paged_attention(q, k, v, tables, lens, backend="emulated", check_values=False)


def test_misaligned_tensors_are_an_input_error(backend):
    """fp32 with head_dim 128 loads 16 bytes a lane; bf16 with head_dim 32 loads 2, so any element works."""
    device = "cuda" if backend == "kernel" else "cpu"
    q, k, v, tables, lens = (t.to(device) for t in make_case([5, 20], 16, head_dim=128))
    shifted = torch.empty(q.numel() + 1, device=device)[1:].view_as(q).copy_(q)  # 4 bytes past 16
    with pytest.raises(InputError, match="q must start on a 16-byte boundary"):
        paged_attention(shifted, k, v, tables, lens, backend=backend)
    q, k, v, tables, lens = (t.to(device) for t in make_case([5, 20], 16, head_dim=32))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)[1:].view_as(q).copy_(q)
    assert torch.equal(paged_attention(shifted, k, v, tables, lens, backend=backend),
                       paged_attention(q, k, v, tables, lens, backend=backend))


def test_kernel_rejects_unsupported_shapes_clearly(backend):
    device = "cuda" if backend == "kernel" else "cpu"
    case = tuple(t.to(device) for t in make_case([5], 16, head_dim=16))
    with pytest.raises(InputError, match=f"backend='{backend}' cannot run this call: head_dim 16 is not one of"):
        paged_attention(*case, backend=backend)
    q, k, v, tables, lens = (t.to(device) for t in make_case([5], 16, head_dim=32))
    with pytest.raises(InputError, match="dtype torch.float64 is not one of"):
        paged_attention(q.double(), k.double(), v.double(), tables, lens, backend=backend)


def test_split_k_dispatch_rule():
    """Split-K only when the single pass launches too few blocks and the tables hold two partitions."""
    assert pa.use_split_k(num_seqs=1, num_heads=32, num_kv_heads=8, capacity=32768)      # 8 blocks
    assert not pa.use_split_k(num_seqs=32, num_heads=32, num_kv_heads=8, capacity=32768)  # 256 blocks
    assert not pa.use_split_k(num_seqs=1, num_heads=32, num_kv_heads=8, capacity=2 * pa.SPLIT_K_PARTITION - 8)
    assert pa.use_split_k(num_seqs=1, num_heads=6, num_kv_heads=1, capacity=4096)  # group 6: 3 blocks of 2 heads
    case = make_case([5], 16)
    with pytest.raises(InputError, match="partition_size must be a positive multiple of 8"):
        paged_attention(*case, backend="emulated", split_k=True, partition_size=12)


def test_a_failed_build_is_remembered_and_auto_says_why_once(monkeypatch):
    calls = []

    def broken_build():
        calls.append(1)
        raise InputError("cannot build the L3 CUDA extension (no nvcc)")

    once = pa.load_extension.__class__(broken_build)
    for _ in range(3):
        with pytest.raises(InputError, match="no nvcc"):
            once()
    assert len(calls) == 1
    monkeypatch.setattr(pa, "_fallbacks_reported", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [pa._fall_back("head_dim 16") for _ in range(3)] == ["reference"] * 3
    assert len(caught) == 1 and "uses the PyTorch reference: head_dim 16" in str(caught[0].message)


@pytest.mark.parametrize("torch_cuda, nvcc, message", [
    (None, "12.8", "(L3, L4) need a CUDA build of torch (this one is CPU-only)"),
    ("12.8", None, "(L3, L4) need nvcc: install the CUDA 12.8 toolkit"),
    ("12.8", "13.0", "nvcc is CUDA 13.0 but torch was built with CUDA 12.8: install the CUDA 12.x toolkit"),
])
def test_cuda_toolchain_mismatch_is_one_line(monkeypatch, torch_cuda, nvcc, message):
    from l3_block_kernel import kernel_build
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(kernel_build, "_nvcc_version", lambda: nvcc)
    with pytest.raises(InputError) as info:
        kernel_build.check_cuda_toolchain()
    assert message in str(info.value) and "\n" not in str(info.value)


@needs_compiler
def test_emulation_build_is_cached():
    library = load_emulation()
    start = time.perf_counter()
    assert load_emulation() is library and time.perf_counter() - start < 0.1


# ---------------------------------------------------------------- only on a GPU


@pytest.mark.gpu
def test_kernel_offsets_past_2_to_the_31_elements():
    """A pool of more than 2^31 elements (4.3 GB of bf16 per tensor): 32-bit offsets would wrap."""
    num_blocks, block_size, num_kv_heads, head_dim = 2**31 // (16 * 8 * 128) + 4, 16, 8, 128
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    needed = 2 * num_blocks * block_size * num_kv_heads * head_dim * 2  # K and V, 2 bytes each
    if torch.cuda.mem_get_info()[0] < needed + 2**30:
        pytest.skip(f"needs {needed / 2**30:.1f} GiB of free GPU memory for a pool past 2^31 elements")
    k = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    small = make_case([40], block_size, num_kv_heads=num_kv_heads, group=2, head_dim=head_dim)
    q, k_small, v_small, _, lens = (t.cuda() for t in small)
    q, k_small, v_small = q.bfloat16(), k_small.bfloat16(), v_small.bfloat16()
    last = torch.arange(num_blocks - 3, num_blocks, device="cuda")  # the pool's last three blocks
    k[last], v[last] = k_small[:3], v_small[:3]
    out = paged_attention(q, k, v, last.int()[None, :], lens, backend="kernel")
    expected = naive_attention(q.cpu(), k_small[:3].cpu(), v_small[:3].cpu(),
                               torch.arange(3, dtype=torch.int32)[None], lens.cpu())
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2**-7, atol=1e-4)


@pytest.mark.gpu
def test_auto_runs_the_kernel_on_cuda_and_the_build_is_cached():
    case = tuple(t.cuda() for t in make_case(MIXED_LENS, 16, head_dim=128))
    module = load_extension()
    start = time.perf_counter()
    assert load_extension() is module and time.perf_counter() - start < 0.1
    assert torch.equal(paged_attention(*case), paged_attention(*case, backend="kernel"))
    tiny = tuple(t.cuda() for t in make_case([5], 16, head_dim=16))  # no kernel: auto takes the reference, warns
    with pytest.warns(UserWarning, match="head_dim 16 is not one of"):
        assert torch.equal(paged_attention(*tiny), paged_attention_reference(*tiny))


@needs_compiler
@pytest.mark.parametrize("dtype, kind", [(torch.float16, 1), (torch.bfloat16, 2)])
def test_emulated_16_bit_floats_round_like_torch(dtype, kind):
    """The emulation's own conversions (no CUDA headers) against torch's round-to-nearest-even:
    every 16-bit pattern back to float, and floats at and between the representable values,
    ties, subnormals, overflow, ±inf and NaN."""
    import ctypes
    library = load_emulation()
    patterns = torch.arange(2**16, dtype=torch.int32).to(torch.int16)
    widened = torch.empty(2**16)
    library.l3_emulated_from_16bit(ctypes.c_void_p(patterns.data_ptr()), ctypes.c_void_p(widened.data_ptr()),
                                   ctypes.c_int64(2**16), kind)
    expected = patterns.view(dtype).float()
    assert torch.equal(widened.isnan(), expected.isnan())
    assert torch.equal(widened.nan_to_num(0.0), expected.nan_to_num(0.0))
    finite = expected[expected.isfinite()].unique()
    between = (finite[1:] + finite[:-1]) / 2  # exact ties (float32 holds them), rounded to even
    gen = torch.Generator().manual_seed(0)
    samples = torch.cat([finite, between, between.nextafter(finite[1:]), between.nextafter(finite[:-1]),
                         torch.randn(100_000, generator=gen) * 10.0 ** torch.randint(-9, 6, (100_000,), generator=gen),
                         torch.tensor([1e6, -1e6, 65519.0, 65520.0, float("inf"), float("-inf"), 3e38, 1e-45])])
    narrowed = torch.empty(len(samples), dtype=torch.int16)
    library.l3_emulated_to_16bit(ctypes.c_void_p(samples.data_ptr()), ctypes.c_void_p(narrowed.data_ptr()),
                                 ctypes.c_int64(len(samples)), kind)
    assert torch.equal(narrowed.view(dtype).float(), samples.to(dtype).float())
    nan = torch.full((1,), float("nan"))
    library.l3_emulated_to_16bit(ctypes.c_void_p(nan.data_ptr()), ctypes.c_void_p(narrowed.data_ptr()),
                                 ctypes.c_int64(1), kind)
    assert narrowed[:1].view(dtype).isnan().all()
