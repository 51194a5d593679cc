"""L4: the kernels (C++ for a CPU, CUDA under the CPU emulation and on a GPU) against the PyTorch
reference, the dispatcher's checks, and the CUDA source compiling with nvcc.

The kernels are provided code: these tests carry no points. Each case also fills every slot no
row reads with NaN, and pads the tables with -1 or an id past the pool, so that a kernel that
reads one more position or one more table entry than it should fails.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from l1_contiguous import InputError
from l3_block_kernel.kernel_build import host_compiler
from l4_paged_prefill import cascade_attention, common_prefix_blocks, paged_prefill_attention, paged_prefill_reference
from l4_paged_prefill.varlen import PagedPrefillPlan
from l4_paged_prefill.kernel_build import CSRC_DIR, KERNEL_SOURCE
from test_l4_attention import make_batch

pytestmark = [pytest.mark.l4]
needs_compiler = pytest.mark.skipif(host_compiler() is None, reason="the cpu and emulated backends need g++ or clang++")
HOST_BACKENDS = [pytest.param("cpu", marks=needs_compiler), pytest.param("emulated", marks=needs_compiler)]
SHAPES = [  # context_lens, query_lens, block_size
    ([10, 7, 2], [4, 1, 2], 4),
    ([17, 1, 33, 16], [17, 1, 5, 1], 8),
    ([70, 9, 40], [35, 9, 1], 16),   # more rows than one tile (16 on the CPU, 16 / G on the GPU)
    ([5, 6, 7], [5, 3, 1], 1),
    ([130, 64], [1, 64], 32),
]


def reference(case, **kwargs):
    q, k, v, *rest = case
    out, lse = paged_prefill_reference(q.double(), k.double(), v.double(), *rest, **kwargs)
    return out, lse


def run(backend, case, dtype=torch.float32, **kwargs):
    q, k, v, *rest = case
    return paged_prefill_attention(q.to(dtype), k.to(dtype), v.to(dtype), *rest, backend=backend,
                                   return_lse=True, **kwargs)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("context_lens,query_lens,block_size", SHAPES)
@pytest.mark.parametrize("group", [1, 2, 8])
def test_host_kernels_equal_the_reference(backend, context_lens, query_lens, block_size, group):
    case = make_batch(context_lens, query_lens, block_size, group=group, head_dim=32, fill=float("nan"), seed=group)
    out, lse = run(backend, case)
    want_out, want_lse = reference(case)
    torch.testing.assert_close(out.double(), want_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("window", [None, 1, 5, 24])
def test_host_kernels_head_dims_and_windows(backend, head_dim, window):
    case = make_batch([50, 21, 3], [20, 1, 3], 8, group=2, head_dim=head_dim, fill=float("nan"))
    out, _ = run(backend, case, window=window)
    torch.testing.assert_close(out.double(), reference(case, window=window)[0], rtol=2e-5, atol=2e-5)


@needs_compiler
@pytest.mark.parametrize("head_dim", [8, 20, 40])
@pytest.mark.parametrize("group", [1, 4])
def test_the_cpu_kernel_takes_head_dims_the_cuda_kernel_does_not(head_dim, group):
    """Not a multiple of the vector width (8) or of a decode row's value block (32): the rows' and
    the products' remainder loops, in tiles of many rows and in decode rows."""
    case = make_batch([50, 21, 3, 70], [20, 1, 3, 1], 8, group=group, head_dim=head_dim, fill=float("nan"))
    out, lse = run("cpu", case)
    want_out, want_lse = reference(case)
    torch.testing.assert_close(out.double(), want_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_entries_behind_a_window_are_never_read(backend):
    """L13 leaves -1 where a sliding group freed a block: a windowed call must not touch it."""
    q, k, v, cu, lens, tables = make_batch([40, 33], [3, 1], 4, head_dim=32, fill=float("nan"))
    tables[0, :7] = -1  # positions 0..27: behind the first row's window (37 - 6 + 1 = 32)
    tables[1, :6] = -1  # positions 0..23: behind its row's window (32 - 6 + 1 = 27)
    case = (q, k, v, cu, lens, tables)
    out, _ = run(backend, case, window=6)
    torch.testing.assert_close(out.double(), reference(case, window=6)[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", [*HOST_BACKENDS, "reference"])
def test_the_cascade_passes_through_every_backend(backend):
    context_lens, query_lens = [30, 22, 26, 19], [6, 1, 3, 1]
    q, k, v, cu, lens, tables = make_batch(context_lens, query_lens, 4, shared_blocks=4, head_dim=32,
                                           dtype=torch.float32, fill=float("nan"))
    shared = common_prefix_blocks(tables.tolist(), context_lens, query_lens, 4)
    assert shared == 4
    want = paged_prefill_attention(q, k, v, cu, lens, tables, backend="reference")
    got = cascade_attention(q, k, v, cu, lens, tables, shared, backend=backend)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_kernel_in_half_precision(dtype):
    case = make_batch([40, 9, 17], [12, 1, 17], 8, head_dim=64, dtype=torch.float32, fill=float("nan"))
    q, k, v, *rest = (t.to(dtype) if t.dtype == torch.float32 else t for t in case)
    out = paged_prefill_attention(q, k, v, *rest, backend="emulated")
    want = paged_prefill_attention(q.float(), k.float(), v.float(), *rest, backend="reference")
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@needs_compiler
@pytest.mark.parametrize("codes", [torch.float8_e4m3fn, torch.int8])
def test_cpu_kernel_reads_l12s_codes_in_place(codes):
    """A cache of one-byte codes with a scale per KV head reads as float(code) * scale."""
    q, k, v, cu, lens, tables = make_batch([30, 7], [5, 1], 8, dtype=torch.float32)
    scales = torch.tensor([0.02, 0.05]), torch.tensor([0.03, 0.04])
    k_codes, v_codes = ((t / s[:, None]).clamp(-127, 127).round().to(codes) for t, s in zip((k, v), scales))
    as_float = [c.float() * s[:, None] for c, s in zip((k_codes, v_codes), scales)]
    want = paged_prefill_attention(q, *as_float, cu, lens, tables, backend="reference")
    for backend in ("cpu", "reference"):
        got = paged_prefill_attention(q, k_codes, v_codes, cu, lens, tables, backend=backend, k_scales=scales[0],
                                      v_scales=scales[1])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="k_scales and v_scales go with caches"):
        paged_prefill_attention(q, k_codes, v_codes, cu, lens, tables, backend="cpu")


BAD_CALLS = [
    ("a block id past the pool", lambda c: c[5].__setitem__((0, 1), 999), "block_tables\\[0, 1\\] = 999"),
    ("a length past the table", lambda c: c[4].__setitem__(1, 99), "context_lens\\[1\\] = 99"),
    ("fewer keys than rows", lambda c: c[4].__setitem__(0, 2), "context_lens\\[0\\] = 2"),
    ("offsets that do not end at T", lambda c: c[3].__setitem__(3, 6), "cu_seqlens_q|query rows"),
]


@pytest.mark.parametrize("backend", [*HOST_BACKENDS, "reference"])
@pytest.mark.parametrize("what,spoil,message", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_tables_are_one_line_input_errors_before_anything_is_read(backend, what, spoil, message):
    case = list(make_batch([10, 7, 2], [4, 1, 2], 4, head_dim=32, dtype=torch.float32))
    spoil(case)
    with pytest.raises(InputError, match=message) as err:
        paged_prefill_attention(*case, backend=backend)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.__setitem__(1, c[1][..., :8].contiguous()), "head_dim"),
    (lambda c: c.__setitem__(3, c[3].long()), "cu_seqlens_q must be int32"),
    (lambda c: c.__setitem__(5, c[5][:2]), "block_tables must be int32"),
    (lambda c: c.__setitem__(0, c[0][:, :3]), "multiple of"),
])
def test_bad_shapes_are_input_errors(change, message):
    case = list(make_batch([10, 7, 2], [4, 1, 2], 4, dtype=torch.float32))
    change(case)
    with pytest.raises(InputError, match=message):
        paged_prefill_attention(*case, backend="reference")


