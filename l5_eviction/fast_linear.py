"""The engine's matrix products on a CPU: where a decode step's time goes, and how it gets near its floor.

    y [rows, out] = x [rows, in] @ W.T        W: [out, in], e.g. the head: 151,936 x 1,024 for Qwen3-0.6B

A decode step has a few rows (one per request), so each product reads all of W to do only
2 x rows multiply-adds per weight: it should take the time of one read of W. Two things keep it
from that. `F.linear` hands this skinny shape to MKL's sgemm, which on the course's AMD CPU took 3
to 11 times that on a large matrix; oneDNN's kernel does better when W is first reordered
("packed") into the blocked layout its micro-kernel reads for blocks of 4 rows: at 2 to 32 rows the
head took 0.6-0.8x the time of oneDNN on the plain layout and a fifth to a quarter of MKL's, and the
layer products gain too (docs/benchmarks.md, "The floor of a step"). And MKL runs a product of a
few rows on one thread (waking others costs more than the arithmetic), while reading W is the whole
cost, and one core reads the cache at a fraction of what all of them do. So the layers' matrices
that are not packed keep W.T cut into column blocks, one per thread where each is big enough to be
worth one (thread_parts; [parts, in, out / parts], split_columns): one `torch.bmm` over the blocks
runs them on parallel threads, each reading its share of W (SplitLinear; on the embedded model,
2 threads, 2026-11-29, a decode step of 1 request 0.61 -> 0.53 ms, of 4 requests 1.22 -> 0.85 ms,
of 32 requests 3.40 -> 2.92 ms; on one thread nothing is split: there the blocks would only add
work).

The packed kernel has one weak spot, 1 to 3 rows: they are padded with zero rows to four. One row,
a batch-1 decode's, takes the split product instead on a copy of W.T in column blocks where the
matrix fits the last-level cache (ONE_ROW_COPY_MAX_WEIGHTS; the embedded model's head); a larger
one streams from memory, where the padded rows cost nothing (Qwen3-0.6B's 622 MB head: 13 ms
padded and packed against 29 ms for `F.linear` on the dense weight, 2 threads, 2026-11-29).

Only large matrices are packed (MIN_PACKED_WEIGHTS); the smaller ones of a layer are SplitLinears.
The logits are the same sums in another order (differences ~1e-6, inside the tolerance every HF
comparison uses). Engine-only, on a CPU in float32 where oneDNN is built in and the product checks
out on a probe; elsewhere (CUDA, bf16, a torch without these ops) the model keeps its `nn.Linear`s.
Packing costs one more copy of each packed matrix, two for one that fits the cache (the dense
weight stays: the model's parameter, tied to the embedding for the head). Each change is measured
before and after in scripts/bench_overhead.py ("layout", "split", "head row").
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = 4  # the row block the packed layout is chosen for; fewer rows are padded up to it
# Smaller matrices are not packed (a layer's are SplitLinears, a small head stays nn.Linear): oneDNN
# builds a kernel for each new row count it meets (about a millisecond), which a server's
# ever-changing steps keep paying, and a small product has little to gain. 2**20 weights (4 MB):
# every matrix of Qwen3-0.6B; of the embedded model's, the head alone.
MIN_PACKED_WEIGHTS = 1 << 20
# A matrix up to 2**22 weights (16 MB in float32) stays in the course machine's 32-36 MB last-level
# cache from step to step: its one-row product is bound by reading the cache, which the split product
# does on every thread.
ONE_ROW_COPY_MAX_WEIGHTS = 1 << 22
# A block smaller than this is not worth waking a thread for: 2**15 weights, 128 KB in float32, a
# few microseconds of reading. On 2 threads every matrix of the embedded model splits in two; its
# smallest ones (256 x 256, 512 x 256) then lose 1-2 us at one row, cache-warm, and gain 2-11 us at
# four rows: a wash. On more threads a small matrix is cut into fewer blocks than there are threads.
MIN_BLOCK_WEIGHTS = 1 << 15


def onednn_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ weight.T by oneDNN; `weight` dense or packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] reordered once into oneDNN's blocked layout for PACKED_ROWS-row products."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)


def thread_parts(weight: torch.Tensor) -> int:
    """How many column blocks to cut W [out, in] into: one per torch thread, as many as divide `out`
    evenly into blocks of at least MIN_BLOCK_WEIGHTS weights (1: no split)."""
    out_features, in_features = weight.shape
    return max((p for p in range(1, torch.get_num_threads() + 1)
                if out_features % p == 0 and out_features // p * in_features >= MIN_BLOCK_WEIGHTS), default=1)


def split_columns(weight: torch.Tensor, parts: int) -> torch.Tensor:
    """W [out, in] -> W.T's columns in `parts` equal blocks, each contiguous: [parts, in, out / parts]."""
    out_features, in_features = weight.shape
    return weight.detach().t().reshape(in_features, parts, out_features // parts).transpose(0, 1).contiguous()


def split_product(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [rows, in] -> x @ W.T [rows, out], where blocks = split_columns(W, parts): one bmm, whose
    blocks torch runs on parallel threads."""
    parts, _, width = blocks.shape
    if parts == 1:
        return torch.mm(x, blocks[0])
    y = torch.bmm(x.expand(parts, *x.shape), blocks)  # [parts, rows, width]: block p's columns of every row
    return y.transpose(0, 1).reshape(x.shape[0], parts * width)  # a view for one row, a copy for more


class PackedLinear(nn.Module):
    """An `nn.Linear` without bias computed by oneDNN on its packed weight (one row: the split product
    on its copy, where it has one); `.weight` stays the model's dense parameter."""

    def __init__(self, dense: nn.Linear):
        super().__init__()
        self.weight = dense.weight  # its dtype, device, and tie to the embedding are the model's
        self.packed = pack(dense.weight)
        small = dense.weight.numel() <= ONE_ROW_COPY_MAX_WEIGHTS
        # [parts, in, out / parts], for one row; None: one row is padded to the packed block, as two or three
        self.row_blocks = split_columns(dense.weight, thread_parts(dense.weight)) if small else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if x.dim() == 2:  # a step's rows, the common case: nothing to reshape
            return self.product(x)
        y = self.product(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out]."""
        rows = x.shape[0]
        if rows == 1 and self.row_blocks is not None:
            return split_product(x, self.row_blocks)
        x = x.contiguous()
        if rows < PACKED_ROWS:  # padded with zero rows to the packed block
            return onednn_product(F.pad(x, (0, 0, 0, PACKED_ROWS - rows)), self.packed)[:rows]
        return onednn_product(x, self.packed)


class SplitLinear(nn.Module):
    """An `nn.Linear` without bias whose weight is stored as W.T in column blocks, up to one per
    thread (`thread_parts`, `split_columns`): its product is one bmm, the blocks read on parallel
    threads. `.weight` is still W [out, in] (a copy where there are several blocks; nothing in a
    step reads it)."""

    def __init__(self, dense: nn.Linear, parts: int | None = None):
        super().__init__()
        parts = thread_parts(dense.weight) if parts is None else parts
        self.blocks = nn.Parameter(split_columns(dense.weight, parts), requires_grad=False)  # [parts, in, out / parts]

    @property
    def weight(self) -> torch.Tensor:
        parts, in_features, width = self.blocks.shape
        return self.blocks.transpose(0, 1).reshape(in_features, parts * width).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if x.dim() == 2:  # a step's rows, the common case
            return split_product(x, self.blocks)
        y = split_product(x.reshape(-1, x.shape[-1]), self.blocks)
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
    head), and each smaller one of a layer for a SplitLinear (on a CPU in float32). The blocks are
    cut for the number of torch threads at the time: set it before loading the model."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and can_pack(child):
                setattr(module, name, PackedLinear(child))
    for layer in model.model.layers:  # never the head: its weight may be the embedding's
        for module in list(layer.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and on_cpu_in_fp32(child):
                    setattr(module, name, SplitLinear(child))
    return model
