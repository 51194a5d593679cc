#!/usr/bin/env python3
"""L13 benchmark: what one block table per KV cache group saves on hybrid models.

Arithmetic (the course's own blocks_at_peak and the grouped pool's bytes per block, no run): the KV
one request holds at its peak, at several context lengths, for Qwen3-0.6B's shape in bfloat16 as
full attention and as two hybrids (every other layer sliding; 24 of 28 layers sliding, as Gemma 3's
five-to-one pattern comes closest), with a window of 1024, and how many such requests fit in 8 GiB.

Measured (the embedded model, float32; 16 requests of 200-400 random prompt tokens and 32-64 new,
all at step 0): the same workload through L8's engine on the full-attention model and through
L13's on its hybrid (layers 0 and 2 with a window of 64), first in a pool large enough for all
(peak KV bytes), then in one memory budget, half of what full attention needs at its peak (the
most requests running at once, preemptions). Every request's ids are compared with HF's on the
matching config.

Prefix hits (the embedded model as the hybrid): 8 conversations of two turns; the second turn is
the first one's prompt, its answer and 20 new tokens, arriving after the first has finished. Hit
rate (prompt tokens found cached over prompt tokens) under the hybrid rule and under the rule of a
cache that asks for every block of every group, with blocks behind the window forgotten (the
default) or kept.

Run on the 0.6B shape (`--shape-0.6b`, for a GPU: a random model with Qwen3-0.6B's config, about
2.4 GB of float32 weights): the measured workload with 8 requests of 3000-4000 random prompt
tokens and 64-96 new, full attention against every other layer sliding with W 1024, in a pool
that fits all and in half of full attention's peak bytes; ids compared with HF's on each config.

    python scripts/bench_l13.py                                  # the tables, printed
    python scripts/bench_l13.py --markdown docs/benchmarks.md    # rewrite its section there
    python scripts/bench_l13.py --shape-0.6b --device cuda --dtype float32   # the run on the 0.6B shape
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import guard_startup, run_main  # noqa: E402

guard_startup()

import torch  # noqa: E402

from harness import hf_reference as hf  # noqa: E402
from harness.benchmark import (bench_command, bench_parser, check_bench_args, checked_device, checked_model,  # noqa: E402
                               load_average, machine_line, markdown_table, print_table, replace_section,
                               write_text_atomic)
from harness.tiny_models import EMBEDDED_HYBRID_LAYER_TYPES, EMBEDDED_HYBRID_WINDOW, as_hybrid, make_random_model  # noqa: E402
from l1_contiguous import Qwen3Config, load_config  # noqa: E402
from l5_eviction import DEFAULT_PREFILL_CHUNK, WorkItem, load_engine_model  # noqa: E402
from l8_prefix import make_prefix_engine  # noqa: E402
from l13_sliding_window import (GroupedKvPool, blocks_at_peak, kv_cache_groups, layer_slots, load_hybrid_model,  # noqa: E402
                                make_hybrid_engine)

QWEN3_0_6B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
WINDOW_0_6B = 1024
CONTEXTS = (4096, 32768)
BUDGET = 8 * 2**30
ARITHMETIC_COLUMNS = ["model", "sliding layers", "groups x layers", "context", "KV per request MiB",
                      "of full attention", "requests in 8 GiB"]
MEASURED_COLUMNS = ["model", "pool", "blocks", "bytes / block", "peak blocks", "peak KV MiB", "most running",
                    "preemptions", "ids = HF"]
HIT_COLUMNS = ["hit rule", "blocks behind the window", "prompt tokens", "found cached", "hit rate", "ids = HF"]


def parse_args(argv=None):
    """The options, checked at the door. No --repeat (nothing is timed); --device and --dtype choose
    where --shape-0.6b runs (the other tables are CPU float32 figures)."""
    p = bench_parser(__doc__.split("\n\n")[0], repeat=None)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16; at most the model's positions)")
    p.add_argument("--markdown", metavar="PATH", default=None, help="rewrite the `bench_l13` section of PATH")
    p.add_argument("--shape-0.6b", dest="shape_06b", action="store_true",
                   help="only the run on a random model of Qwen3-0.6B's shape (meant for a GPU; --device and "
                        "--dtype apply to it)")
    args = check_bench_args(p.parse_args(argv), p)
    if not args.shape_06b and (args.device not in (None, "cpu") or args.dtype not in (None, "float32")):
        p.error("--device and --dtype choose where --shape-0.6b runs; the other tables are CPU float32 figures: "
                "add --shape-0.6b or drop them")
    args.model_dir, _ = checked_model(args)
    args.run_on = checked_device(args) if args.shape_06b else ("cpu", torch.float32)
    return args


def arithmetic_rows(block_size: int) -> list[dict]:
    layouts = [("full attention", ()), ("every other layer", tuple(range(0, 28, 2))),
               ("24 of 28 (Gemma 3-like)", tuple(i for i in range(28) if i % 7 != 6))]
    rows, full = [], {}
    for name, sliding in layouts:
        raw = {**QWEN3_0_6B, "use_sliding_window": bool(sliding), "sliding_window": WINDOW_0_6B,
               "layer_types": ["sliding_attention" if i in sliding else "full_attention" for i in range(28)]}
        cfg = Qwen3Config.from_dict(raw)
        groups = kv_cache_groups(cfg)
        per_block = GroupedKvPool.bytes_per_block(cfg, block_size, torch.bfloat16)
        for context in CONTEXTS:
            need = blocks_at_peak(groups, context, block_size, DEFAULT_PREFILL_CHUNK) * per_block
            full.setdefault(context, need)
            rows.append({"model": f"Qwen3-0.6B shape, {name}", "sliding layers": len(sliding),
                         "groups x layers": f"{len(groups)} x {layer_slots(groups)}", "context": context,
                         "KV per request MiB": need / 2**20, "of full attention": f"{100 * need / full[context]:.0f}%",
                         "requests in 8 GiB": BUDGET // need})
    return rows


def workload(vocab: int, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed)
    return [WorkItem([rng.randrange(vocab) for _ in range(rng.randint(200, 400))], rng.randint(32, 64))
            for _ in range(16)]


def engine_run(kind: str, model_dir: Path, num_blocks: int, block_size: int, items, device="cpu",
               dtype=torch.float32):
    if kind == "hybrid":
        engine = make_hybrid_engine(load_hybrid_model(model_dir, dtype, device), num_blocks, block_size,
                                    prefix_sharing=False)
    else:
        engine = make_prefix_engine(load_engine_model(model_dir, dtype, device), num_blocks, block_size,
                                    prefix_sharing=False)
    done = engine.run(items)
    return engine, [done[i].output_ids for i in range(len(items))]


def measured_rows(full_dir: Path, hybrid_dir: Path, block_size: int, items=None, device="cpu",
                  dtype=torch.float32, window: int = EMBEDDED_HYBRID_WINDOW) -> list[dict]:
    cfg = load_config(full_dir)
    items = items or workload(cfg.vocab_size)
    dirs = {"full attention": full_dir, f"hybrid (window {window})": hybrid_dir}
    per_block = {name: GroupedKvPool.bytes_per_block(load_config(d), block_size, dtype) for name, d in dirs.items()}
    expected = {name: [hf.hf_greedy(hf.load_hf_model(str(d), device, dtype), w.prompt_ids, w.max_new_tokens)
                       for w in items] for name, d in dirs.items()}
    rows, full_peak_bytes = [], None
    for pool in ("all fit", "half of full's peak"):
        for name, d in dirs.items():
            kind = "hybrid" if "hybrid" in name else "full"
            if pool == "all fit":
                num_blocks = sum(blocks_at_peak(kv_cache_groups(load_config(d)), len(w.prompt_ids) + w.max_new_tokens,
                                                block_size, DEFAULT_PREFILL_CHUNK) for w in items)
            else:
                num_blocks = full_peak_bytes // 2 // per_block[name]
            engine, ids = engine_run(kind, d, num_blocks, block_size, items, device, dtype)
            s = engine.summary()
            if pool == "all fit" and kind == "full":
                full_peak_bytes = s["blocks_peak_used"] * per_block[name]
            rows.append({"model": name, "pool": pool, "blocks": num_blocks, "bytes / block": per_block[name],
                         "peak blocks": s["blocks_peak_used"], "peak KV MiB": s["blocks_peak_used"] * per_block[name] / 2**20,
                         "most running": max(r.running for r in engine.timeline),
                         "preemptions": s["preempted_recompute"] + s["preempted_swap"],
                         "ids = HF": f"{sum(a == b for a, b in zip(ids, expected[name]))}/{len(items)}"})
    return rows


def shape_06b_rows(block_size: int, device: str, dtype, tmp: Path, shape=None, window: int = WINDOW_0_6B,
                   num_requests: int = 8, prompt_tokens=(3000, 4000), new_tokens=(64, 96)) -> list[dict]:
    """`measured_rows` on a random model of `shape` (default Qwen3-0.6B's) and its hybrid, every
    other layer sliding with `window`."""
    shape = {k: v for k, v in (shape or QWEN3_0_6B).items() if k != "model_type"}
    layers = shape["num_hidden_layers"]
    longest = prompt_tokens[1] + new_tokens[1]
    full_dir = make_random_model(tmp / "full-0.6b", hf_init=False, max_position_embeddings=longest, **shape)
    hybrid_dir = as_hybrid(full_dir, tmp / "hybrid-0.6b", window,
                           ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    rng = random.Random(2)
    items = [WorkItem([rng.randrange(shape["vocab_size"]) for _ in range(rng.randint(*prompt_tokens))],
                      rng.randint(*new_tokens)) for _ in range(num_requests)]
    return measured_rows(full_dir, hybrid_dir, block_size, items, device, dtype, window)


def hit_rows(hybrid_dir: Path, block_size: int) -> list[dict]:
    model, oracle = load_hybrid_model(hybrid_dir), hf.load_hf_model(str(hybrid_dir))
    rng = random.Random(1)
    firsts = [WorkItem([rng.randrange(model.config.vocab_size) for _ in range(rng.randint(60, 160))], 40)
              for _ in range(8)]
    rows = []
    for rule, keep in (("hybrid", False), ("all blocks", False), ("hybrid", True), ("all blocks", True)):
        engine = make_hybrid_engine(model, 400, block_size, hybrid_hit_rule=rule == "hybrid", keep_behind_window=keep)
        done = engine.run(firsts)
        follow_ups = [random.Random(100 + i).choices(range(model.config.vocab_size), k=20) for i in range(len(firsts))]
        engine.run([WorkItem(done[i].tokens + follow_ups[i], 40, arrival_step=engine.now + i)
                    for i in range(len(firsts))])
        c = engine.prefix
        equal = sum(r.output_ids == hf.hf_greedy(oracle, r.prompt_ids, r.max_new_tokens) for r in engine.requests.values())
        rows.append({"hit rule": rule, "blocks behind the window": "kept" if keep else "forgotten",
                     "prompt tokens": c.prefill_tokens_total, "found cached": c.prefix_hit_tokens,
                     "hit rate": f"{100 * c.prefix_hit_tokens / c.prefill_tokens_total:.1f}%",
                     "ids = HF": f"{equal}/{len(engine.requests)}"})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.shape_06b:
        device, dtype = args.run_on
        with tempfile.TemporaryDirectory(prefix="l13-bench-0.6b-") as tmp:
            rows = shape_06b_rows(args.block_size, device, dtype, Path(tmp))
        print(f"Qwen3-0.6B's shape, random weights, {device} {dtype}, block size {args.block_size}, "
              f"window {WINDOW_0_6B} on every other layer; 8 requests of 3000-4000 + 64-96 tokens")
        print_table(rows, MEASURED_COLUMNS)
        if args.json:
            import json
            write_text_atomic(args.json, json.dumps({"shape_0.6b": rows}, indent=2))
        return 0 if all(r["ids = HF"].split("/")[0] == r["ids = HF"].split("/")[1] for r in rows) else 1
    load_at_start = load_average()
    full_dir = args.model_dir
    with tempfile.TemporaryDirectory(prefix="l13-bench-") as tmp:
        hybrid_dir = as_hybrid(full_dir, Path(tmp), EMBEDDED_HYBRID_WINDOW, EMBEDDED_HYBRID_LAYER_TYPES)
        arithmetic = arithmetic_rows(args.block_size)
        print_table(arithmetic, ARITHMETIC_COLUMNS)
        measured = measured_rows(full_dir, hybrid_dir, args.block_size)
        print_table(measured, MEASURED_COLUMNS)
        hits = hit_rows(hybrid_dir, args.block_size)
        print_table(hits, HIT_COLUMNS)
    if args.json:
        import json
        write_text_atomic(args.json, json.dumps({"arithmetic": arithmetic, "measured": measured, "hits": hits}, indent=2))
    if args.markdown:
        text = (f"## L13: hybrid models, one block table per KV cache group\n\n"
                f"{machine_line(torch.get_num_threads(), load_at_start)}\n\n"
                f"`{bench_command('bench_l13.py', sys.argv[1:] if argv is None else argv)}` on {full_dir.name}.\n\n"
                f"**KV one request holds at its peak**, by the course's arithmetic (`blocks_at_peak` and the grouped "
                f"pool's bytes per block; block size {args.block_size}, prefill chunk {DEFAULT_PREFILL_CHUNK}, "
                f"bfloat16, window {WINDOW_0_6B}), and how many such requests 8 GiB holds:\n\n"
                + markdown_table(arithmetic, ARITHMETIC_COLUMNS)
                + "\n\n**Measured** on the embedded model (float32): 16 requests of 200-400 random prompt tokens and "
                "32-64 new, all at step 0, through L8's engine (full attention) and L13's (the hybrid: layers 0 and 2 "
                "with a window of 64); first a pool that fits everything, then one memory budget, half of full "
                "attention's peak bytes; ids = HF on the matching config.\n\n"
                + markdown_table(measured, MEASURED_COLUMNS)
                + "\n\n**Prefix hits** on the hybrid: 8 conversations of two turns (60-160 random prompt tokens, 40 "
                "new; the second turn adds 20 tokens after the first turn's answer and arrives after it finished).\n\n"
                + markdown_table(hits, HIT_COLUMNS))
        replace_section(args.markdown, "bench_l13", text)
    return 0 if all(r["ids = HF"].split("/")[0] == r["ids = HF"].split("/")[1] for r in measured + hits) else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
