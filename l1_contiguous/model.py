"""Qwen3 written by hand: one readable forward pass, with the KV cache passed in from outside.

The model works on a flat batch of new tokens, `input_ids: [T]`, with the per-step facts
(positions, masks, where K/V live) in a `meta` object built by the caller. It never owns a KV
cache: `Qwen3Attention.kv_step` is the one place that writes and reads K/V, and each later lesson
subclasses the attention to override that step (and L3 also `attend`), then builds the same model
with `attention_cls=` its subclass.

    input_ids ─► embed ─► [norm ─► attention ─► +res ─► norm ─► MLP ─► +res] × L ─► norm ─► lm_head
                                   │
               q,k,v = project(x); q,k = q_norm,k_norm (per head); rope(q, k, positions)
               K, V  = kv_step(k, v, kv, meta)          ◄── the cache step
               out   = attend(q, K, V, meta) ─► o_proj
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen3Config, load_config
from .errors import ModelLoadError
from .weights import load_weights


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as HF does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
        # END SOLUTION


class RotaryEmbedding:
    """Rotate-half (NeoX-style) RoPE: cos/sin tables for given positions."""

    def __init__(self, head_dim: int, theta: float, device: str | torch.device = "cpu"):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)  # [D/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, D], computed in fp32 then cast (as HF does)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]: both halves share a frequency
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] -> x rotated. Pairs are (i, i + D/2), not adjacent dims."""
    # BEGIN SOLUTION
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
    # END SOLUTION


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention over a flat batch.

    q [T, H, D]; k, v [S, H_kv, D]; mask [T, S] bool, True where query t may read key s
    (None: every query reads every key). Query head h reads KV head h // (H / H_kv).
    Returns [T, H, D].
    """
    # BEGIN SOLUTION
    # Heads first, and a batch of one: [1, H, T, D], [1, H_kv, S, D]. On CPU only a 4-D call
    # reaches SDPA's fused kernel; a 3-D one takes the unfused math path, several times slower.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, enable_gqa=True)  # query head h reads KV head h // (H / H_kv)
    return out[0].transpose(0, 1)
    # END SOLUTION


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[T, S] bool: a query at position p reads a key at position s iff p - window < s <= p, the last
    `window` positions, its own included (how HF's Qwen3 masks a sliding layer)."""
    behind = q_pos[:, None] - k_pos[None, :]
    return (behind >= 0) & (behind < window)


class Qwen3Attention(nn.Module):
    # Whether this class applies a sliding layer's window. L1's does; a later lesson whose read
    # path would not is refused a hybrid model when it is built, instead of computing another model.
    reads_windows = True

    def __init__(self, cfg: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # which layer's K/V this attention writes and reads
        self.window = cfg.window_of(layer_idx)  # None: the layer reads every earlier position
        if self.window is not None and not self.reads_windows:
            raise ModelLoadError(
                f"layer {layer_idx} of this model attends through a sliding window of {self.window} positions, "
                f"which {type(self).__name__} does not apply; run hybrid models with L1 or L13 (l13_sliding_window)")
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # V has no norm

    def forward(self, x, cos, sin, kv, meta) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        k_all, v_all = self.kv_step(k, v, kv, meta)
        out = self.attend(q, k_all, v_all, meta)
        return self.o_proj(out.flatten(1))

    def project_qkv(self, x, cos, sin):
        """x [T, hidden] -> q [T, H, D], k [T, H_kv, D], v [T, H_kv, D], with q/k normed and rotated."""
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def kv_step(self, k, v, cache, meta):
        """The cache step. L1: write the new K/V at the cache's current end, read everything so far.

        k, v [T, H_kv, D] -> K, V [cache.length + T, H_kv, D] (views, no copy).
        The cache's length is advanced by the caller after the whole forward, once for all layers.
        """
        # BEGIN SOLUTION
        start, end = cache.length, cache.length + k.shape[0]
        cache.k[self.layer_idx][start:end] = k
        cache.v[self.layer_idx][start:end] = v
        return cache.k[self.layer_idx][:end], cache.v[self.layer_idx][:end]
        # END SOLUTION

    def attend(self, q, k_all, v_all, meta):
        mask = meta.attn_mask
        if self.window is not None:  # the contiguous cache holds position s at row s
            mask = window_mask(meta.positions, torch.arange(k_all.shape[0], device=q.device), self.window)
        return attend(q, k_all, v_all, mask)


class Qwen3MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_idx: int, attention_cls: type[Qwen3Attention]):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, cos, sin, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, attention_cls: type[Qwen3Attention]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, i, attention_cls) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, cos, sin, kv, meta) -> torch.Tensor:
        """input_ids [T] -> hidden states [T, hidden] after the final norm (cos, sin [T, head_dim])."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    """Module names match HF's, so a checkpoint's state dict loads as it is."""

    def __init__(self, cfg: Qwen3Config, attention_cls: type[Qwen3Attention] = Qwen3Attention):
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg, attention_cls)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids: torch.Tensor, kv, meta,
                logits_for: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (a flat batch; meta.positions [T]) -> logits [T, vocab].

        logits_for [N] picks the tokens whose logits are wanted (e.g. each request's last), so
        the lm_head, the largest matmul for a small model, runs on N rows instead of T.
        """
        cos, sin = self.rotary.cos_sin(meta.positions, self.dtype)
        x = self.model(input_ids, cos, sin, kv, meta)
        if logits_for is not None:
            x = x[logits_for]
        return self.lm_head(x)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu",
                        attention_cls: type[Qwen3Attention] = Qwen3Attention) -> "Qwen3ForCausalLM":
        cfg = load_config(model_dir)
        weights = load_weights(model_dir, cfg, dtype, device)
        with torch.device("meta"):  # build without allocating; the checkpoint's tensors are assigned
            model = cls(cfg, attention_cls)
        # strict=False only because a tied head has no lm_head tensor; load_weights has already
        # checked that every other tensor is present with the right shape.
        model.load_state_dict(weights, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device)
        return model.eval()
