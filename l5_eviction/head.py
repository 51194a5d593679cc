"""The engine's output head: the one product where a CPU step's time goes at a large vocabulary.

    logits [rows, vocab] = x [rows, hidden] @ W.T       W: [vocab, hidden], 151,936 x 1,024 for Qwen3-0.6B

A decode step has a few rows (one per request), so the head reads 622 MB of fp32 weights to do
2 x rows x 155 M multiply-adds: it should take the time of one read of W (about 20 ms at
30 GB/s). `F.linear` hands this skinny shape to MKL's sgemm, which on the course's AMD CPU took
2-3x that time per call (docs/benchmarks.md, "The floor of a step"); oneDNN's inner-product
kernel, given the same weights once converted to its tensor format, took half of MKL's time at
6 and 32 rows. The logits are the same sums in another order (differences ~1e-6, inside the
tolerance every HF comparison uses).

Engine-only, on a CPU in float32, where oneDNN is built in: elsewhere (CUDA, bf16) the model keeps
its `nn.Linear`. The converted copy costs one more head's worth of memory (622 MB at the 0.6B
shape, 4 MB for the embedded model), since the dense weight stays for the embedding it may be
tied to.
"""

from __future__ import annotations

import torch
from torch import nn


class OneDnnHead(nn.Module):
    """`lm_head` computed by oneDNN from its own copy of the weight; `.weight` stays the dense one."""

    def __init__(self, dense: nn.Linear):
        super().__init__()
        self.weight = dense.weight  # the model's parameter: its dtype, device, tie to the embedding
        self.onednn_weight = dense.weight.detach().to_mkldnn()  # [vocab, hidden], converted once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] -> logits [rows, vocab] (dense)."""
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.onednn_weight, None).to_dense()


def can_use_onednn_head(model) -> bool:
    w = model.lm_head.weight
    return (w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and model.lm_head.bias is None)


def use_fast_head(model):
    """Swap the model's `lm_head` for the oneDNN one where it applies (see the module docstring)."""
    if can_use_onednn_head(model):
        model.lm_head = OneDnnHead(model.lm_head)
    return model
