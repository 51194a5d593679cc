"""Drafters: cheap guesses of a request's next k tokens, for the target to verify in one forward.

PromptLookupDrafter  no model: find the request's last n tokens earlier in its own tokens and
                     propose what followed them there (text that repeats itself, e.g. the KJV's
                     "And the LORD spake unto Moses, saying", is guessed for free).
DraftModelDrafter    a smaller model with the same tokenizer, decoding k tokens ahead on its own
                     paged KV cache; that cache runs ahead too and is rewound to the tokens the
                     target accepted before the next proposal.

A drafter's `propose(reqs, ks)` returns, per request, (ids, probs): probs [k, V] is the drafter's
distribution at each proposal (needed by sampled acceptance), None for a deterministic drafter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from l1_contiguous import InputError
from l2_paged import BlockAllocator, OutOfBlocksError, Request, release
from l3_block_kernel import BlockKvPool
from l5_eviction import KvManager, StepRunner, load_engine_model
from l8_prefix import is_greedy

from .rewind import rewind


def propose_ngram(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to k ids that followed the most recent earlier occurrence of the sequence's last n ids.

    Tries n = max_ngram down to 1; the first n with a match wins. The match must end before the
    last token (the suffix itself is no match) and be followed by at least one id. [] if none.
    """
    # BEGIN SOLUTION
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
    # END SOLUTION


class PromptLookupDrafter:
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3):
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 1:
            raise InputError(f"max_ngram must be an int >= 1, got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.forwards = 0  # it runs no model

    def propose(self, reqs, ks: list[int]):
        return [(propose_ngram(r.tokens, k, self.max_ngram), None) for r, k in zip(reqs, ks)]

    def release(self, request_id: int) -> None:
        pass

    def stateful(self) -> list:
        return []


class DraftModelDrafter:
    """A small model on its own pool: one Request per target request, rewound before each proposal.

    Its cache holds K/V for the tokens it has seen: the target's accepted tokens and its own last
    proposals. Before proposing it keeps the longest prefix equal to the target's tokens (the rest
    is rewound away, blocks freed), computes what is missing in one forward, then decodes k ids,
    all requests together.
    """

    name = "draft-model"

    def __init__(self, model, num_blocks: int, block_size: int = 16, backend: str | None = None):
        self.model = model
        self.alloc = BlockAllocator(num_blocks, block_size)
        pool = BlockKvPool(model.config, num_blocks, block_size, model.dtype, model.device)
        self.runner = StepRunner(model, KvManager(self.alloc, pool), backend=backend)
        self.seqs: dict[int, Request] = {}  # target request id -> the draft's own request
        self.forwards = 0

    @classmethod
    def load(cls, model_dir: str | Path, target, num_blocks: int, block_size: int = 16,
             backend: str | None = None) -> DraftModelDrafter:
        """The draft model in `model_dir`, checked against the target: same vocabulary, same device."""
        model = load_engine_model(model_dir, target.dtype, target.device)
        if model.config.vocab_size != target.config.vocab_size:
            raise InputError(f"the draft model has a vocabulary of {model.config.vocab_size} and the target "
                             f"{target.config.vocab_size}; a draft must share its target's tokenizer")
        return cls(model, num_blocks, block_size, backend)

    def propose(self, reqs, ks: list[int]):
        try:
            return self._propose(reqs, ks)
        except OutOfBlocksError:  # its pool is full: start over next step, no speculation this step
            for request_id in list(self.seqs):
                self.release(request_id)
            return [([], None)] * len(reqs)

    @torch.inference_mode()
    def _propose(self, reqs, ks):
        seqs = [self._synced(r) for r in reqs]
        drafts = [[] for _ in reqs]
        probs = [[] for _ in reqs]
        live = list(range(len(reqs)))
        num_new = [s.num_pending for s in seqs]
        for step in range(max(ks, default=0)):
            live = [i for i in live if ks[i] > step]
            order = sorted(live, key=lambda i: num_new[i] > 1)  # one-token rows first (a mixed step)
            logits = self.runner.forward_logits([seqs[i] for i in order], [num_new[i] for i in order])
            self.forwards += 1
            for i, row in zip(order, logits):
                token, q = _pick(reqs[i], row)
                drafts[i].append(token)
                probs[i].append(q)
                seqs[i].output_ids.append(token)
                num_new[i] = 1
        return [(d, torch.stack(p) if p and p[0] is not None else None) for d, p in zip(drafts, probs)]

    def _synced(self, req) -> Request:
        """The draft's request for `req`, rewound to the longest prefix of its tokens it has right."""
        seq = self.seqs.setdefault(req.request_id, _DraftSeq([], request_id=req.request_id))
        target = req.tokens
        same = 0
        cached = seq.tokens[:seq.cur_len]
        while same < min(len(cached), len(target) - 1) and cached[same] == target[same]:
            same += 1  # (at most len - 1: the last token is always computed, for its logits)
        rewind(seq, self.alloc, same)
        seq.prompt_ids, seq.output_ids = list(target), []
        return seq

    def release(self, request_id: int) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            release(seq, self.alloc)

    def stateful(self) -> list:
        """What a rolled-back engine step must restore (see Engine.step)."""
        return [self, self.alloc, *self.seqs.values()]


class _DraftSeq(Request):
    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.cur_len


def _pick(req, logits_row: torch.Tensor):
    """The draft's id at the request's temperature: (argmax, None) or (a draw, its distribution)."""
    if is_greedy(req.temperature):
        return int(logits_row.argmax()), None
    q = torch.softmax(logits_row.float() / req.temperature, dim=-1)
    return int(torch.multinomial(q, 1, generator=req.generator)), q
