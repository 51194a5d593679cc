"""Run several requests together on one pool: one packed prefill, then batched decode steps.

    prefill:  every prompt in one forward (ragged batch) ─► first token of each request
    decode:   all unfinished requests, one token each, in one forward ─► next tokens
    finish:   a request that hit max_new_tokens or a stop id gives its blocks back at once
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from l1_contiguous import InputError, Qwen3ForCausalLM

from .allocator import BlockAllocator, OutOfBlocksError
from .attention import PagedAttention
from .meta import build_meta
from .pool import KvPool
from .request import Request, blocks_needed, release, reserve


def _is_id(value, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


@dataclass
class PoolStats:
    """The counters the lesson shows: a snapshot after each step."""

    blocks_total: int
    blocks_used: list[int] = field(default_factory=list)
    wasted_slots: list[int] = field(default_factory=list)  # reserved, unfilled, in last blocks
    owners: list[dict[int, list[int]]] = field(default_factory=list)  # request id -> its blocks


def check_pool_matches(pool: KvPool, alloc: BlockAllocator) -> None:
    """The allocator hands out ids of the pool's blocks: both must have the same shape."""
    if (pool.num_blocks, pool.block_size) != (alloc.num_blocks, alloc.block_size):
        raise InputError(f"the pool has {pool.num_blocks} blocks of {pool.block_size} tokens but the allocator "
                         f"{alloc.num_blocks} of {alloc.block_size}; build both with the same sizes")


def load_paged_model(model_dir: str | Path, dtype=torch.float32, device="cpu",
                     attention_cls=PagedAttention) -> Qwen3ForCausalLM:
    """L1's model with the paged cache step."""
    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype, device, attention_cls=attention_cls)


class PagedRunner:
    def __init__(self, model: Qwen3ForCausalLM, pool: KvPool, alloc: BlockAllocator, stop_ids=None):
        check_pool_matches(pool, alloc)
        self.model, self.pool, self.alloc = model, pool, alloc
        self.stop_ids = set(model.config.eos_token_ids if stop_ids is None else stop_ids)
        self.stats = PoolStats(alloc.num_blocks)

    @torch.inference_mode()
    def forward_logits(self, reqs: list[Request], num_new: list[int]) -> torch.Tensor:
        """Reserve, run the new tokens of `reqs` in one forward, advance cur_len.

        Returns the logits of each request's last new token: [len(reqs), vocab].
        """
        self.reserve_all(reqs, num_new)
        input_ids, meta = self.build_meta(reqs, num_new)
        logits = self.model(input_ids, self.pool, meta, logits_for=self.logits_rows(reqs, meta))
        for req, n in zip(reqs, num_new):
            req.cur_len += n
        return logits

    def logits_rows(self, reqs: list[Request], meta) -> torch.Tensor:
        """Rows of the forward whose logits are returned: each request's last new token.
        (L10 overrides it: a request verifying k proposals needs all of its k + 1 rows.)"""
        return meta.cu_seqlens_q[1:] - 1

    def reserve_all(self, reqs: list[Request], num_new: list[int]) -> None:
        """Blocks for every request of the step, or (OutOfBlocksError) none at all."""
        bs = self.alloc.block_size
        missing = sum(max(0, blocks_needed(r.cur_len + n, bs) - len(r.blocks)) for r, n in zip(reqs, num_new))
        if missing > self.alloc.num_free:
            raise OutOfBlocksError(missing, self.alloc.num_free)
        for req, n in zip(reqs, num_new):
            reserve(req, self.alloc, req.cur_len + n)

    def forward(self, reqs: list[Request], num_new: list[int]) -> list[int]:
        """`forward_logits`, then the greedy id of each request."""
        return self.forward_logits(reqs, num_new).argmax(-1).tolist()

    def build_meta(self, reqs: list[Request], num_new: list[int]):
        """Input ids and metadata of one forward; L3 overrides this to add block tables."""
        return build_meta(reqs, num_new, self.model.device)

    def step(self, reqs: list[Request], num_new: list[int]) -> None:
        """One forward, then append tokens, finish requests, record counters."""
        for req, token in zip(reqs, self.forward(reqs, num_new)):
            self.commit_token(req, token)
        self.record_stats(reqs)

    def commit_token(self, req: Request, token: int) -> None:
        """Append `token` to req; a request that hit a stop id or its length finishes and frees its blocks."""
        req.output_ids.append(token)
        if token in self.stop_ids or len(req.output_ids) >= req.max_new_tokens:
            req.finished = True
            release(req, self.alloc)

    def generate(self, reqs: list[Request]) -> list[Request]:
        """Prefill all prompts in one forward, then decode everyone still running, together."""
        self.check_requests(reqs)
        self.step(reqs, [len(r.prompt_ids) for r in reqs])
        while running := [r for r in reqs if not r.finished]:
            self.step(running, [1] * len(running))
        return reqs

    def check_requests(self, reqs: list[Request]) -> None:
        """InputError naming the request and the bad value, before any block is taken."""
        cfg = self.model.config
        twice = next((r for i, r in enumerate(reqs) if any(r is s for s in reqs[:i])), None)
        if twice is not None:
            raise InputError(f"request {twice.request_id} is listed twice; pass each Request once "
                             f"(for two samples of one prompt, make two Requests)")
        for req in reqs:
            who, ids, n = f"request {req.request_id}", req.prompt_ids, req.max_new_tokens
            if not isinstance(ids, list) or not ids or not all(_is_id(i, cfg.vocab_size) for i in ids):
                raise InputError(f"{who}: prompt_ids must be a non-empty list of token ids in "
                                 f"0..{cfg.vocab_size - 1}, got {str(ids)[:60]}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise InputError(f"{who}: max_new_tokens must be an int >= 1, got {n!r}")
            if len(ids) + n > cfg.max_position_embeddings:
                raise InputError(f"{who}: {len(ids)} prompt + {n} new tokens exceed the model's "
                                 f"{cfg.max_position_embeddings} positions")

    def record_stats(self, reqs: list[Request]) -> None:
        """Append this step's counters to self.stats (a runner that overrides step calls it too)."""
        live = [r for r in reqs if not r.finished]
        self.stats.blocks_used.append(self.alloc.num_used)
        self.stats.wasted_slots.append(sum(r.wasted_slots(self.alloc.block_size) for r in live))
        self.stats.owners.append({r.request_id: list(r.blocks) for r in live})
