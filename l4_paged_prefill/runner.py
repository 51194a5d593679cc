"""L3's runner with every step on L4's path, and prompts fed in chunks mixed with decodes.

    step 1   a: prompt[0:8]    b: prompt[0:5]          (b's whole prompt: b takes its first token)
    step 2   a: prompt[8:16]   b: 1 token (decode)     one forward, one attention call
    step 3   a: prompt[16:19]  b: 1 token               (a's last chunk: a takes its first token)
    ...

A chunk's rows sit after the keys its earlier chunks wrote: the causal offset (varlen.py) is what
lets them read those keys where they lie. prefill_chunk=None feeds each prompt whole, as L3 does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from l1_contiguous import InputError
from l2_paged import Request, load_paged_model
from l3_block_kernel import BlockTableRunner

from .attention import PagedPrefillAttention
from .meta import build_paged_meta
from .varlen import BACKENDS


def load_prefill_model(model_dir: str | Path, dtype=torch.float32, device="cpu"):
    return load_paged_model(model_dir, dtype, device, attention_cls=PagedPrefillAttention)


class PagedPrefillRunner(BlockTableRunner):
    def __init__(self, model, pool, alloc, stop_ids=None, backend: str = "auto", prefill_chunk: int | None = None):
        if backend not in BACKENDS:
            raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise InputError(f"prefill_chunk must be None or a positive int, got {prefill_chunk!r}")
        super().__init__(model, pool, alloc, stop_ids, backend)
        self.prefill_chunk = prefill_chunk

    def build_meta(self, reqs, num_new):
        return build_paged_meta(reqs, num_new, self.model.device, self.backend)

    def tokens_this_step(self, req: Request) -> int:
        """A decode: 1. A prompt: the rest of it, at most prefill_chunk tokens."""
        left = len(req.tokens) - req.cur_len
        return left if self.prefill_chunk is None else min(left, self.prefill_chunk)

    def step(self, reqs: list[Request], num_new: list[int]) -> None:
        """One forward; a request whose prompt is not all in yet takes no token from it (its last
        row's logits predict a prompt token it already has)."""
        for req, token in zip(reqs, self.forward(reqs, num_new)):
            if req.cur_len == len(req.tokens):
                self.commit_token(req, token)
        self.record_stats(reqs)

    def generate(self, reqs: list[Request]) -> list[Request]:
        self.check_requests(reqs)
        while running := [r for r in reqs if not r.finished]:
            self.step(running, [self.tokens_this_step(r) for r in running])
        return reqs
