#!/usr/bin/env python3
"""L2 smoke test: all requests share one paged KV pool and decode together; each must equal HF alone.

The prompts run in one PagedRunner.generate: one packed prefill, then batched decode steps. The
pool is sized by --num-blocks, or by --kv-memory (bytes, or on CUDA a share of free memory), or by
default just large enough for every request at its longest. With no prompt given, three prompts of
different lengths run on the embedded model.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    import torch  # noqa: E402

    from harness.smoke import LessonRun, RequestResult, run_smoke  # noqa: E402
    from l1_contiguous import InputError  # noqa: E402
    from l2_paged import (BlockAllocator, KvPool, OutOfBlocksError, PagedRunner, Request, blocks_needed,  # noqa: E402
                          bytes_per_block, cuda_kv_budget, kv_positions_needed, load_paged_model,
                          num_blocks_for_budget, parse_size)


LESSON = "L2"


def add_options(parser):
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block (default 16)")
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, default=None,
                      help="blocks in the pool (default: enough for every request at its longest, "
                           "prompt + max-new-tokens - 1 positions each)")
    pool.add_argument("--kv-memory", metavar="SIZE", default=None,
                      help="size the pool from memory instead: bytes with a unit (64MiB, 1.5GiB, "
                           "500MB), or, with --device cuda, a bare number in (0, 1] meaning that share "
                           "of the device memory still free after the weights are loaded (0.9)")


def check_options(args) -> None:
    """Reject bad pool options before anything is loaded."""
    if args.block_size < 1:
        raise InputError(f"--block-size must be at least 1, got {args.block_size}")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise InputError(f"--num-blocks must be at least 1, got {args.num_blocks}")
    if args.kv_memory is not None and not is_share(args.kv_memory):
        parse_size(args.kv_memory)  # an unreadable size is reported before the model loads


def is_share(spec: str) -> bool:
    """A bare number no larger than 1 (0.9, .5, 1) is a share of free memory, not bytes."""
    return re.fullmatch(r"\s*\d*\.?\d+\s*", spec) is not None and float(spec) <= 1


def kv_budget_bytes(spec: str, device: str) -> int:
    """--kv-memory as bytes: '64MiB' -> 67108864; '0.9' on CUDA -> 90% of the free device memory."""
    if is_share(spec):
        fraction = float(spec)
        if device != "cuda":
            raise InputError(f"--kv-memory {spec} is a share of free CUDA memory, and the device is "
                             f"{device}; give bytes with a unit instead, e.g. 64MiB")
        if fraction <= 0:
            raise InputError(f"--kv-memory share must be in (0, 1], got {spec}")
        return cuda_kv_budget(fraction, torch.cuda.current_device())
    return parse_size(spec)


def pool_blocks(args, setup, requests: list[Request]) -> int:
    if args.num_blocks is not None:
        return args.num_blocks
    if args.kv_memory is not None:
        budget = kv_budget_bytes(args.kv_memory, setup.device)
        return num_blocks_for_budget(setup.cfg, budget, args.block_size, setup.dtype)
    return sum(longest_blocks(r, args.block_size) for r in requests)


def longest_blocks(req: Request, block_size: int) -> int:
    """Blocks a request holds at its longest: the last new token's K/V is never written."""
    return blocks_needed(kv_positions_needed(len(req.prompt_ids), req.max_new_tokens), block_size)


def run(args, setup) -> LessonRun:
    check_options(args)
    model = load_paged_model(setup.model_dir, setup.dtype, setup.device)
    return run_requests(args, setup, model, KvPool, PagedRunner)


def run_requests(args, setup, model, pool_cls, make_runner) -> LessonRun:
    """The prompts as one batch on a fresh pool; L3 passes its own pool class and runner."""
    requests = [Request(p.ids, setup.max_new_tokens, request_id=i) for i, p in enumerate(setup.prompts)]
    num_blocks = pool_blocks(args, setup, requests)
    try:
        pool = pool_cls(setup.cfg, num_blocks, args.block_size, setup.dtype, setup.device)
    except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
        size = num_blocks * bytes_per_block(setup.cfg, args.block_size, setup.dtype)
        raise InputError(f"cannot allocate a pool of {num_blocks} blocks ({size:,} bytes) on "
                         f"{setup.device}; ask for fewer blocks or less --kv-memory") from None
    alloc = BlockAllocator(num_blocks, args.block_size)
    runner = make_runner(model, pool, alloc)
    try:
        runner.generate(requests)
    except OutOfBlocksError as exc:
        need = sum(longest_blocks(r, args.block_size) for r in requests)
        raise InputError(f"the pool of {num_blocks} blocks ran out (a request asked for {exc.requested} "
                         f"more, {exc.free} were free); these requests together need up to {need} blocks of "
                         f"{args.block_size} tokens: raise --num-blocks or --kv-memory") from None
    if alloc.num_free != alloc.num_blocks:  # a bug in l2_paged, not bad input: fail loudly
        raise RuntimeError(f"block leak: {alloc.num_free} of {alloc.num_blocks} blocks free after the run")
    figures = pool_figures(setup, runner, requests)
    results = [RequestResult(r.prompt_ids, r.output_ids,
                             label=f"{len(r.prompt_ids)}+{len(r.output_ids)} tokens, "
                                   f"{blocks_needed(r.cur_len, args.block_size)} blocks at most")
               for r in requests]
    del runner, pool, model
    if setup.device == "cuda":
        torch.cuda.empty_cache()  # give the pool's memory back before HF's model is loaded
    return LessonRun(results, figures)


def pool_figures(setup, runner: PagedRunner, requests: list[Request]) -> dict:
    alloc, stats = runner.alloc, runner.stats
    per_block = bytes_per_block(setup.cfg, alloc.block_size, setup.dtype)
    per_token = setup.cfg.kv_bytes_per_token(setup.dtype.itemsize)
    return {
        "block_size": alloc.block_size,
        "blocks_total": alloc.num_blocks,
        "blocks_peak_used": alloc.peak_used,
        "blocks_free_at_end": alloc.num_free,
        "wasted_slots_peak": max(stats.wasted_slots),
        "decode_steps": len(stats.blocks_used) - 1,
        "kv_bytes_per_block": per_block,
        "kv_pool_bytes": runner.pool.nbytes(),
        "kv_peak_used_bytes": alloc.peak_used * per_block,
        # What L1 reserves for the same requests: one contiguous cache of prompt + max-new-tokens each.
        "l1_kv_bytes": sum(len(r.prompt_ids) + r.max_new_tokens for r in requests) * per_token,
    }


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options))
