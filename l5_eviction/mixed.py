"""One forward per step: the decodes and the prefill chunks of a step share a flat batch.

    flat batch    [ d0  d1  d2 | a  a  a  a  b  b ]     a step's rows, request after request
    embedding, norms, q/k/v/o projections, MLP, lm_head   work row by row: run once on all rows
    attention     L4's paged attention: every row reads its request's keys through the block
                  table, a decode being a request with one row (no gather, no mask)

Every weight is read once per step instead of once per forward, and attention needs to know
nothing more than L4's metadata says: which rows are whose, and how many keys each request has.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from l1_contiguous import InputError
from l2_paged import load_paged_model
from l3_block_kernel import BlockTableRunner
from l4_paged_prefill import PagedPrefillAttention, build_paged_meta
from l4_paged_prefill.varlen import cpu_kernel_builds

from .fast_linear import use_packed_linears
from .fused import fuse_model, fused_project_qkv, fused_project_qkv_write, writes_in_projection

if TYPE_CHECKING:
    from .kv_manager import KvManager


def build_step_meta(reqs: list, num_new: list[int], device, backend: str):
    """Input ids [T] and L4's metadata of one step, whatever mix of decodes and chunks it holds."""
    return build_paged_meta(reqs, num_new, device, backend)


class MixedBatchAttention(PagedPrefillAttention):
    """L4's attention with the engine's fused projections: the attention of every engine's model."""

    fused = False  # set by fused.fuse_model: q, k and v then come from one product

    def forward(self, x, cos, sin, kv, meta):
        """L1's forward; where fused.writes_in_projection says so, the q/k norm, the rotary and the
        cache step's write are one C++ call after the q/k/v product (the same values in the pool)."""
        if not (self.fused and writes_in_projection(self, x, cos, kv, meta)):
            return super().forward(x, cos, sin, kv, meta)
        q = fused_project_qkv_write(self, x, cos, sin, kv, meta)
        out = self.attend(q, kv.k_blocks[self.layer_idx], kv.v_blocks[self.layer_idx], meta)
        return self.o_proj(out.flatten(1))

    def project_qkv(self, x, cos, sin):
        if self.fused:
            return fused_project_qkv(self, x, cos, sin)
        return super().project_qkv(x, cos, sin)


def load_engine_model(model_dir: str | Path, dtype=torch.float32, device="cpu", packed_linears: bool = True,
                      attention_cls: type[MixedBatchAttention] = MixedBatchAttention):
    """L4's model (every step on one paged attention) with fused projections: the model every
    engine from L5 on runs.

    Its q/k/v and gate/up projections are stacked into one product each and its norms are
    torch's (fused.py: the same arithmetic in fewer operations). packed_linears: on a CPU in
    float32, the large matrix products run on oneDNN with their weights packed for few rows and
    the layers' smaller ones on W.T cut into column blocks, up to one per torch thread, run in
    parallel (fast_linear.py: the blocks are cut for the thread count at load, so set torch's
    threads first; False: `nn.Linear`, half the memory).
    """
    model = fuse_model(load_paged_model(model_dir, dtype, device, attention_cls=attention_cls))
    return use_packed_linears(model) if packed_linears else model


# What a smoke script or a benchmark may ask an engine for: L4's backends ("auto" is the library's).
ENGINE_BACKENDS = ("kernel", "emulated", "cpu", "reference")


def engine_backend(device, dtype: torch.dtype = torch.float32) -> str:
    """The attention backend an engine uses by default (L4's names): the kernel on CUDA; on a CPU,
    L4's C++ kernel ("cpu", float32) where a C++ compiler builds it, else the PyTorch reference."""
    if torch.device(device).type == "cuda":
        return "kernel"
    if dtype != torch.float32:
        return "reference"
    if not cpu_kernel_builds():
        _say_once("the engine attends with L4's PyTorch reference: L4's C++ kernel does not build here "
                  "(python -c 'from l4_paged_prefill.kernel_build import load_cpu_kernel; load_cpu_kernel()' says why)")
        return "reference"
    return "cpu"


@functools.cache
def _say_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


class StepRunner(BlockTableRunner):
    """L3's runner on a step's batch (decodes and prefill chunks together); blocks and metadata come from the KV manager
    (kv_manager.py), so a lesson that keeps K/V differently changes the manager, not the runner."""

    def __init__(self, model, kv: KvManager, backend: str | None = None):
        check_engine_model(model)
        self.kv = kv
        super().__init__(model, kv.pool, kv.alloc, backend=backend or engine_backend(model.device, model.dtype))

    def reserve_all(self, reqs, num_new) -> None:
        self.kv.allocate_step(reqs, num_new)

    def build_meta(self, reqs, num_new):
        return self.kv.step_metadata(reqs, num_new, self.model.device, self.backend)

    def logits_rows(self, reqs, meta):
        """In a step of decodes only every row is its request's last: None, all rows, nothing to gather."""
        if meta.max_query_len == 1:
            return None
        return super().logits_rows(reqs, meta)


def check_engine_model(model) -> None:
    """Every attention layer must be the engine's (L4's read path, fused projections); say how to
    load such a model if not."""
    kinds = {type(layer.self_attn).__name__ for layer in model.model.layers
             if not isinstance(layer.self_attn, MixedBatchAttention)}
    if kinds:
        raise InputError(f"the engine runs decodes and prefill chunks in one forward, which "
                         f"{', '.join(sorted(kinds))} cannot; load the model with "
                         f"l5_eviction.load_engine_model (not l3_block_kernel.load_block_model)")
