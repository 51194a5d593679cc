"""Fewer, larger operations per layer: where a decode step of a few requests spends its time.

A decode step of one request does little arithmetic: the embedded model reads 17 MB of weights,
well under a millisecond at this machine's memory bandwidth. What it pays for is dispatch: every
torch operation costs microseconds of Python and framework work whatever its size (about 3 to 30
us each on the course's 2-core machine), and L1's layer, written to be read, runs about seventy
of them. The engine's model keeps L1's arithmetic and runs some of it as fewer operations:

    L1 (per layer)                               engine (per layer)
    q_proj, k_proj, v_proj: 3 products      ->   qkv_proj: 1 product, the weights stacked by rows
    q_norm, k_norm, rotary on q, on k       ->   1 norm over q's and k's heads together (each
                                                 head its own weight), 1 rotary for both
    gate_proj, up_proj: 2 products          ->   gate_up_proj: 1 product
    silu(gate) * up: 3 operations           ->   1 C++ call for a few rows on a CPU in float32
    RMSNorm: 8 operations (the formula)     ->   1 call: C++ on a CPU in float32 (engine_ops.py),
                                                 else torch's F.rms_norm (also the final norm)
    q/k norm and rotary: ~12 operations     ->   1 C++ call on a CPU in float32 (engine_ops.py)

A stacked product's rows are the separate products' rows, and the norm is L1's formula, so the
logits move by float rounding at most, far inside every HF comparison's tolerance. Measured on
the embedded model (2 threads, best of alternating runs, 2026-11-28): a decode step of 1 request
5.70 -> 5.21 ms, of 4 requests 6.49 -> 6.18 ms, of 32 requests 16.3 -> 14.9 ms. The stacked weights
replace the separate ones (nothing is stored twice); the state dict's names change with them,
which is why only the engine's loader fuses, after loading. The later cuts (the C++ calls, and
the rest of the step's overhead) are measured change by change in scripts/bench_overhead.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from l1_contiguous import apply_rotary
from l1_contiguous.model import Qwen3MLP, RMSNorm

from .engine_ops import fused_qk_applies, host_op_applies, qk_norm_rope, rms_norm, silu_mul, silu_mul_applies


def stacked_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One bias-free nn.Linear computing all of `linears` at once: [..., in] -> [..., sum of outs]."""
    weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum of outs, in]
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    return stacked


class FusedRMSNorm(nn.Module):
    """L1's RMSNorm (float32 math, cast back before the weight) as one call instead of eight
    operations: the engine's C++ one on a CPU in float32 (engine_ops.py), else torch's F.rms_norm."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if host_op_applies(x) and self.weight.dtype == torch.float32:
            return rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # no cast to make: the weight goes inside the one operation
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight


class FusedMLP(nn.Module):
    """SwiGLU with the gate and up projections as one product."""

    def __init__(self, mlp: Qwen3MLP):
        super().__init__()
        self.gate_up_proj = stacked_linear([mlp.gate_proj, mlp.up_proj])  # [..., 2 * intermediate]
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [..., 2 * intermediate]
        if gate_up.dim() == 2 and silu_mul_applies(gate_up):  # a few rows on a CPU in float32: one C++ call
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fused_project_qkv(attn, x, cos, sin):
    """L1's `project_qkv` for an attention `fuse_model` has fused: x [T, hidden] -> q [T, H, D],
    k [T, H_kv, D], v [T, H_kv, D], q and k normed and rotated."""
    t, h, h_kv, d = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.qkv_proj(x)  # [T, (H + 2 H_kv) D]: q's heads, then k's, then v's
    if fused_qk_applies(qkv, cos):  # a CPU in float32: the norm and the rotary in one C++ call
        qk = qk_norm_rope(qkv, h + h_kv, d, attn.qk_norm_weight, attn.q_norm.eps, cos, sin)
    else:
        qk = qkv[:, :(h + h_kv) * d].view(t, h + h_kv, d)
        qk = F.rms_norm(qk.float(), (d,), None, attn.q_norm.eps).to(x.dtype) * attn.qk_norm_weight
        qk = apply_rotary(qk, cos, sin)  # per head and position: q's and k's heads alike
    return qk[:, :h], qk[:, h:], qkv[:, (h + h_kv) * d:].view(t, h_kv, d)


def fuse_model(model):
    """Stack each layer's q/k/v and gate/up weights (q and k are then normed and rotated together,
    `fused_project_qkv`) and run every RMSNorm as one call (FusedRMSNorm). In place; returns the model. Run once,
    after the weights are loaded (the stacked weights replace them). The attention must be L5's
    (its `project_qkv` takes the fused path once `fused` is set)."""
    for module in [*model.model.layers, model.model]:
        for name, child in list(module.named_children()):
            if type(child) is RMSNorm:
                setattr(module, name, FusedRMSNorm(child))
    for layer in model.model.layers:
        attn = layer.self_attn
        if not attn.fused:
            attn.qkv_proj = stacked_linear([attn.q_proj, attn.k_proj, attn.v_proj])
            del attn.q_proj, attn.k_proj, attn.v_proj
            # [H + H_kv, D]: q_norm's weight for every query head, then k_norm's for every key head
            attn.register_buffer("qk_norm_weight", torch.cat([
                attn.q_norm.weight.detach().expand(attn.num_heads, -1),
                attn.k_norm.weight.detach().expand(attn.num_kv_heads, -1)]), persistent=False)
            attn.fused = True
        if isinstance(layer.mlp, Qwen3MLP):
            layer.mlp = FusedMLP(layer.mlp)
    return model
