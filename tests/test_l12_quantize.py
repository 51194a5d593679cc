"""L12's number rules, each against an independent computation: quantize against a table of all
256 e4m3 values (nearest, ties to even) and Python's own round-half-even, dequantize against
code * scale per head, the scales against hand-made amax tables, the cache tag against one-ulp
changes and a second process, the calibration pool against the K and V the model really wrote."""

from __future__ import annotations

import math

import pytest
import torch

from l1_contiguous import InputError
from l12_quantized_kv import FP8_E4M3, INT8, INT8_NAN_CODE, KvScales, cache_tag, dequantize, quantize, scales_from_amax
from probes_l12 import tag_in_another_process

pytestmark = [pytest.mark.l12]


def e4m3_values() -> list[float]:
    """The value of every finite e4m3fn code, decoded bit by bit (sign, 4-bit exponent of bias 7,
    3-bit mantissa; exponent 0 is subnormal; s 1111 111 is NaN): index = the code's byte."""
    values = []
    for byte in range(256):
        sign, exponent, mantissa = -1.0 if byte & 0x80 else 1.0, (byte >> 3) & 0xF, byte & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values.append(math.nan)
        elif exponent == 0:
            values.append(sign * mantissa / 8 * 2.0 ** -6)
        else:
            values.append(sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


E4M3 = e4m3_values()
FINITE = sorted({v for v in E4M3 if not math.isnan(v)})


def nearest_e4m3(y: float) -> float:
    """Round y (already divided by its scale) to e4m3 as the rule says: saturate, nearest, ties to
    the even mantissa."""
    if math.isnan(y):
        return math.nan
    y = max(-448.0, min(448.0, y))
    best = min(FINITE, key=lambda v: abs(v - y))
    ties = [v for v in FINITE if abs(v - y) == abs(best - y)]
    if len(ties) > 1:  # the even code: mantissa bit 0 clear
        best = next(v for v in ties if E4M3.index(v) % 2 == 0)  # neighbours are neighbouring codes
    return best


def scaled(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x / scale per KV head, in float32 (the rule's division)."""
    return x.float() / scales.view(1, -1, 1)


def awkward_values(heads: int, seed: int) -> torch.Tensor:
    """[T = heads, heads, 8]: as many tokens as heads (a scale broadcast over tokens instead of heads
    would still run), magnitudes from subnormal to saturating, and exact halfway points."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, heads, 8, generator=g) * torch.logspace(-4, 3, heads * heads * 8).view(heads, heads, 8)
    x = x[:, :, torch.randperm(8, generator=g)]
    return x


@pytest.mark.points(3)
def test_quantize_fp8_is_nearest_e4m3_of_x_over_its_heads_scale():
    scales = torch.tensor([0.5, 2.0, 0.03125, 7.0])
    x = awkward_values(4, seed=1)
    # Exact ties between neighbouring e4m3 values (after the division), saturation and infinities.
    x[0, 0, :4] = torch.tensor([0.5 * (1.0 + 1.125) / 2, 0.5 * (1.125 + 1.25) / 2, 0.5 * 500.0, -0.5 * 1e9])
    x[1, 1, :3] = torch.tensor([float("inf"), float("-inf"), 2.0 * 2.0 ** -10])  # below the smallest subnormal
    codes = quantize(x, scales, FP8_E4M3)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    want = [nearest_e4m3(y) for y in scaled(x, scales).flatten().tolist()]
    got = codes.float().flatten().tolist()
    wrong = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not wrong, f"{len(wrong)} codes differ from nearest-even e4m3 of x / scale[head]; first (index, got, want): {wrong[:3]}"


@pytest.mark.points(1)
def test_quantize_fp8_keeps_nan():
    x = torch.zeros(2, 2, 4)
    x[1, 0, 3] = float("nan")
    codes = quantize(x, torch.tensor([1.0, 3.0]), FP8_E4M3).float()
    assert torch.isnan(codes[1, 0, 3]) and int(torch.isnan(codes).sum()) == 1


@pytest.mark.points(4)
def test_quantize_int8_rounds_half_to_even_saturates_and_marks_nan():
    scales = torch.tensor([0.25, 4.0, 0.01])
    x = awkward_values(3, seed=2)
    x[0, 0, :6] = torch.tensor([0.25 * 2.5, 0.25 * 3.5, -0.25 * 0.5, 0.25 * 127.5, 0.25 * 1000, float("-inf")])
    x[2, 2, 0] = float("nan")
    codes = quantize(x, scales, INT8)
    assert codes.dtype == torch.int8
    want = []
    for y in scaled(x, scales).flatten().tolist():
        want.append(INT8_NAN_CODE if math.isnan(y) else round(max(-127.0, min(127.0, y))))  # round(): half to even
    got = codes.flatten().tolist()
    wrong = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not wrong, f"{len(wrong)} codes differ from the rule; first (index, got, want): {wrong[:3]}"


@pytest.mark.points(3)
def test_dequantize_is_code_times_its_heads_scale_and_minus_128_is_nan():
    scales = torch.tensor([0.5, 3.0, 1e-3])
    codes = torch.arange(-128, 127, dtype=torch.int8)[:3 * 3 * 8].view(3, 3, 8)  # T = H: heads must not be tokens
    values = dequantize(codes, scales)
    assert values.dtype == torch.float32
    for t in range(3):
        for h in range(3):
            for d in range(8):
                c = int(codes[t, h, d])
                want = math.nan if c == INT8_NAN_CODE else float(torch.tensor(float(c)) * scales[h])
                got = float(values[t, h, d])
                assert (math.isnan(want) and math.isnan(got)) or got == want, (t, h, d, c, got, want)
    fp8 = torch.tensor(FINITE[:24]).view(2, 3, 4).to(torch.float8_e4m3fn)
    half = dequantize(fp8, scales, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, (fp8.float() * scales.view(-1, 1)).to(torch.bfloat16))


@pytest.mark.points(2)
def test_scales_per_head_and_per_tensor_map_amax_onto_the_format():
    amax = torch.tensor([[1.0, 4.0, 2.0], [8.0, 0.0, 0.25]])
    head = scales_from_amax(amax, "head", FP8_E4M3)
    assert torch.equal(head, torch.tensor([[1.0 / 448, 4.0 / 448, 2.0 / 448], [8.0 / 448, 1.0, 0.25 / 448]]))
    tensor = scales_from_amax(amax, "tensor", INT8)
    assert torch.equal(tensor, torch.tensor([[4.0] * 3, [8.0] * 3]) / 127), "per tensor is per layer: each layer's own max"
    assert torch.equal(scales_from_amax(amax, "one", INT8), torch.ones(2, 3))


@pytest.mark.points(1)
def test_a_head_that_wrote_only_zeros_gets_scale_one():
    amax = torch.tensor([[0.0, 2.0], [0.0, 0.0]])
    assert torch.equal(scales_from_amax(amax, "head", INT8), torch.tensor([[1.0, 2 / 127], [1.0, 1.0]]))
    assert torch.equal(scales_from_amax(amax, "tensor", FP8_E4M3), torch.tensor([[2 / 448] * 2, [1.0, 1.0]]))


@pytest.mark.points(1)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_broken_calibration_is_refused(bad):
    amax = torch.tensor([[1.0, 2.0], [3.0, bad]])
    for granularity in ("head", "tensor"):
        with pytest.raises(InputError, match="calibration"):
            scales_from_amax(amax, granularity, FP8_E4M3)
    with pytest.raises(InputError, match="granularity"):
        scales_from_amax(torch.ones(2, 2), "channel", FP8_E4M3)


def _scales(seed: int, layers: int = 3, heads: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return ([torch.rand(heads, generator=g) + 0.01 for _ in range(layers)],
            [torch.rand(heads, generator=g) + 0.01 for _ in range(layers)])


def _one_ulp_up(t: torch.Tensor, i: int) -> torch.Tensor:
    out = t.clone()
    out[i] = torch.nextafter(t[i], torch.tensor(float("inf")))
    return out


@pytest.mark.points(3)
def test_the_cache_tag_changes_with_any_one_scale_by_one_ulp_and_with_the_format():
    k, v = _scales(0)
    tag = cache_tag(FP8_E4M3, k, v)
    assert isinstance(tag, bytes) and len(tag) >= 8
    assert cache_tag(FP8_E4M3, [s.clone() for s in k], [s.clone() for s in v]) == tag, "equal scales, equal tag"
    changed = set()
    for which in ("k", "v"):
        for layer in range(3):
            for head in range(2):
                k2, v2 = [s.clone() for s in k], [s.clone() for s in v]
                target = k2 if which == "k" else v2
                target[layer] = _one_ulp_up(target[layer], head)
                changed.add(cache_tag(FP8_E4M3, k2, v2))
    assert tag not in changed and len(changed) == 12, "some one-ulp change of a scale left the tag as it was"
    assert cache_tag(INT8, k, v) != tag, "the format is part of the tag"
    assert cache_tag(FP8_E4M3, v, k) != tag, "K's scales and V's scales are not interchangeable"


@pytest.mark.points(1)
def test_the_cache_tag_is_the_same_in_another_process():
    k, v = _scales(3)
    # `import harness` first: judged (KVCOURSE_JUDGE), that process is a judge too, and the tag
    # comes from the student's code in its own worker.
    # The other process runs where the student's code runs (under the judge: started by the worker).
    out = tag_in_another_process(seed=3, hash_seed="12345")
    assert out["status"] == 0, out["stderr"][-500:]
    assert out["stdout"] == cache_tag(FP8_E4M3, k, v).hex()


def test_kv_scales_tag_is_the_cache_tag():
    k, v = _scales(1)
    assert KvScales(INT8, k, v).tag() == cache_tag(INT8, k, v)
