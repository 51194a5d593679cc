"""What quantizing K and V costs, measured against the float pool on text the model never saw.

For each passage, one teacher-forced prefill over the float32 pool and one over the quantized
pool (same model, same positions; only the values read back from the pool differ) give two
[T, vocab] logit matrices p (float) and q (quantized). Per position:

    top-1 agreement   argmax p == argmax q
    KL(p || q)        sum_v p_v (log p_v - log q_v), in nats: how far the whole distribution moved
    perplexity        exp(mean over positions of -log q[next token])  (and of p, side by side)

plus the greedy agreement length: from the first tokens of each passage, how many greedy tokens
the quantized engine produces before its first difference from the float engine's.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from l2_paged import BlockAllocator, Request, blocks_needed, reserve
from l3_block_kernel import BlockKvPool
from l4_paged_prefill import build_paged_meta
from l5_eviction import WorkItem, make_engine

from .engine import make_quantized_engine
from .pool import QuantizedKvPool
from .quantize import KvScales

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CALIBRATION_TEXT = ASSETS / "kjv-calibration.txt"
HELDOUT_TEXT = ASSETS / "kjv-heldout.txt"


def read_passages(path: Path) -> list[str]:
    """One passage per paragraph."""
    return [p.strip() for p in Path(path).read_text().split("\n\n") if p.strip()]


@torch.inference_mode()
def teacher_forced_logits(model, ids: list[int], scales: KvScales | None, block_size: int = 16) -> torch.Tensor:
    """Logits of every position of `ids` from one prefill: [len(ids), vocab] float32.
    scales None: a float pool in the model's dtype; else a quantized pool with those scales."""
    n = blocks_needed(len(ids), block_size)
    cfg, device = model.config, model.device
    pool = (BlockKvPool(cfg, n, block_size, model.dtype, device) if scales is None
            else QuantizedKvPool(cfg, n, block_size, scales, device))
    req = Request(list(ids), 1)
    reserve(req, BlockAllocator(n, block_size), len(ids))
    input_ids, meta = build_paged_meta([req], [len(ids)], device)
    return model(input_ids, pool, meta, logits_for=torch.arange(len(ids), device=device)).float()


def compare_logits(ref: torch.Tensor, test: torch.Tensor, ids: list[int]) -> dict:
    """Per-position figures of `test` against `ref` (both [T, vocab]); the next-token losses use ids[1:]."""
    log_p, log_q = ref.log_softmax(-1), test.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [T]
    targets = torch.tensor(ids[1:], device=ref.device)
    rows = torch.arange(len(ids) - 1, device=ref.device)
    return {"agree": (ref.argmax(-1) == test.argmax(-1)).tolist(), "kl": kl.tolist(),
            "nll_ref": (-log_p[rows, targets]).tolist(), "nll_test": (-log_q[rows, targets]).tolist()}


def greedy_agreement(model, scales: KvScales, prompts: list[list[int]], max_new_tokens: int,
                     block_size: int = 16) -> list[int]:
    """For each prompt: how many greedy tokens the quantized engine gives before its first
    difference from the float engine's (max_new_tokens when none)."""
    num_blocks = sum(blocks_needed(len(p) + max_new_tokens, block_size) for p in prompts)
    work = [WorkItem(list(p), max_new_tokens) for p in prompts]
    ref = make_engine(model, num_blocks, block_size).run(work)
    test = make_quantized_engine(model, scales, num_blocks, block_size).run(work)
    lengths = []
    for i in sorted(ref):
        a, b = ref[i].output_ids, test[i].output_ids
        lengths.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return lengths


def accuracy_cost(model, scales: KvScales, passages: list[list[int]], block_size: int = 16,
                  greedy_prompt_len: int = 0, greedy_tokens: int = 0) -> dict:
    """The figures of the table in docs/benchmarks.md for one setting, over every passage."""
    agree, kl, nll_ref, nll_test = [], [], [], []
    for ids in passages:
        ref = teacher_forced_logits(model, ids, None, block_size)
        test = teacher_forced_logits(model, ids, scales, block_size)
        row = compare_logits(ref, test, ids)
        agree += row["agree"]
        kl += row["kl"]
        nll_ref += row["nll_ref"]
        nll_test += row["nll_test"]
    figures = {"positions": len(kl), "top1_agreement": sum(agree) / len(agree),
               "kl_mean": sum(kl) / len(kl), "kl_max": max(kl),
               "ppl_float": math.exp(sum(nll_ref) / len(nll_ref)),
               "ppl_quantized": math.exp(sum(nll_test) / len(nll_test))}
    if greedy_tokens:
        lengths = greedy_agreement(model, scales, [p[:greedy_prompt_len] for p in passages], greedy_tokens,
                                   block_size)
        figures["greedy_agreement_mean"] = sum(lengths) / len(lengths)
        figures["greedy_agreement_min"] = min(lengths)
    return figures
