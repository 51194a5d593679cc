#!/usr/bin/env python3
"""L2 benchmark: KV memory and decode speed of a mixed workload, paged and batched vs one by one.

The workload is --requests requests (default 16) with mixed prompt and output lengths drawn from a
fixed seed; every request makes exactly its own number of new tokens (EOS does not stop it).

Memory: the KV bytes each approach reserves for the whole workload at once:
  L1 contiguous   one cache per request, sized prompt + max_new (or the model's max positions)
  HF batched      one left-padded batch: every row as long as the longest prompt + longest output
  L2 paged        the blocks in use at the peak of the run, times the bytes of a block

Speed, all in the same run on the same model, device and dtype:
  L2 batched      PagedRunner.generate: one packed prefill, then all live requests per decode step
  L1 one by one   greedy_generate per request, a fresh contiguous cache each
  HF one by one   transformers generate per request
  HF batched      transformers generate on the left-padded batch, run to the longest output
A run is timed twice, with every request making 1 token (prefill only) and its full output;
decode time = full - prefill, decode tokens/s = sum(new tokens - 1) / decode time. HF batched
makes tokens nobody asked for (short requests run on to the longest); only asked-for tokens count.

    python scripts/bench_l2.py                          # embedded model, cpu float32
    python scripts/bench_l2.py --requests 32 --repeat 3 --json bench_l2.json
    python scripts/bench_l2.py --threads 1                # steadier on a busy shared CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import guard_startup, run_main  # noqa: E402

guard_startup()  # Ctrl-C while torch loads: one line, exit 2 (run_main takes over for the work)

import torch  # noqa: E402

from harness import hf_reference as hf  # noqa: E402
from harness.benchmark import check_bench_args, write_text_atomic, bench_parser, hf_generate, print_table, timed, tokens_per_s  # noqa: E402
from harness.smoke import resolve_model  # noqa: E402
from l1_contiguous import InputError, Qwen3ForCausalLM, greedy_generate  # noqa: E402
from l2_paged import (BlockAllocator, KvPool, PagedRunner, Request, blocks_needed, bytes_per_block,  # noqa: E402
                      load_paged_model)

PROMPT_LENS = (8, 256)  # inclusive ranges of the workload's lengths
OUTPUT_LENS = (4, 128)


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__.split("\n\n")[0], repeat=2)
    p.add_argument("--requests", type=int, default=16, help="requests in the workload (default 16)")
    p.add_argument("--block-size", type=int, default=16, help="L2 block size (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's lengths and ids")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice; 1 is steadier on a busy shared CPU)")
    return check_bench_args(p.parse_args(argv), p)


def make_workload(num: int, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per request; lengths uniform in PROMPT_LENS and OUTPUT_LENS."""
    rng = random.Random(seed)
    work = []
    for _ in range(num):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*PROMPT_LENS))]
        work.append((prompt, rng.randint(*OUTPUT_LENS)))
    return work


# ---------------------------------------------------------------- the four ways to run it
# Each run(work) returns the new ids of every request; `work` pairs a prompt with its token count.

def l2_runner(model, num_blocks: int, block_size: int):
    pool = KvPool(model.config, num_blocks, block_size, model.dtype, model.device)
    alloc = BlockAllocator(num_blocks, block_size)
    last = {}

    def run(work):
        runner = PagedRunner(model, pool, alloc, stop_ids=())
        reqs = [Request(p, n, request_id=i) for i, (p, n) in enumerate(work)]
        runner.generate(reqs)
        last["runner"] = runner
        return [r.output_ids for r in reqs]

    return run, last


def l1_runner(model):
    return lambda work: [greedy_generate(model, p, n, stop_ids=()).new_ids for p, n in work]


def hf_one_by_one(model):
    return lambda work: [hf_generate(model, [p], n)[0] for p, n in work]


def hf_batched(model):
    def run(work):
        outs = hf_generate(model, [p for p, _ in work], max(n for _, n in work), batched=True)
        return [out[:n] for out, (_, n) in zip(outs, work)]
    return run


def time_phases(methods: dict, work, repeat: int, device) -> dict:
    """Per method: best seconds of a prefill-only run and of the full run; decode = the difference.

    The methods take turns, round after round, so that a burst of other work on a shared machine
    slows one round of every method rather than every run of one method.
    """
    prefill_only = [(p, 1) for p, _ in work]
    best = {name: {"prefill_s": float("inf"), "total_s": float("inf")} for name in methods}
    for _ in range(repeat):
        for name, run in methods.items():
            t = best[name]
            t["prefill_s"] = min(t["prefill_s"], timed(lambda: run(prefill_only), 1, 0, device).best)
            t["total_s"] = min(t["total_s"], timed(lambda: run(work), 1, 0, device).best)
    for t in best.values():
        t["decode_s"] = max(t["total_s"] - t["prefill_s"], 1e-9)  # noise can make it dip below 0
    return best


