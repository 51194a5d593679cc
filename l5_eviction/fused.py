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
    residual add, then the next RMSNorm     ->   1 call (FusedDecoderLayer carries the residual
                                                 stream from layer to layer, as vLLM's layers do)
    the pool's K/V write (2 copies)         ->   inside the q/k call, where the pool's set_kv is
                                                 L2's plain write (writes_in_projection)
    cos/sin of the step's positions         ->   2 lookups in a table made once (RotaryTable)

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

from l1_contiguous import RotaryEmbedding, apply_rotary
from l1_contiguous.model import Qwen3DecoderLayer, Qwen3MLP, Qwen3Model, RMSNorm
from l2_paged import KvPool
from l4_paged_prefill import PagedPrefillAttention, PagedStepMeta

from .engine_ops import (add_rms_norm, add_rms_norm_applies, fused_qk_applies, host_op_applies, qk_norm_rope,
                         qk_norm_rope_write, rms_norm, silu_mul, silu_mul_applies)


def stacked_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One bias-free nn.Linear computing all of `linears` at once: [..., in] -> [..., sum of outs]."""
    weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum of outs, in]
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    return stacked


class FusedRMSNorm(nn.Module):
    """L1's RMSNorm (float32 math, cast back before the weight) as one call instead of eight
    operations: the engine's C++ one on a CPU in float32 (engine_ops.py), else torch's F.rms_norm.
    Given the residual stream too, it first adds x to it: -> (normed, the new residual), the add
    and the norm in one C++ call where it applies (the residual is then updated in place)."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.norm(x)
        if self.weight.dtype == torch.float32 and add_rms_norm_applies(x, residual):
            return add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self.norm(residual), residual

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32 and host_op_applies(x):
            return rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # no cast to make: the weight goes inside the one operation
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight


class FusedDecoderLayer(nn.Module):
    """L1's decoder layer, its residual adds moved into the norms that follow them (vLLM's shape).

    L1:      x = x + attn(norm1(x));  x = x + mlp(norm2(x))            4 calls besides attn and mlp
    fused:   h, residual = norm1(x, residual)    # residual += x (the previous layer's MLP output)
             h, residual = norm2(attn(h), residual)
             return mlp(h), residual             # the add waits for the next layer's norm1
    The first layer gets residual None (x is the embedding); the model's final norm does the last add.
    """

    def __init__(self, layer: Qwen3DecoderLayer):
        super().__init__()
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp

    def forward(self, x, residual, cos, sin, kv, meta):
        """x [T, hidden]; residual [T, hidden] or None -> (the MLP's output, the residual stream)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv, meta), residual)
        return self.mlp(h), residual


class FusedQwen3Model(nn.Module):
    """L1's Qwen3Model (the same submodules) running FusedDecoderLayers, the residual carried."""

    def __init__(self, model: Qwen3Model):
        super().__init__()
        self.embed_tokens, self.norm = model.embed_tokens, model.norm
        self.layers = nn.ModuleList(FusedDecoderLayer(layer) for layer in model.layers)

    def forward(self, input_ids, cos, sin, kv, meta) -> torch.Tensor:
        """input_ids [T] -> hidden states [T, hidden] after the final norm, as L1's."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, kv, meta)
        return self.norm(x, residual)[0]


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


class RotaryTable:
    """L1's RotaryEmbedding with its cos/sin rows computed once per position, not once per step.

    L1's `cos_sin` runs seven operations per step for a handful of rows; a table row is the same
    computation done ahead (both use RotaryEmbedding.cos_sin), so a step indexes two tables. The
    table grows (doubling) to cover a position it has not reached, so its size follows the
    longest sequence served, up to MAX_POSITIONS (past it, L1's computation). On a CPU only: an
    index out of range must raise to grow the table, and on CUDA it would stop the device; there
    the rotary is L1's.
    """

    INITIAL_POSITIONS = 1024
    MAX_POSITIONS = 32768  # two tables of 16 MB each for Qwen3's head_dim 128 in float32

    def __init__(self, rotary: RotaryEmbedding):
        self.rotary = rotary
        self.cos = self.sin = None  # [positions, head_dim], built on first use in the model's dtype

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, D], as L1's."""
        if not positions.is_cpu:
            return self.rotary.cos_sin(positions, dtype)
        if self.cos is None or self.cos.dtype != dtype:
            self.grow(self.INITIAL_POSITIONS, dtype)
        try:
            return self.cos[positions], self.sin[positions]
        except IndexError:  # a position past the table
            needed = int(positions.max()) + 1
            if needed > self.MAX_POSITIONS:
                return self.rotary.cos_sin(positions, dtype)
            self.grow(needed, dtype)
            return self.cos[positions], self.sin[positions]

    def grow(self, positions: int, dtype: torch.dtype) -> None:
        size = max(self.INITIAL_POSITIONS, 1 << (positions - 1).bit_length())
        self.cos, self.sin = self.rotary.cos_sin(torch.arange(size), dtype)


def writes_in_projection(attn, x: torch.Tensor, cos: torch.Tensor, pool, meta) -> bool:
    """Whether `fused_project_qkv_write` may do this layer's q/k/v work and its cache write: the
    attention's cache step is L4's own (the pool's set_kv, then its block views: a lesson that
    changes the step keeps it), the pool's set_kv is L2's plain write into K and V (not a
    quantizing one), and the C++ call serves the tensors (a CPU, float32, int64 slots)."""
    return (type(attn).kv_step is PagedPrefillAttention.kv_step and type(pool).set_kv is KvPool.set_kv
            and isinstance(meta, PagedStepMeta) and x.dim() == 2 and fused_qk_applies(x, cos)
            and pool.K[attn.layer_idx].dtype == torch.float32 and pool.K[attn.layer_idx].is_cpu
            and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous())


def fused_project_qkv_write(attn, x, cos, sin, pool, meta) -> torch.Tensor:
    """`fused_project_qkv` then the cache step's write (pool.set_kv), as one product and one C++
    call (where `writes_in_projection`): x [T, hidden] -> q [T, H, D], normed and rotated; the rows'
    k and v are in the pool."""
    layer = attn.layer_idx
    return qk_norm_rope_write(attn.qkv_proj(x), attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qk_norm_weight,
                              attn.q_norm.eps, cos, sin, pool.K[layer], pool.V[layer], meta.slot_mapping)


def fuse_model(model):
    """Stack each layer's q/k/v and gate/up weights (q and k are then normed and rotated together,
    `fused_project_qkv`), run every RMSNorm as one call (FusedRMSNorm), each residual add inside
    the norm after it (FusedQwen3Model). In place; returns the model. Run once, after the weights
    are loaded (the stacked weights replace them). The attention must be L5's (its `project_qkv`
    takes the fused path once `fused` is set)."""
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
    if type(model.model) is Qwen3Model:
        model.model = FusedQwen3Model(model.model)
    if type(model.rotary) is RotaryEmbedding:
        model.rotary = RotaryTable(model.rotary)
    return model