@pytest.mark.parametrize("backend", [*HOST_BACKENDS, "reference"])
def test_a_plan_runs_every_layer_of_a_step_as_the_dispatcher_would(backend):
    """Layers of one step: other caches, a window on one; each call of the plan equals the
    dispatcher's on the same layer (and the definition), in any order of windows."""
    q, k, v, cu, lens, tables = make_batch([70, 9, 40], [35, 9, 1], 16, head_dim=32, dtype=torch.float32, pad=-1, seed=1)
    layers = [(k, v, None), (k.flip(0).contiguous(), v.flip(0).contiguous(), 5), (v, k, None), (k, v, 24)]
    plan = PagedPrefillPlan(cu, lens, tables, max_query_len=35, backend=backend)
    for scale_q, (kk, vv, window) in zip((1.0, -0.5, 2.0, 0.25), layers):
        got = plan.run(q * scale_q, kk, vv, window=window)
        want = paged_prefill_reference((q * scale_q).double(), kk.double(), vv.double(), cu, lens, tables,
                                       window=window)[0]
        torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("backend", [*HOST_BACKENDS, "reference"])
def test_a_plan_checks_a_call_that_differs_from_the_first(backend):
    """Only a call alike to the checked one skips the checks: another head_dim, a cache of another
    shape or a non-contiguous one is checked again (one-line InputError), and the plan still
    answers the alike calls after it."""
    q, k, v, cu, lens, tables = make_batch([10, 7, 2], [4, 1, 2], 4, head_dim=32, dtype=torch.float32)
    plan = PagedPrefillPlan(cu, lens, tables, max_query_len=4, backend=backend)
    first = plan.run(q, k, v)
    with pytest.raises(InputError, match="head_dim"):
        plan.run(q, k[..., :8].contiguous(), v[..., :8].contiguous())
    with pytest.raises(InputError, match="contiguous"):
        plan.run(q, k.transpose(0, 1).contiguous().transpose(0, 1), v)
    with pytest.raises(InputError, match="multiple of"):
        plan.run(q[:, :3], k, v)
    torch.testing.assert_close(plan.run(q, k, v), first)


