"""L12: L3's paged-attention backends reading a cache of one-byte codes (fp8 e4m3 or int8).

Every backend (reference, gather, cpu, the kernel's code emulated, single pass and split-K) must
attend to the values float32(code) * scale of the code's KV head, exactly as
l12_quantized_kv.quantize.dequantize reads them; the oracle here computes them in float64 from
the codes themselves. Slots no sequence owns hold NaN codes, so any read of them shows. The
kernel's code runs on the GPU too where CUDA exists (backend "kernel").
"""

from __future__ import annotations

import pytest
import torch

from l1_contiguous import InputError
from l12_quantized_kv.paged_attention import paged_attention_quantized
from l12_quantized_kv.quantize import INT8_NAN_CODE, dequantize
from l3_block_kernel.kernel_build import host_compiler
from l3_block_kernel.paged_attention import paged_attention, paged_attention_cpu, paged_attention_emulated

pytestmark = pytest.mark.l12

needs_compiler = pytest.mark.skipif(host_compiler() is None,
                                    reason="backends 'emulated' and 'cpu' need a C++ compiler (g++ or clang++, or set CXX)")
FORMATS = [pytest.param(torch.float8_e4m3fn, id="fp8"), pytest.param(torch.int8, id="int8")]
# (num_kv_heads, group, head_dim, block_size): GQA 8 query heads on 2 KV heads, and no grouping.
SHAPES = [pytest.param(2, 4, 32, 8, id="gqa8/2-d32-bs8"), pytest.param(4, 1, 64, 16, id="mha4-d64-bs16"),
          pytest.param(2, 4, 64, 16, id="gqa8/2-d64-bs16")]
# split: partitions of 24 positions end mid-block for block size 16 and cut a context in several.
BACKENDS = [pytest.param("reference", None, id="reference"), pytest.param("gather", None, id="gather"),
            pytest.param("cpu", None, id="cpu", marks=needs_compiler),
            pytest.param("emulated", False, id="emulated-single", marks=needs_compiler),
            pytest.param("emulated", 24, id="emulated-split24", marks=needs_compiler),
            pytest.param("kernel", False, id="kernel-single", marks=pytest.mark.gpu),
            pytest.param("kernel", 24, id="kernel-split24", marks=pytest.mark.gpu)]
