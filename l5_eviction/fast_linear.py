"""The engine's matrix products on a CPU: where a decode step's time goes, and how it gets near its floor.

    y [rows, out] = x [rows, in] @ W.T        W: [out, in], e.g. the head: 151,936 x 1,024 for Qwen3-0.6B

A decode step has a few rows (one per request), so each product reads all of W to do only
2 x rows multiply-adds per weight: it should take the time of one read of W. `F.linear` hands
this skinny shape to MKL's sgemm, which on the course's AMD CPU took 3 to 11 times that. oneDNN's
kernel does better when W is first reordered ("packed") into the blocked layout its micro-kernel
reads for blocks of 4 rows: at 2 to 32 rows the head took 0.6-0.8x the time of oneDNN on the
plain layout and a fifth to a quarter of MKL's, and the layer products gain too
(docs/benchmarks.md, "The floor of a step"). The packed kernel has one weak spot, 1 to 3 rows:
two or three are padded with zero rows to four, and one row, a batch-1 decode's, takes MKL's
product on the weight stored transposed ([in, out], as TransposedLinear below) where the matrix
fits the last-level cache (ONE_ROW_COPY_MAX_WEIGHTS; in a decode step of the embedded model the
head took ~0.1 ms less than F.linear on the dense weight, itself 0.2-0.3 ms less than oneDNN's
plain layout), else F.linear on the dense weight (Qwen3-0.6B's 622 MB head streams from memory:
the layout changed it by 8%, not worth a third copy).

Only large matrices are packed (MIN_PACKED_WEIGHTS). The smaller ones of a layer keep their weight
transposed instead, [in, out] contiguous (TransposedLinear): MKL computes x @ W.T from that layout
faster than F.linear does from W's [out, in] (on the embedded model's matrices: 0.75x at one row,
0.45-0.8x at 32; measured with scripts/bench_overhead.py). The logits are the same sums in another
order (differences ~1e-6, inside the tolerance every HF comparison uses). Engine-only, on a CPU
in float32 where oneDNN is built in and the product checks out on a probe; elsewhere (CUDA,
bf16, a torch without these ops) the model keeps its `nn.Linear`s. Packing costs one more copy
of each packed matrix, two for one that fits the cache (the dense weight stays: the model's
parameter, tied to the embedding for the head, and the one-row path of a large matrix).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = 4  # the row block the packed layout is chosen for; fewer rows are padded up to it
# Smaller matrices stay on nn.Linear: oneDNN builds a kernel for each new row count it meets (about
# a millisecond), which a server's ever-changing steps keep paying, and a small product has little
# to gain. 2**20 weights (4 MB): every matrix of Qwen3-0.6B; of the embedded model's, the head alone.
MIN_PACKED_WEIGHTS = 1 << 20
# A matrix up to 2**22 weights (16 MB in float32) stays in the course machine's 36 MB last-level
# cache from step to step: its one-row product is bound by the kernel, and MKL's is faster on [in, out].
ONE_ROW_COPY_MAX_WEIGHTS = 1 << 22


def onednn_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ weight.T by oneDNN; `weight` dense or packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] reordered once into oneDNN's blocked layout for PACKED_ROWS-row products."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)


class PackedLinear(nn.Module):
    """An `nn.Linear` without bias computed by oneDNN; `.weight` stays the model's dense parameter."""

    def __init__(self, dense: nn.Linear):
        super().__init__()
        self.weight = dense.weight  # its dtype, device, and tie to the embedding are the model's
        self.packed = pack(dense.weight)
        small = dense.weight.numel() <= ONE_ROW_COPY_MAX_WEIGHTS
        self.weight_t = dense.weight.detach().t().contiguous() if small else None  # [in, out], for one row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if x.dim() == 2 and x.shape[0] == 1:  # a batch-1 decode's row: nothing to reshape
            return self.one_row(x)
        lead, rows = x.shape[:-1], math.prod(x.shape[:-1])
        x = x.reshape(rows, x.shape[-1]).contiguous()
        if rows == 1:
            y = self.one_row(x)
        elif rows < PACKED_ROWS:
            y = onednn_product(F.pad(x, (0, 0, 0, PACKED_ROWS - rows)), self.packed)[:rows]
        else:
            y = onednn_product(x, self.packed)
        return y.reshape(*lead, y.shape[-1])

    def one_row(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, in] -> [1, out]: on the transposed copy where there is one, else the dense weight."""
        return F.linear(x, self.weight) if self.weight_t is None else torch.mm(x, self.weight_t)


class TransposedLinear(nn.Module):
    """An `nn.Linear` without bias whose weight is stored as W.T, contiguous: [in, out].
    `.weight` is still W ([out, in], a view), as nn.Linear's."""

    def __init__(self, dense: nn.Linear):
        super().__init__()
        self.weight_t = nn.Parameter(dense.weight.detach().t().contiguous(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if x.dim() == 2:  # a step's rows, the common case: no reshape in, no view out
            return torch.mm(x, self.weight_t)
        y = torch.mm(x.reshape(-1, x.shape[-1]), self.weight_t)
        return y.view(*x.shape[:-1], y.shape[-1])


@functools.cache
def packing_works() -> bool:
    """oneDNN is built in and its packed product equals `F.linear` on a probe (run once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.randn(64, 32), torch.randn(PACKED_ROWS, 32)
        with torch.inference_mode():
            return torch.allclose(onednn_product(x, pack(weight)), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    except (RuntimeError, AttributeError, NotImplementedError):  # a torch built without these ops
        return False


def on_cpu_in_fp32(linear: nn.Linear) -> bool:
    w = linear.weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and linear.bias is None


def can_pack(linear: nn.Linear) -> bool:
    return on_cpu_in_fp32(linear) and linear.weight.numel() >= MIN_PACKED_WEIGHTS and packing_works()


def use_packed_linears(model):
    """Swap each `nn.Linear` of the model for a PackedLinear where it applies (the layers' and the
    head), and each smaller one of a layer for a TransposedLinear (on a CPU in float32)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and can_pack(child):
                setattr(module, name, PackedLinear(child))
    for layer in model.model.layers:  # never the head: its weight may be the embedding's
        for module in list(layer.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and on_cpu_in_fp32(child):
                    setattr(module, name, TransposedLinear(child))
    return model
