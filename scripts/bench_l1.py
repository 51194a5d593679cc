#!/usr/bin/env python3
"""L1 benchmark: prefill and decode tokens/s of our L1 (contiguous cache) and of HF `generate`.

Both sides run the same prompts, one request at a time, on the same device and dtype, and make
exactly --max-new-tokens tokens each (EOS does not stop them). Prefill and decode are separated as
in harness/benchmark.py: prefill = a 1-token run, decode step = (N-token run - prefill) / (N - 1),
best of --repeat runs, the engines taking turns so that a busy spell on a shared machine hits all
alike. The header prints the load average: figures taken under load are noise, not a comparison.
A last column shows HF `generate` with all prompts in one left-padded batch, for reference: L1
serves one request at a time, and that column is what batching (L2 onwards) is after.

    python scripts/bench_l1.py                      # embedded model, cpu float32
    python scripts/bench_l1.py --max-new-tokens 64 --repeat 5 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import guard_startup, run_main  # noqa: E402

guard_startup()  # Ctrl-C while torch loads: one line, exit 2 (run_main takes over for the work)

import torch  # noqa: E402

from harness import hf_reference as hf  # noqa: E402
from harness.benchmark import check_bench_args, write_text_atomic, bench_parser, compare_phases, cpu_name, hf_generate, print_table, tokens_per_s  # noqa: E402
from harness.smoke import resolve_model  # noqa: E402
from l1_contiguous import ContiguousKvCache, InputError, Qwen3ForCausalLM, greedy_generate  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__.split("\n\n")[0], repeat=3)
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt (>= 2)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--num-prompts", type=int, default=3, help="how many prompts")
    args = check_bench_args(p.parse_args(argv), p)
    if args.max_new_tokens < 2:
        p.error(f"--max-new-tokens must be at least 2 (a prefill and a decode step to time), got {args.max_new_tokens}")
    return args


def make_prompts(num: int, length: int, vocab_size: int) -> list[list[int]]:
    """Fixed pseudo-random ids: timing does not depend on which tokens they are."""
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def ours_runner(model: Qwen3ForCausalLM, prompts: list[list[int]]):
    """run(n): greedy_generate n tokens for each prompt in turn, with a fresh contiguous cache."""
    def run(n: int) -> list[list[int]]:
        outs = []
        for p in prompts:
            cache = ContiguousKvCache(model.config, len(p) + n, model.dtype, model.device)
            outs.append(greedy_generate(model, p, n, cache, stop_ids=(), keep_prompt_logits=False).new_ids)
        return outs
    return run


def _round(value: float, digits: int | None = None):
    """Rounded for the table; None (shown as n/a) when not measurable."""
    return None if math.isnan(value) else round(value, digits)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model_dir, cfg, device, dtype = resolve_model(args)
        if args.max_new_tokens < 2:
            raise InputError("--max-new-tokens must be at least 2 (prefill + at least one decode step)")
        if args.prompt_len < 1 or args.num_prompts < 1 or args.repeat < 1:
            raise InputError("--prompt-len, --num-prompts and --repeat must be at least 1")
        if args.prompt_len + args.max_new_tokens > cfg.max_position_embeddings:
            raise InputError(f"--prompt-len + --max-new-tokens exceeds the model's "
                             f"{cfg.max_position_embeddings} positions")
        ours = Qwen3ForCausalLM.from_pretrained(model_dir, dtype, device)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import transformers

    theirs = hf.load_hf_model(str(model_dir), device, dtype)
    prompts = make_prompts(args.num_prompts, args.prompt_len, cfg.vocab_size)
    n, k = args.max_new_tokens, len(prompts)
    header = {
        "model": str(model_dir), "device": device, "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "cpu": cpu_name(), "cores": os.cpu_count(),
        "load": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "prompts": k, "prompt_len": args.prompt_len, "max_new_tokens": n, "repeat": args.repeat,
    }
    print(" · ".join(f"{key} {value}" for key, value in header.items()))

    with torch.inference_mode():
        run_ours = ours_runner(ours, prompts)
        same_ids = run_ours(n) == hf_generate(theirs, prompts, n)
        times = compare_phases({"L1": run_ours,
                                "HF": lambda m: hf_generate(theirs, prompts, m),
                                "HF batched": lambda m: hf_generate(theirs, prompts, m, batched=True)},
                               n, args.repeat, device=device)
    t_ours, t_hf, t_batch = times["L1"], times["HF"], times["HF batched"]

    prefill_tokens = sum(len(p) for p in prompts)
    rows = []
    for phase, tokens, pick in (("prefill", prefill_tokens, lambda t: t.prefill_s),
                                ("decode", k, lambda t: t.decode_s_per_step)):
        ours_tps, hf_tps = tokens_per_s(tokens, pick(t_ours)), tokens_per_s(tokens, pick(t_hf))
        rows.append({"phase": phase, "L1 tok/s": _round(ours_tps), "HF tok/s": _round(hf_tps),
                     "L1/HF": _round(ours_tps / hf_tps, 2),
                     "HF batched tok/s": _round(tokens_per_s(tokens, pick(t_batch)))})
    print_table(rows, floatfmt=".2f")
    ms = {name: 1000 * t.decode_s_per_step / k for name, t in (("L1", t_ours), ("HF", t_hf))}
    print(f"decode: L1 {ms['L1']:.2f} ms/token, HF {ms['HF']:.2f} ms/token (one request at a time)")
    if any(math.isnan(t.decode_s_per_step) for t in times.values()):
        print("n/a: an N-token run was no slower than a 1-token run (a busy machine); "
              "raise --repeat or --max-new-tokens")
    print(f"same greedy ids as HF: {'yes' if same_ids else 'no'}")
    if args.json:
        write_text_atomic(args.json, json.dumps({**header, "same_ids": same_ids, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