@pytest.mark.parametrize("backend", [*HOST_BACKENDS, "reference"])
def test_a_plans_first_call_is_checked_as_the_dispatchers(backend):
    """The call that plans the host kernel's arguments is itself checked: a bad window or table
    dtype is a one-line InputError, and the plan is not left half made (a good call then works)."""
    q, k, v, cu, lens, tables = make_batch([10, 7, 2], [4, 1, 2], 4, head_dim=32, dtype=torch.float32)
    with pytest.raises(InputError, match="window must be None or a positive int"):
        PagedPrefillPlan(cu, lens, tables, max_query_len=4, backend=backend).run(q, k, v, window=0)
    with pytest.raises(InputError, match="block_tables must be int32"):
        PagedPrefillPlan(cu, lens, tables.long(), max_query_len=4, backend=backend).run(q, k, v)
    plan = PagedPrefillPlan(cu, lens, tables, max_query_len=4, backend=backend)
    with pytest.raises(InputError, match="head_dim"):
        plan.run(q, k[..., :8].contiguous(), v[..., :8].contiguous())
    torch.testing.assert_close(plan.run(q, k, v), paged_prefill_attention(q, k, v, cu, lens, tables, backend=backend))


def test_backend_choice_is_checked():
    case = make_batch([10], [2], 4, dtype=torch.float32)
    with pytest.raises(InputError, match="backend must be one of"):
        paged_prefill_attention(*case, backend="gather")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="needs CUDA"):
            paged_prefill_attention(*case, backend="kernel")
    with pytest.raises(InputError, match="runs float32"):
        q, k, v, *rest = case
        paged_prefill_attention(q.double(), k.double(), v.double(), *rest, backend="cpu")
    with pytest.raises(InputError, match="window must be"):
        paged_prefill_attention(*case, window=0)


def test_kernel_source_compiles_with_nvcc(tmp_path):
    """The CUDA source is plain CUDA: nvcc compiles it for sm_80 (PTX only, the front end's checks)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    result = subprocess.run([nvcc, "-c", "-std=c++17", "-O3", f"-I{CSRC_DIR}", str(KERNEL_SOURCE), "-o",
                             str(tmp_path / "k.o"), "-gencode=arch=compute_80,code=compute_80"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens,query_lens,block_size", SHAPES)
def test_cuda_kernel_equals_the_reference(dtype, context_lens, query_lens, block_size):
    case = [t.cuda() for t in make_batch(context_lens, query_lens, block_size, group=4, head_dim=128,
                                          dtype=torch.float32, fill=float("nan"))]
    q, k, v, *rest = (t.to(dtype) if t.is_floating_point() else t for t in case)
    out, lse = paged_prefill_attention(q, k, v, *rest, backend="kernel", return_lse=True)
    want, want_lse = paged_prefill_reference(q.float(), k.float(), v.float(), *rest)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse, want_lse.float(), rtol=tolerance, atol=tolerance)


def test_the_cuda_kernel_compiles_for_the_oldest_supported_arch(tmp_path):
    """nvcc, where installed, compiles paged_prefill.cu (with L3's cuda_launch.h, which it shares)
    to sm_75 PTX, without a warning: the source a GPU's build would compile, checked on any machine."""
    import subprocess

    import prebuild
    from l4_paged_prefill.kernel_build import KERNEL_SOURCE

    command = prebuild.nvcc_command(tmp_path / "paged_prefill.o", ["75"], code="compute", source=KERNEL_SOURCE)
    if command is None:
        pytest.skip("nvcc is not on PATH: install the CUDA toolkit to compile-check the kernel")
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert result.returncode == 0 and "warning" not in result.stdout.lower(), result.stdout[-4000:]
