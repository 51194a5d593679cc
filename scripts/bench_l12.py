#!/usr/bin/env python3
"""L12 benchmark: what a quantized KV cache costs in accuracy, and what it buys in capacity.

Accuracy (the embedded model, held-out King James text: assets/kjv-heldout.txt, scales calibrated
on assets/kjv-calibration.txt). For each setting, every passage is prefilled once over the float32
pool and once over the quantized pool (teacher forcing: the same tokens at every position):
top-1 agreement, mean and max KL(float || quantized) per position, perplexity of both; and
whether the quantized engine's greedy ids equal the quantizing HF oracle's
(harness/quantized_cache.py). How many greedy tokens agree before the first difference is not
shown: on a 4-layer model it is noise (fp8 with one scale beat per-head scales, the reverse of
their KL and top-1); formats are compared by KL and top-1.

Capacity (bench_l5's workload: 32 requests, prompts 8-128, outputs 8-64, all at step 0). One
memory budget, a quarter of what the requests need together in float32, holds as many blocks as
each pool's bytes per block allow; the engine runs the workload on each: blocks, the most requests
running at once, preemptions (by recompute), wall time and tokens/s, and the bytes decode
attention reads from the pool over the whole run (sum over generated tokens of the positions read
times the pool's bytes per position). A bf16 pool runs the model in bf16 (L5 keeps the pool in
the model's dtype); fp8 and int8 pools run it in float32. Everything runs on the CPU: the tables are
CPU figures (--device takes cpu only; there is no --dtype, the rows are the dtypes).

    python scripts/bench_l12.py                                  # both tables, printed
    python scripts/bench_l12.py --markdown docs/benchmarks.md    # rewrite its section there
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_l5's workload

from harness.cli import guard_startup, run_main  # noqa: E402

guard_startup()

import torch  # noqa: E402

import bench_l5  # noqa: E402
from harness import hf_reference as hf  # noqa: E402
from harness.benchmark import (bench_command, bench_parser, check_bench_args, checked_model, load_average,  # noqa: E402
                               machine_line, markdown_table, print_table, replace_section, write_text_atomic)
from harness.quantized_cache import QuantizingCache  # noqa: E402
from harness.smoke import encode, load_tokenizer  # noqa: E402
from l2_paged import blocks_needed  # noqa: E402
from l5_eviction import make_engine  # noqa: E402
from l12_quantized_kv import FORMATS  # noqa: E402
from l12_quantized_kv.accuracy import CALIBRATION_TEXT, HELDOUT_TEXT, accuracy_cost, read_passages  # noqa: E402
from l12_quantized_kv.engine import calibrate, load_quantized_model, make_quantized_engine  # noqa: E402

SETTINGS = [("fp8", "one"), ("fp8", "tensor"), ("fp8", "head"), ("int8", "one"), ("int8", "tensor"), ("int8", "head")]
GREEDY_PROMPT, GREEDY_TOKENS = 16, 48
ACCURACY_COLUMNS = ["format", "scales", "top-1 agree", "KL mean", "KL max", "ppl float32", "ppl quantized",
                    "ppl change %", "ids = oracle"]
CAPACITY_COLUMNS = ["pool", "model", "bytes / block", "blocks", "most running", "preemptions", "wall s",
                    "tokens/s", "decode KV read MiB", "ids = oracle"]


def parse_args(argv=None):
    """The options, checked at the door. No --repeat (each setting runs once) and no --dtype (the
    tables' rows are the dtypes); the tables are CPU figures, so --device is cpu only."""
    p = bench_parser(__doc__.split("\n\n")[0], repeat=None, cpu_only=True)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16; at most the model's positions)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; at most this machine's cores)")
    p.add_argument("--budget-fraction", type=float, default=0.25,
                   help="memory budget as a fraction of the workload's float32 demand, in (0, 1] (default 0.25)")
    p.add_argument("--markdown", metavar="PATH", default=None, help="rewrite the `bench_l12` section of PATH")
    args = check_bench_args(p.parse_args(argv), p)
    if not 0 < args.budget_fraction <= 1:
        p.error(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")
    args.model_dir, _ = checked_model(args)
    return args


def accuracy_rows(model_dir: Path, block_size: int) -> list[dict]:
    tokenizer = load_tokenizer(model_dir)
    model = load_quantized_model(model_dir)
    hf_model = hf.load_hf_model(str(model_dir))
    calibration = [encode(tokenizer, p) for p in read_passages(CALIBRATION_TEXT)]
    heldout = [encode(tokenizer, p) for p in read_passages(HELDOUT_TEXT)]
    rows = []
    for fmt, granularity in SETTINGS:
        scales = calibrate(model, calibration, FORMATS[fmt], granularity, block_size)
        f = accuracy_cost(model, scales, heldout, block_size)
        prompts = [p[:GREEDY_PROMPT] for p in heldout]
        engine = make_quantized_engine(model, scales, sum(blocks_needed(GREEDY_PROMPT + GREEDY_TOKENS, block_size)
                                                          for _ in prompts), block_size)
        ours = engine.run([bench_l5.WorkItem(p, GREEDY_TOKENS) for p in prompts])
        oracle = QuantizingCache(fmt, scales.k, scales.v)
        equal = all(ours[i].output_ids == hf.hf_greedy(hf_model, p, GREEDY_TOKENS, oracle)
                    for i, p in zip(sorted(ours), prompts))
        rows.append({"format": fmt, "scales": granularity, "top-1 agree": f"{100 * f['top1_agreement']:.2f}%",
                     "KL mean": f"{f['kl_mean']:.2e}", "KL max": f"{f['kl_max']:.2e}",
                     "ppl float32": f["ppl_float"], "ppl quantized": f["ppl_quantized"],
                     "ppl change %": f"{100 * (f['ppl_quantized'] / f['ppl_float'] - 1):+.3f}",
                     "ids = oracle": "yes" if equal else "NO",
                     "positions": f["positions"]})
    return rows


def decode_positions_read(items) -> int:
    """Positions decode attention reads over the run: a token generated at position p reads p + 1."""
    return sum(sum(range(len(w.prompt_ids), len(w.prompt_ids) + w.max_new_tokens - 1)) + w.max_new_tokens - 1
               for w in items)


def capacity_rows(model_dir: Path, block_size: int, fraction: float) -> list[dict]:
    cfg_model = load_quantized_model(model_dir)
    cfg = cfg_model.config
    items = bench_l5.make_workload(bench_l5.WORKLOAD_SHAPE, cfg.vocab_size, seed=0)
    budget = int(fraction * bench_l5.demand_blocks(items, block_size) * block_size * cfg.kv_bytes_per_token(4))
    tokenizer_free_calibration = [w.prompt_ids for w in items[:4]]
    rows = []
    for pool in ("float32", "bfloat16", "fp8", "int8"):
        itemsize = {"float32": 4, "bfloat16": 2}.get(pool, 1)
        per_block = block_size * cfg.kv_bytes_per_token(itemsize)
        num_blocks = budget // per_block
        oracle = None
        if pool in FORMATS:
            model = cfg_model
            scales = calibrate(model, tokenizer_free_calibration, FORMATS[pool], "head", block_size)
            oracle = QuantizingCache(pool, scales.k, scales.v)
            make = lambda: make_quantized_engine(model, scales, num_blocks, block_size, prefix_sharing=False)  # noqa: E731
        else:
            model = cfg_model if pool == "float32" else load_quantized_model(model_dir, torch.bfloat16)
            make = lambda: make_engine(model, num_blocks, block_size)  # noqa: E731
        hf_model = hf.load_hf_model(str(model_dir), "cpu", model.dtype)
        make().run(items[:4])  # warm-up
        engine = make()
        start = time.perf_counter()
        done = engine.run(items)
        seconds = time.perf_counter() - start
        tokens = sum(w.max_new_tokens for w in items)
        s = engine.summary()
        rows.append({"pool": pool, "model": "bfloat16" if pool == "bfloat16" else "float32",
                     "bytes / block": per_block, "blocks": num_blocks,
                     "most running": max(r.running for r in engine.timeline),
                     "preemptions": s["preempted_recompute"] + s["preempted_swap"], "wall s": seconds,
                     "tokens/s": tokens / seconds,
                     "decode KV read MiB": decode_positions_read(items) * cfg.kv_bytes_per_token(itemsize) / 2**20,
                     "ids = oracle": f"{sum(done[i].output_ids == hf.hf_greedy(hf_model, w.prompt_ids, w.max_new_tokens, oracle) for i, w in enumerate(items))}/{len(items)}"})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_at_start = load_average()
    model_dir = args.model_dir
    accuracy = accuracy_rows(model_dir, args.block_size)
    print_table(accuracy, ACCURACY_COLUMNS)
    capacity = capacity_rows(model_dir, args.block_size, args.budget_fraction)
    print_table(capacity, CAPACITY_COLUMNS)
    if args.json:
        import json
        write_text_atomic(args.json, json.dumps({"accuracy": accuracy, "capacity": capacity}, indent=2))
    if args.markdown:
        text = (f"## L12: a quantized KV cache, accuracy and capacity\n\n{machine_line(torch.get_num_threads(), load_at_start)}\n\n"
                f"`{bench_command('bench_l12.py', sys.argv[1:] if argv is None else argv)}` on {model_dir.name}.\n\n"
                f"**Accuracy** against the float32 pool, teacher-forced over {accuracy[0]['positions']} positions of "
                "held-out King James text (assets/kjv-heldout.txt), scales calibrated on assets/kjv-calibration.txt; "
                "ids = oracle: the quantized engine's greedy ids (from each passage's first "
                f"{GREEDY_PROMPT} tokens, {GREEDY_TOKENS} new) equal HF's Qwen3 running a cache that quantizes the "
                "same way.\n\n"
                + markdown_table(accuracy, ACCURACY_COLUMNS)
                + f"\n\n**Capacity**: bench_l5's workload (32 requests, all at step 0) in one memory budget, "
                f"{args.budget_fraction:g} of what the requests need together in float32; preemption by recompute; "
                "per-head calibrated scales (on the first 4 prompts); ids = oracle: requests whose greedy ids equal "
                "HF's in the pool's terms (float32: HF in float32; bfloat16: HF in bfloat16, where two correct "
                "runs may part at a near tie; fp8, int8: HF with the quantizing cache and the same scales).\n\n"
                + markdown_table(capacity, CAPACITY_COLUMNS))
        replace_section(args.markdown, "bench_l12", text)
    return 0 if all(r["ids = oracle"] == "yes" for r in accuracy) else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