# ---------------------------------------------------------------- main

def setup(args):
    model_dir, cfg, device, dtype = resolve_model(args)
    if args.requests < 1 or args.repeat < 1 or args.block_size < 1:
        raise InputError("--requests, --repeat and --block-size must be at least 1")
    if PROMPT_LENS[1] + OUTPUT_LENS[1] > cfg.max_position_embeddings:
        raise InputError(f"the workload needs {PROMPT_LENS[1] + OUTPUT_LENS[1]} positions; the model has "
                         f"{cfg.max_position_embeddings}")
    return model_dir, cfg, device, dtype


def memory_rows(cfg, work, dtype, block_size: int, peak_blocks: int, wasted_peak: int) -> list[dict]:
    per_token = cfg.kv_bytes_per_token(dtype.itemsize)
    n = len(work)
    widest = max(len(p) for p, _ in work) + max(k for _, k in work)
    rows = [
        ("L1 contiguous, prompt + max_new each", sum(len(p) + k for p, k in work)),
        (f"L1 contiguous, max positions ({cfg.max_position_embeddings}) each",
         n * cfg.max_position_embeddings),
        ("HF batched, left-padded to the widest row", n * widest),
        (f"L2 paged, peak {peak_blocks} blocks of {block_size}", peak_blocks * block_size),
    ]
    l2 = peak_blocks * block_size * per_token
    out = [{"layout": name, "token slots": slots, "MiB": slots * per_token / 2**20,
            "x L2": slots * per_token / l2} for name, slots in rows]
    out.append({"layout": f"  of which empty tail slots at the peak: {wasted_peak}", "token slots": None,
                "MiB": None, "x L2": None})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model_dir, cfg, device, dtype = setup(args)
        paged = load_paged_model(model_dir, dtype, device)
        plain = Qwen3ForCausalLM.from_pretrained(model_dir, dtype, device)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import transformers

    theirs = hf.load_hf_model(str(model_dir), device, dtype)
    work = make_workload(args.requests, cfg.vocab_size, args.seed)
    num_blocks = sum(blocks_needed(len(p) + n - 1, args.block_size) for p, n in work)
    header = {
        "model": str(model_dir), "device": device, "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
        "new_tokens": sum(n for _, n in work), "block_size": args.block_size, "repeat": args.repeat,
    }
    print(" · ".join(f"{key} {value}" for key, value in header.items()))
    print("lengths (prompt+new): " + " ".join(f"{len(p)}+{n}" for p, n in work))

    run_l2, last = l2_runner(paged, num_blocks, args.block_size)
    methods = {"L2 batched (paged)": run_l2, "L1 one by one": l1_runner(plain),
               "HF one by one": hf_one_by_one(theirs), "HF batched (left-padded)": hf_batched(theirs)}
    with torch.inference_mode():
        warm = [(p[:8], 2) for p, _ in work[:2]]
        ids = {}
        for name, run in methods.items():
            run(warm)  # first-call costs (kernels, allocator) out of the timings
            ids[name] = run(work)
        stats = last["runner"].stats
        peak, wasted = last["runner"].alloc.peak_used, max(stats.wasted_slots)
        times = time_phases(methods, work, args.repeat, device)

    decode_tokens = sum(n - 1 for _, n in work)
    reference = ids["HF one by one"]
    speed = []
    for name, t in times.items():
        tps = tokens_per_s(decode_tokens, t["decode_s"])
        speed.append({"method": name, "prefill s": t["prefill_s"], "decode s": t["decode_s"],
                      "decode tok/s": tps, "same ids as HF 1x1": sum(a == b for a, b in zip(ids[name], reference))})
    base = {row["method"]: row["decode tok/s"] for row in speed}
    for row in speed:
        row["x L1 1x1"] = row["decode tok/s"] / base["L1 one by one"]
        row["x HF batched"] = row["decode tok/s"] / base["HF batched (left-padded)"]
    memory = memory_rows(cfg, work, dtype, args.block_size, peak, wasted)

    print(f"\nKV memory reserved for the whole workload ({cfg.kv_bytes_per_token(dtype.itemsize)} B per token, "
          f"{bytes_per_block(cfg, args.block_size, dtype)} B per block)")
    print_table(memory, floatfmt=".2f")
    print(f"\ndecode speed ({decode_tokens} decode tokens; same ids counted out of {len(work)})")
    print_table(speed, floatfmt=".2f")
    if args.json:
        write_text_atomic(args.json, json.dumps({**header, "lengths": [[len(p), n] for p, n in work],
                                               "memory": memory, "speed": speed}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