LENS = (17, 1, 40, 16, 9)  # one past a block, one token, several blocks, exactly a block, mid-block
# Outputs are averages of values up to about 5 that partly cancel: atol is float32 noise on those.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def nan_codes(dtype, shape):
    """Codes that read as NaN: int8's -128; fp8's two NaN patterns, s 1111 111 with either sign."""
    if dtype == torch.int8:
        return torch.full(shape, INT8_NAN_CODE, dtype=torch.int8)
    bits = torch.tensor([0x7f, 0xff], dtype=torch.uint8).repeat(-(-torch.Size(shape).numel() // 2))
    return bits[:torch.Size(shape).numel()].view(torch.float8_e4m3fn).view(shape)


def random_codes(dtype, shape, gen):
    """Finite codes over the whole range: for fp8 magnitudes from the subnormals (below 2^-6) to 2^7."""
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    magnitude = 2.0 ** torch.randint(-10, 6, shape, generator=gen)
    return (torch.randn(shape, generator=gen) * magnitude).to(torch.float8_e4m3fn)


def make_case(dtype, lens=LENS, num_kv_heads=2, group=4, head_dim=32, block_size=8, seed=0):
    """q, k_codes, v_codes, k_scales, v_scales, block_tables, context_lens.

    Each sequence owns ceil(len / block_size) shuffled blocks; two blocks belong to no one. Every
    slot no sequence owns (those blocks, and the tail of each last block) holds NaN codes; tables
    are padded with -1 past the used columns. K and V scales differ between heads and from each other.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 2
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(counts) + 1), -1, dtype=torch.int32)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    start = 0
    for s, (n, count) in enumerate(zip(lens, counts)):
        tables[s, :count] = ids[start:start + count].int()
        start += count
        positions = torch.arange(n)
        owned[tables[s, positions // block_size].long() * block_size + positions % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    owned = owned.view(num_blocks, block_size, 1, 1).expand(shape)
    k, v = (torch.where(owned, random_codes(dtype, shape, gen).view(torch.uint8),
                        nan_codes(dtype, shape).view(torch.uint8)).view(dtype) for _ in range(2))
    k_scales = 0.02 * torch.linspace(0.5, 1.5, num_kv_heads)  # values of a few units at most
    v_scales = 0.02 * torch.linspace(2.0, 0.25, num_kv_heads)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    return q, k, v, k_scales, v_scales, tables, torch.tensor(lens, dtype=torch.int32)


def values64(codes, scales, rounded_to=None):
    """float64 values of codes: code * its head's scale, NaN for int8's NaN code (fp8's NaN is NaN),
    rounded to `rounded_to` first where given."""
    values = codes.double() * scales.double()[:, None]
    if codes.dtype == torch.int8:
        values = values.masked_fill(codes == INT8_NAN_CODE, float("nan"))
    return values if rounded_to is None else values.to(rounded_to).double()


def oracle(q, k_codes, v_codes, k_scales, v_scales, tables, lens, scale=None, rounded_to=None):
    """Independent float64 attention: gather each history, repeat KV heads for GQA, softmax.
    rounded_to: the dtype the values are rounded to before the math (see values64)."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_codes.shape[1:3]
    scale = head_dim ** -0.5 if scale is None else scale
    out = []
    for s, n in enumerate(lens.tolist()):
        blocks = tables[s, :-(-n // block_size)].long()
        k, v = (values64(c[blocks].flatten(0, 1)[:n], sc, rounded_to).repeat_interleave(num_heads // num_kv_heads, 1)
                for c, sc in ((k_codes, k_scales), (v_codes, v_scales)))  # [n, H, D]
        scores = torch.einsum("hd,nhd->hn", q[s].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def run(case, backend, split, scale=None):
    q, *rest = case
    device = "cuda" if backend == "kernel" else "cpu"
    kernel_args = {} if split is None else dict(split_k=bool(split), partition_size=split or 8)
    return paged_attention_quantized(q.to(device), *(t.to(device) for t in rest), scale, backend=backend,
                                     **kernel_args).cpu()


@pytest.mark.parametrize("backend, split", BACKENDS)
@pytest.mark.parametrize("num_kv_heads, group, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("dtype", FORMATS)
def test_backends_match_the_float64_oracle(dtype, num_kv_heads, group, head_dim, block_size, backend, split):
    case = make_case(dtype, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size)
    assert case[1].view(torch.uint8).eq(0x7f if dtype != torch.int8 else 0x80).any()  # NaN codes lie unused
    out = run(case, backend, split, scale=0.2)
    assert out.dtype == torch.float32 and out.shape == case[0].shape and out.isfinite().all()
    torch.testing.assert_close(out.double(), oracle(*case, scale=0.2), **FP32_TOL)


# Not cpu (float32 only) nor gather (SDPA in bf16 rounds the probabilities too; L3 checks it in float32).
@pytest.mark.parametrize("backend, split", [p for p in BACKENDS if p.id not in ("cpu", "gather")])
@pytest.mark.parametrize("dtype", FORMATS)
def test_bfloat16_queries(dtype, backend, split):
    """q in bf16: the kernel decodes codes to float32 and rounds only its output to bf16; the reference
    dequantizes into bf16 first (8 significant bits: an int8 code times its scale needs more), so
    its oracle takes the values rounded the same way. Then only the output's rounding differs."""
    q, *rest = make_case(dtype, num_kv_heads=2, group=2, head_dim=32, block_size=16)
    case = (q.bfloat16(), *rest)
    out = run(case, backend, split)
    assert out.dtype == torch.bfloat16
    rounded_to = torch.bfloat16 if backend == "reference" else None
    torch.testing.assert_close(out.double(), oracle(*case, rounded_to=rounded_to), rtol=2**-7, atol=1e-3)


@needs_compiler
@pytest.mark.parametrize("backend, split", [p for p in BACKENDS if p.id in ("cpu", "emulated-single")])
@pytest.mark.parametrize("dtype", FORMATS)
def test_every_code_reads_as_dequantize_does(dtype, backend, split):
    """One position, so the output is that position's V row exactly: each of the 256 codes (NaN codes
    included, as V of a position in use) reads bit for bit as float32(code) * scale."""
    q, k, v, _, _, tables, lens = make_case(dtype, lens=(1,), num_kv_heads=8, group=1, head_dim=32)
    v[tables[0, 0]] = torch.arange(256, dtype=torch.uint8).view(dtype).view(8, 32)  # every row of the block
    k_scales = torch.full((8,), 0.5)
    v_scales = torch.tensor([3e-3, 0.07, 1.0, 1.7, 2**-20, 5.0, 0.3, 11.0])
    out = paged_attention_quantized(q, k, v, k_scales, v_scales, tables, lens, backend=backend, split_k=split)
    expected = dequantize(v[tables[0, 0], 0], v_scales)  # [8, 32]: heads of position 0
    assert expected.isnan().sum() == (2 if dtype == torch.float8_e4m3fn else 1)
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", FORMATS)
def test_auto_on_the_cpu_is_the_reference(dtype):
    case = make_case(dtype)
    assert torch.equal(paged_attention_quantized(*case), paged_attention_quantized(*case, backend="reference"))
    empty = (case[0][:0], *case[1:5], case[5][:0], case[6][:0])
    assert paged_attention_quantized(*empty).shape == (0, 8, 32)


def _bad_inputs():
    """(name, change to a valid int8 case, a fragment of the expected message)."""
    def replace(i, fn):
        return lambda c: tuple(fn(t) if j == i else t for j, t in enumerate(c))
    shape_msg = "must be a contiguous float32 [num_kv_heads=2]"
    return [
        ("float cache", lambda c: (c[0], values64(c[1], c[3]).float(), values64(c[2], c[4]).float(), *c[3:]),
         "k_codes must hold fp8 (torch.float8_e4m3fn) or int8 codes; a float cache goes to"),
        ("k and v dtypes", replace(2, lambda t: t.float().to(torch.float8_e4m3fn)),
         "v_codes must have k_codes' dtype torch.int8"),
        ("scales shape", replace(3, lambda t: torch.cat([t, t])), f"k_scales {shape_msg}"),
        ("scales dtype", replace(4, lambda t: t.double()), f"v_scales {shape_msg}"),
        ("scales device", replace(3, lambda t: t.to("meta")), f"k_scales {shape_msg} on q's device cpu"),
        ("scales strided", replace(3, lambda t: torch.stack([t, t], 1)[:, 0]), f"k_scales {shape_msg}"),
        ("zero scale", replace(3, lambda t: t * torch.tensor([1.0, 0.0])), "k_scales must be finite and > 0"),
        ("NaN scale", replace(4, lambda t: t * torch.tensor([float("nan"), 1.0])), "v_scales must be finite and > 0"),
        ("negative scale", replace(4, lambda t: -t), "v_scales must be finite and > 0"),
        ("inf scale", replace(3, lambda t: t * float("inf")), "k_scales must be finite and > 0"),
        ("codes strided", replace(1, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
         "k_cache must be contiguous"),
        ("codes shape", replace(2, lambda t: t[:, :4]), "v_cache must have k_cache's shape"),
        ("pad read", replace(5, lambda t: t.index_fill(1, torch.tensor([0]), -1)), "block_tables[0, 0] = -1"),
        ("too long", replace(6, lambda t: t + 100), "context_lens must be in [1, 32]"),
    ]


@pytest.mark.parametrize("backend", ["auto", pytest.param("cpu", marks=needs_compiler),
                                     pytest.param("emulated", marks=needs_compiler)])
@pytest.mark.parametrize("name, mutate, message", _bad_inputs(), ids=[m[0] for m in _bad_inputs()])
def test_bad_inputs_raise_one_line_value_errors(name, mutate, message, backend):
    case = mutate(make_case(torch.int8, lens=(5, 17, 20)))
    with pytest.raises(ValueError) as info:
        paged_attention_quantized(*case, backend=backend)
    assert message in str(info.value) and "\n" not in str(info.value)


@needs_compiler
def test_backend_limits_are_l3s():
    q, *rest = make_case(torch.float8_e4m3fn)
    with pytest.raises(InputError, match="backend='cpu' runs float32, got torch.bfloat16; use backend='gather'"):
        paged_attention_quantized(q.bfloat16(), *rest, backend="cpu")
    with pytest.raises(InputError, match="backend='emulated' cannot run this call: dtype torch.float64"):
        paged_attention_quantized(q.double(), *rest, backend="emulated")
    with pytest.raises(InputError, match="partition_size must be a positive multiple of 8"):
        paged_attention_quantized(q, *rest, backend="emulated", split_k=True, partition_size=12)
    with pytest.raises(InputError, match="an fp8 or int8 cache is read with a float32 or bfloat16 query, not float16"):
        paged_attention_quantized(q.half(), *rest, backend="emulated")


@needs_compiler
def test_one_byte_caches_align_to_head_dim_over_32_bytes():
    """head_dim 64: a lane loads 2 codes, so a code cache one byte off is refused, q unchanged."""
    q, k, *rest = make_case(torch.int8, head_dim=64)
    shifted = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view_as(k).copy_(k)
    with pytest.raises(InputError, match="k_cache must start on a 2-byte boundary"):
        paged_attention_quantized(q, shifted, *rest, backend="emulated")


@needs_compiler
def test_the_c_entries_refuse_codes_without_scales():
    q, k, v, _, _, tables, lens = make_case(torch.int8)
    with pytest.raises(InputError, match="paged_attention: an fp8 or int8 cache needs k_scales and v_scales"):
        paged_attention_emulated(q, k, v, tables, lens, 0.2)
    with pytest.raises(InputError, match="an fp8 or int8 cache needs k_scales and v_scales"):
        paged_attention_cpu(q, k, v, tables, lens, 0.2)


@needs_compiler
@pytest.mark.parametrize("backend, split", [("cpu", None), ("emulated", False), ("emulated", 24)])
def test_l3_float_path_through_the_same_entries(backend, split):
    """L3's float32 caches through the entries that now take a format (0) and no scales: the same
    answers as L3's reference, NaN in unused slots still never read."""
    q, k, v, k_scales, v_scales, tables, lens = make_case(torch.int8, num_kv_heads=2, group=4, head_dim=64,
                                                          block_size=16)
    k_float, v_float = values64(k, k_scales).float(), values64(v, v_scales).float()
    kernel_args = {} if split is None else dict(split_k=bool(split), partition_size=split or 8)
    out = paged_attention(q, k_float, v_float, tables, lens, backend=backend, **kernel_args)
    assert out.isfinite().all()
    expected = paged_attention(q, k_float, v_float, tables, lens, backend="reference")
    torch.testing.assert_close(out, expected, **FP32_TOL)
    torch.testing.assert_close(out, paged_attention_quantized(q, k, v, k_scales, v_scales, tables, lens,
                                                              backend=backend, **kernel_args), **FP32_TOL)
