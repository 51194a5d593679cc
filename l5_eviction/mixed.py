"""One forward per step: the decodes and the prefill chunks of a step share a flat batch.

    flat batch    [ d0  d1  d2 | a  a  a  a  b  b ]     decodes first, then each prefill chunk
                   └─ decode ─┘ └─── prefill ───┘
    embedding, norms, q/k/v/o projections, MLP, lm_head   work row by row: run once on all rows
    attention     rows [0, d): L3's decode path, walking block tables in place
                  rows [d, T): L2's prefill path, gathering histories under a causal mask

Only attention needs to know which rows are which; everything else reads each weight once per
step instead of once per forward. The two halves reuse L3's metadata and L3's `kv_step` /
`attend` unchanged: a mixed step is L3's two forwards with the row-wise work fused.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from l1_contiguous import InputError
from l2_paged import load_paged_model
from l3_block_kernel import BlockForwardMeta, BlockTableAttention, BlockTableRunner, build_block_meta
from l3_block_kernel.kernel_build import load_cpu_kernel

from .fast_linear import use_packed_linears
from .fused import fuse_projections, fused_project_qkv

if TYPE_CHECKING:
    from .kv_manager import KvManager


@dataclass
class MixedBatchMeta:
    """A step with both kinds of rows: L3's decode meta for the first requests, prefill meta for the rest."""

    positions: torch.Tensor  # [T] int64: the decode rows' positions, then the prefill rows'
    cu_seqlens_q: torch.Tensor  # [B + 1] int64 over the whole batch, in the same order
    decode: BlockForwardMeta  # one token per request: block tables, no mask
    prefill: BlockForwardMeta  # several tokens per request: kv_indices and a [T_prefill, S] mask

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode.positions)


def build_step_meta(reqs: list, num_new: list[int], device, backend: str):
    """Input ids [T] and the metadata of one step. Requests with one new token must come first.

    A step of one kind gets L3's metadata unchanged; a mixed step gets a MixedBatchMeta.
    """
    num_decode = num_new.count(1)
    if any(n != 1 for n in num_new[:num_decode]):
        raise ValueError("a mixed step lists the requests with one new token first; sort the plan "
                         "by num_new > 1 before building its metadata")
    if num_decode in (0, len(reqs)):
        return build_block_meta(reqs, num_new, device, backend)
    decode_ids, decode = build_block_meta(reqs[:num_decode], num_new[:num_decode], device, backend)
    prefill_ids, prefill = build_block_meta(reqs[num_decode:], num_new[num_decode:], device, backend)
    meta = MixedBatchMeta(positions=torch.cat([decode.positions, prefill.positions]),
                          cu_seqlens_q=torch.cat([decode.cu_seqlens_q, prefill.cu_seqlens_q[1:] + num_decode]),
                          decode=decode, prefill=prefill)
    return torch.cat([decode_ids, prefill_ids]), meta


class MixedBatchAttention(BlockTableAttention):
    """L3's attention, which also takes a MixedBatchMeta: each half of the rows takes its own path."""

    fused = False  # set by fused.fuse_projections: q, k and v then come from one product

    def project_qkv(self, x, cos, sin):
        if self.fused:
            return fused_project_qkv(self, x, cos, sin)
        return super().project_qkv(x, cos, sin)

    def forward(self, x, cos, sin, pool, meta):
        if not isinstance(meta, MixedBatchMeta):
            return super().forward(x, cos, sin, pool, meta)
        # BEGIN SOLUTION
        q, k, v = self.project_qkv(x, cos, sin)  # [T, H, D], [T, H_kv, D], [T, H_kv, D]
        d = meta.num_decode_tokens
        out = torch.cat([self._attend_part(q[:d], k[:d], v[:d], pool, meta.decode),
                         self._attend_part(q[d:], k[d:], v[d:], pool, meta.prefill)])
        return self.o_proj(out.flatten(1))
        # END SOLUTION

    def _attend_part(self, q, k, v, pool, meta):
        """L3's cache step and attention for one half of the rows: writes its K/V, returns [rows, H, D]."""
        k_all, v_all = self.kv_step(k, v, pool, meta)
        return self.attend(q, k_all, v_all, meta)


def load_engine_model(model_dir: str | Path, dtype=torch.float32, device="cpu", packed_linears: bool = True,
                      attention_cls: type[MixedBatchAttention] = MixedBatchAttention):
    """L3's model with attention that runs mixed steps: the model every L5 (and L8) engine runs.

    Its q/k/v and gate/up projections are stacked into one product each and its norms are
    torch's (fused.py: the same arithmetic in fewer operations). packed_linears: on a CPU in
    float32, the large matrix products run on oneDNN with their weights packed for few rows
    (fast_linear.py; False: `nn.Linear`, half the memory).
    """
    model = fuse_projections(load_paged_model(model_dir, dtype, device, attention_cls=attention_cls))
    return use_packed_linears(model) if packed_linears else model


def engine_backend(device, dtype: torch.dtype = torch.float32) -> str:
    """The decode path an engine uses by default: the kernel on CUDA; on a CPU, L3's C++ walk of
    the block tables ("cpu", float32), else L3's gather backend.

    The reference walks blocks in a Python loop; it is the oracle, and slow. Without a C++
    compiler (or in bfloat16), copying the blocks into a padded batch for one SDPA call costs
    less (see docs/benchmarks.md, L5).
    """
    if torch.device(device).type == "cuda":
        return "kernel"
    if dtype != torch.float32:
        return "gather"
    try:
        load_cpu_kernel()
    except InputError as exc:
        _say_once(f"the engine decodes with L3's gather backend: {exc}")
        return "gather"
    return "cpu"


@functools.cache
def _say_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


class StepRunner(BlockTableRunner):
    """L3's runner on a step's (possibly mixed) batch; blocks and metadata come from the KV manager
    (kv_manager.py), so a lesson that keeps K/V differently changes the manager, not the runner."""

    def __init__(self, model, kv: KvManager, backend: str | None = None):
        check_engine_model(model)
        self.kv = kv
        super().__init__(model, kv.pool, kv.alloc, backend=backend or engine_backend(model.device, model.dtype))

    def reserve_all(self, reqs, num_new) -> None:
        self.kv.allocate_step(reqs, num_new)

    def build_meta(self, reqs, num_new):
        return self.kv.step_metadata(reqs, num_new, self.model.device, self.backend)


def check_engine_model(model) -> None:
    """Every attention layer must take a MixedBatchMeta; say how to load such a model if not."""
    kinds = {type(layer.self_attn).__name__ for layer in model.model.layers
             if not isinstance(layer.self_attn, MixedBatchAttention)}
    if kinds:
        raise InputError(f"the engine runs decodes and prefill chunks in one forward, which "
                         f"{', '.join(sorted(kinds))} cannot; load the model with "
                         f"l5_eviction.load_engine_model (not l3_block_kernel.load_block_model)")
