"""The one rule by which every smoke script compares a lesson's greedy ids with HF's.

float32: the ids must be equal, always. Both sides compute the same arithmetic in the same order
closely enough that a flip needs a top-2 gap below ~1e-5, which the embedded model's default
prompts never come near.

bfloat16 / float16: two correct implementations round differently (another summation order, a
fused kernel, another attention path), so their logits differ by a few units of the format's
spacing at the logits' magnitude; where HF's top two logits are closer than that, the two may
pick different tokens and, from there on, continue different texts. Exact equality would call a
correct engine broken. The rule:

1. Ids equal: the request passes.
2. Else, at the first differing generated position g (ours picked a, HF picked b), it must be a
   near-tie, seen from both sides:
   - b is among our TOP_FEW highest logits and a among HF's;
   - HF's logit of b minus its logit of a, and ours of a minus ours of b, are both at most the
     tie bound: TIE_FACTOR (2) times the logit bound below.
3. And after it, nothing may hide: our engine is run again teacher-forced along HF's ids
   (`harness/forcing.py`: the same scheduler, pool and cache steps, each request fed HF's ids), and
   at every generated position every row our model computed must
   - be within the logit bound of HF's row, element by element: 4 * sqrt(layers) spacings of the
     dtype at the magnitude of that row's top logit (spacing(x) = 2 ** (floor(log2 |x|) - mantissa
     bits): 0.0625 for bfloat16 logits in [8, 16); 8 spacings for the embedded model's 4 layers), and
   - pick HF's id wherever HF's top-2 gap there exceeds the tie bound.

A bug shows as a large logit difference somewhere along the forced path (a RoPE position off by
one, a wrong KV head, a stale block: differences of whole logits, tens of spacings), so it fails
step 3 even where step 1's ids happened to diverge first at a genuine near-tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
TOP_FEW = 5
# Rounding differences add up layer by layer, roughly as independent errors do: with the square
# root of the depth. Per unit of sqrt(layers): the embedded model (4 layers) measures at most 2
# spacings teacher-forced, a random Qwen3-0.6B shape (28 layers) about 9 (docs/benchmarks.md,
# "bf16 cpu"); 4 per sqrt(layer) leaves a margin of 2-4x over both.
LOGIT_SPACINGS_PER_SQRT_LAYER = 4.0
# Two sides each within D of the other can order two logits differently only if they lie within
# 2·D: the tie bound is twice the logit bound.
TIE_FACTOR = 2.0


def spacing(dtype: torch.dtype, magnitude: float) -> float:
    """The gap between adjacent values of `dtype` near `magnitude` (its resolution there)."""
    exponent = math.floor(math.log2(max(abs(magnitude), 2.0 ** -14)))
    return 2.0 ** (exponent - MANTISSA_BITS[dtype])


def logit_spacings(num_layers: int) -> float:
    """The teacher-forced logit bound, in spacings, for a model of `num_layers` layers."""
    return LOGIT_SPACINGS_PER_SQRT_LAYER * math.sqrt(num_layers)


def logit_tolerance(dtype: torch.dtype, row: torch.Tensor, num_layers: int) -> float:
    return logit_spacings(num_layers) * spacing(dtype, float(row.abs().max()))


def tie_bound(dtype: torch.dtype, row: torch.Tensor, num_layers: int) -> float:
    return TIE_FACTOR * logit_tolerance(dtype, row, num_layers)


def exact_required(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


@dataclass
class Verdict:
    kind: str  # "equal", "near-tie" (diverged at a near-tie, forced path agrees) or "fail"
    reason: str = ""  # for near-tie and fail: where and why, one line
    first_mismatch: int | None = None
    gap: float | None = None  # HF's logit of its id minus its logit of ours, at the first mismatch
    bound: float | None = None
    forced_max_diff: float | None = None  # teacher-forced: max |ours - HF| over every row
    forced_max_spacings: float | None = None  # the same, in spacings of each row's dtype at its magnitude

    @property
    def ok(self) -> bool:
        return self.kind != "fail"


def first_mismatch(ours: list[int], theirs: list[int]) -> int | None:
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if i is None and len(ours) != len(theirs):
        i = min(len(ours), len(theirs))
    return i


def judge_tie(dtype, g: int, ours: list[int], hf_ids: list[int], hf_row: torch.Tensor,
              our_row: torch.Tensor, num_layers: int) -> tuple[bool, str, float, float]:
    """Is the divergence at g a near-tie from both sides? (ok, why not, HF's gap, bound)."""
    if g >= len(ours) or g >= len(hf_ids):
        side = "ours" if g >= len(ours) else "HF's"
        return False, f"{side} ended at new token {g} while the other went on (not a tie)", math.inf, 0.0
    a, b = ours[g], hf_ids[g]
    bound = max(tie_bound(dtype, hf_row, num_layers), tie_bound(dtype, our_row, num_layers))
    hf_gap = float(hf_row[b] - hf_row[a])
    our_gap = float(our_row[a] - our_row[b])
    if a not in hf_row.topk(TOP_FEW).indices.tolist():
        return False, f"our id {a} is not among HF's top {TOP_FEW}", hf_gap, bound
    if b not in our_row.topk(TOP_FEW).indices.tolist():
        return False, f"HF's id {b} is not among our top {TOP_FEW}", hf_gap, bound
    if hf_gap > bound or our_gap > bound:
        return False, f"gap {max(hf_gap, our_gap):.3g} > {bound:.3g} (not a near-tie)", hf_gap, bound
    return True, "", hf_gap, bound


def judge_forced(dtype, hf_ids: list[int], hf_logits: torch.Tensor, forced_rows: list[list[torch.Tensor]],
                 num_layers: int) -> tuple[bool, str, float, float]:
    """Every row our engine computed along HF's path against HF's row:
    (ok, the first failure, max |diff|, max |diff| in spacings), the maxima over every row."""
    worst = worst_spacings = 0.0
    failure = ""
    for g, rows in enumerate(forced_rows):
        if not rows:
            failure = failure or f"teacher-forced, new token {g} was never computed"
            continue
        hf_row = hf_logits[g]
        tol, bound = logit_tolerance(dtype, hf_row, num_layers), tie_bound(dtype, hf_row, num_layers)
        top2 = hf_row.topk(2).values
        for row in rows:
            diff = float((row - hf_row).abs().max())
            worst = max(worst, diff)
            worst_spacings = max(worst_spacings, diff / spacing(dtype, float(hf_row.abs().max())))
            if diff > tol:
                failure = failure or f"teacher-forced, new token {g}: max |logit diff| {diff:.3g} > {tol:.3g}"
            elif float(top2[0] - top2[1]) > bound and int(row.argmax()) != hf_ids[g]:
                failure = failure or (f"teacher-forced, new token {g}: ours picks {int(row.argmax())}, HF "
                                      f"{hf_ids[g]} with a top-2 gap {float(top2[0] - top2[1]):.3g} > {bound:.3g}")
    return not failure, failure, worst, worst_spacings


def verdict(dtype, ours: list[int], hf_ids: list[int], hf_logits: torch.Tensor,
            forced_rows: list[list[torch.Tensor]] | None, num_layers: int) -> Verdict:
    """The rule of the module docstring. `forced_rows` (per generated index of HF's path, every row
    our engine computed there, teacher-forced) is needed when the ids differ in a low-precision
    dtype; given with equal ids (a smoke script's --teacher-forced always), they are checked too."""
    g = first_mismatch(ours, hf_ids)
    if g is None:
        if forced_rows is None or exact_required(dtype):
            return Verdict("equal")
        same, why, worst, spacings = judge_forced(dtype, hf_ids, hf_logits, forced_rows, num_layers)
        return Verdict("equal" if same else "fail", "" if same else f"ids equal, but {why}", None, None, None,
                       worst, spacings)
    if exact_required(dtype):
        return Verdict("fail", f"ids differ at new token {g} (float32 owes equal ids)", g)
    if forced_rows is None:
        raise ValueError("a low-precision mismatch needs the teacher-forced rows")
    our_row = forced_rows[g][0] if g < len(forced_rows) and forced_rows[g] else None
    if our_row is None:
        return Verdict("fail", f"teacher-forced, new token {g} was never computed", g)
    tie, why, gap, bound = judge_tie(dtype, g, ours, hf_ids, hf_logits[g] if g < len(hf_logits) else our_row,
                                     our_row, num_layers)
    if not tie:
        return Verdict("fail", f"diverges at new token {g}: {why}", g, gap, bound)
    same, why, worst, spacings = judge_forced(dtype, hf_ids, hf_logits, forced_rows, num_layers)
    if not same:
        return Verdict("fail", f"near-tie at new token {g}, but {why}", g, gap, bound, worst, spacings)
    return Verdict("near-tie", f"step {g}, gap {gap:.2g} <= {bound:.2g}", g, gap, bound, worst, spacings)
