#!/usr/bin/env python3
"""L5 smoke test: a workload larger than the KV pool, run with preemption; every request must end
with the ids HF gives it alone, and every block must be free at the end."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    from harness.smoke import LessonRun, RequestResult, encode, run_smoke  # noqa: E402
    from l1_contiguous import InputError  # noqa: E402
    from l2_paged import blocks_needed, kv_positions_needed  # noqa: E402
    from l3_block_kernel import check_backend_device  # noqa: E402
    from l5_eviction.mixed import ENGINE_BACKENDS  # noqa: E402
    from l5_eviction import DEFAULT_PREFILL_CHUNK, MODES, POLICIES, WorkItem, engine_backend, load_engine_model, make_engine  # noqa: E402


LESSON = "L5"
WORKLOAD_PROMPTS = [
    "In the beginning God created",
    "And the LORD spake unto Moses, saying",
    "Blessed are the",
    "And it came to pass, when the king",
    "The LORD is my shepherd",
    "Then said Jesus unto them",
    "And the children of Israel went",
    "Hear, O Israel: the LORD our God",
]


def add_options(parser):
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="pool size (default: a quarter of what all requests need together)")
    parser.add_argument("--policy", choices=POLICIES, default="lru")
    parser.add_argument("--preempt", choices=MODES, default="recompute")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help="at most this many prompt tokens per step, all prefills together "
                             f"(default {DEFAULT_PREFILL_CHUNK}, the engine's)")
    parser.add_argument("--backend", choices=ENGINE_BACKENDS, default=None,
                        help="attention: L4's paged path for every row (default: kernel on CUDA, cpu for "
                             "float32 on a CPU, else reference; emulated: the CUDA kernel's own code on the CPU, slowly)")


def workload(args, setup) -> list[WorkItem]:
    """Given prompts, or the default 8; two arrive per step, so the pool fills while others wait."""
    if args.prompt or args.prompt_ids or setup.tokenizer is None:
        prompts = [p.ids for p in setup.prompts]
    else:
        prompts = [encode(setup.tokenizer, text) for text in WORKLOAD_PROMPTS]
    return [WorkItem(ids, setup.max_new_tokens, arrival_step=i // 2, priority=i % 3)
            for i, ids in enumerate(prompts)]


def check_options(args) -> None:
    for name, value in (("--block-size", args.block_size), ("--num-blocks", args.num_blocks),
                        ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and value < 1:
            raise InputError(f"{name} must be at least 1, got {value}")


def pool_blocks(args, items: list[WorkItem]) -> int:
    need = [blocks_needed(len(w.prompt_ids) + w.max_new_tokens, args.block_size) for w in items]
    num_blocks = args.num_blocks if args.num_blocks is not None else max(sum(need) // 4, max(need) + 1)
    return checked_pool(num_blocks, items, args.block_size)


def checked_pool(num_blocks: int, items: list[WorkItem], block_size: int) -> int:
    """num_blocks, or an InputError when the largest request alone cannot fit (the engine's rule)."""
    longest = max(blocks_needed(kv_positions_needed(len(w.prompt_ids), w.max_new_tokens), block_size)
                  for w in items)
    if num_blocks < longest:
        raise InputError(f"a pool of {num_blocks} blocks of {block_size} tokens cannot hold the largest "
                         f"request ({longest} blocks); raise --num-blocks")
    return num_blocks


def run(args, setup) -> LessonRun:
    check_options(args)
    items = workload(args, setup)
    model = load_engine_model(setup.model_dir, setup.dtype, setup.device)
    backend = args.backend or engine_backend(setup.device, setup.dtype)
    check_backend_device(backend, setup.device)
    engine = make_engine(model, pool_blocks(args, items), args.block_size, policy=args.policy,
                         preempt=args.preempt, prefill_chunk=args.prefill_chunk, backend=backend)
    requests = engine.run(items)
    results = [RequestResult(r.prompt_ids, r.output_ids, label=f"arrives at step {r.arrival_step}")
               for r in requests.values()]
    demand = sum(blocks_needed(len(w.prompt_ids) + w.max_new_tokens, args.block_size) for w in items)
    figures = {"backend": backend, "policy": args.policy, "preempt_mode": args.preempt,
               "block_size": args.block_size, "prefill_chunk": args.prefill_chunk, "blocks_demanded": demand,
               **engine.summary()}
    figures["preemptions"] = figures["preempted_recompute"] + figures["preempted_swap"]
    return LessonRun(results, figures)


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options))
