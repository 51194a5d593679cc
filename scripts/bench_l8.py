#!/usr/bin/env python3
"""L8 benchmark: many requests behind one long shared prefix, prefix sharing on vs off, in one run.

Workload (fixed seed): --requests requests (default 32), each a shared --prefix-len-token prefix
(default 256) followed by its own --tail-len-token tail (default 32), random ids from the model's
vocabulary. Request i arrives at step i, so every request after the first can find the prefix
cached; each makes exactly --max-new-tokens new tokens (EOS does not stop it, so both modes do the
same work). The pool is large enough that nothing is preempted.

Figures, per mode:
  prefill tokens computed   prompt tokens that went through the model (hits and forks excluded)
  TTFT                      time to first token of one request: the wall time from the start of
                            the engine step at which it arrives to the end of the step that
                            produced its first token; the table shows the mean over requests
  total                     wall time of the whole run (sum of its steps)
Each step is timed with harness.benchmark.timed (synchronized on CUDA). Every mode runs once
untimed, then --repeat times alternating with the other; the best run (least total) is kept.
On CPU the default is one torch thread: the embedded model is tiny, and on a busy 2-core machine
a second thread makes every parallel region wait for the other thread's time slice (runs with 2
threads there swung from 0.7x to 1.9x for the same comparison; with 1 they stay within 2.4-2.7x).

The ideal saving: the first request must compute the prefix, the other N - 1 can reuse it, so at
most (N - 1) * P / (N * (P + T)) of the prefill tokens are saved (86.1% for 32, 256, 32; P / (P + T)
= 88.9% is the saving for one request once the prefix is cached). Full blocks only are shared: a
prefix that is not a multiple of the block size saves a little less.

    python scripts/bench_l8.py                         # embedded model, cpu float32
    python scripts/bench_l8.py --requests 16 --prefix-len 512 --json bench_l8.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from harness.benchmark import bench_parser, print_table, timed  # noqa: E402
from harness.smoke import resolve_device, resolve_model_dir  # noqa: E402
from l1_contiguous import InputError, load_config  # noqa: E402
from l2_paged import blocks_needed  # noqa: E402
from l5_eviction import WorkItem, engine_backend, load_engine_model  # noqa: E402
from l8_prefix import make_prefix_engine  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__.split("\n\n")[0], repeat=3)
    p.add_argument("--requests", type=int, default=32, help="requests in the workload (default 32)")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens of the shared prefix (default 256)")
    p.add_argument("--tail-len", type=int, default=32, help="tokens of each request's own tail (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="new tokens per request (default 8)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's ids")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 on cpu, torch's choice on cuda); see the notes above")
    return p.parse_args(argv)


def check(args, cfg) -> None:
    for name in ("requests", "tail_len", "max_new_tokens", "block_size", "repeat"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise InputError(f"--threads must be at least 1, got {args.threads}")
    if args.prefix_len < 0:
        raise InputError(f"--prefix-len must be at least 0, got {args.prefix_len}")
    length = args.prefix_len + args.tail_len + args.max_new_tokens
    if length > cfg.max_position_embeddings:
        raise InputError(f"a request needs {length} positions; the model has {cfg.max_position_embeddings}")


def make_workload(args, vocab_size: int) -> list[WorkItem]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(vocab_size) for _ in range(args.prefix_len)]
    return [WorkItem(prefix + [rng.randrange(vocab_size) for _ in range(args.tail_len)], args.max_new_tokens,
                     arrival_step=i) for i in range(args.requests)]


def run_once(model, items: list[WorkItem], num_blocks: int, args, sharing: bool, backend: str) -> dict:
    """One run of the workload on a fresh engine; per-step wall times give each request's TTFT."""
    engine = make_prefix_engine(model, num_blocks, args.block_size, prefix_sharing=sharing, backend=backend)
    engine.eos_ids = set()  # exactly max_new_tokens each, in both modes
    for item in items:
        engine.add_request(item)
    step_s, first_token_step = [], {}
    with torch.inference_mode():
        while engine.has_unfinished():
            step = engine.now
            step_s.append(timed(engine.step, repeat=1, warmup=0, device=model.device).best)
            for r in engine.requests.values():
                if r.output_ids and r.request_id not in first_token_step:
                    first_token_step[r.request_id] = step
    ttft = [sum(step_s[r.arrival_step:first_token_step[i] + 1]) for i, r in engine.requests.items()]
    m = engine.metrics()
    return {"ids": [r.output_ids for r in engine.requests.values()],
            "prefill_tokens_computed": m["prefill_tokens_computed"], "prefill_tokens_total": m["prefill_tokens_total"],
            "prefix_hit_tokens": m["prefix_hit_tokens"], "hit_rate": m["hit_rate"],
            "blocks_peak_used": engine.alloc.peak_used, "ttft_mean_s": statistics.fmean(ttft),
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft), "total_s": sum(step_s),
            "steps": engine.now}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model_dir = resolve_model_dir(args.model)
        cfg = load_config(model_dir)
        device, dtype = resolve_device(args.device, args.dtype)
        check(args, cfg)
        if args.threads or device == "cpu":
            torch.set_num_threads(args.threads or 1)
        model = load_engine_model(model_dir, dtype, device)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    backend = engine_backend(device)
    items = make_workload(args, cfg.vocab_size)
    num_blocks = sum(blocks_needed(len(w.prompt_ids) + w.max_new_tokens, args.block_size) for w in items)
    n, p, t = args.requests, args.prefix_len, args.tail_len
    ideal = (n - 1) * (p // args.block_size * args.block_size) / (n * (p + t))
    header = {"model": str(model_dir), "device": device, "dtype": str(dtype).removeprefix("torch."),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "requests": n, "prefix_len": p, "tail_len": t,
              "max_new_tokens": args.max_new_tokens, "block_size": args.block_size, "pool_blocks": num_blocks,
              "repeat": args.repeat, "backend": backend}
    print(" · ".join(f"{key} {value}" for key, value in header.items()))

    runs = {True: [], False: []}
    for sharing in (True, False):  # untimed warm-up of each mode
        run_once(model, items[:2], num_blocks, args, sharing, backend)
    for _ in range(args.repeat):
        for sharing in (True, False):
            runs[sharing].append(run_once(model, items, num_blocks, args, sharing, backend))
    best = {sharing: min(rs, key=lambda r: r["total_s"]) for sharing, rs in runs.items()}
    on, off = best[True], best[False]
    same_ids = on["ids"] == off["ids"]

    columns = ["sharing", "prefill tokens computed", "hit rate", "peak blocks", "TTFT mean ms",
               "TTFT median ms", "TTFT max ms", "total s"]

    def row(name, r):
        return {"sharing": name, "prefill tokens computed": r["prefill_tokens_computed"], "hit rate": r["hit_rate"],
                "peak blocks": r["blocks_peak_used"], "TTFT mean ms": 1e3 * r["ttft_mean_s"],
                "TTFT median ms": 1e3 * r["ttft_median_s"], "TTFT max ms": 1e3 * r["ttft_max_s"],
                "total s": r["total_s"]}

    rows = [row("on", on), row("off", off)]
    rows.append({c: (rows[1][c] / rows[0][c] if rows[0][c] else None) for c in columns[1:]} | {"sharing": "off / on"})
    rows[2]["hit rate"] = None
    print()
    print_table(rows, columns, floatfmt=".2f")
    saved = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    speedup = off["ttft_mean_s"] / on["ttft_mean_s"]
    print(f"\nprefill tokens saved: {saved:.1%} (ideal (N-1)·P/(N·(P+T)) with full blocks: {ideal:.1%}) -> "
          f"{'target met' if saved >= ideal - 1e-9 else 'TARGET MISSED'}")
    print(f"TTFT mean speed-up: {speedup:.2f}x (target >= 2x) -> {'target met' if speedup >= 2 else 'TARGET MISSED'}")
    print(f"same ids with sharing on and off: {same_ids}")
    if args.json:
        result = {**header, "same_ids": same_ids, "prefill_saved": saved, "prefill_saved_ideal": ideal,
                  "ttft_speedup": speedup,
                  "modes": {"on": {k: v for k, v in on.items() if k != "ids"},
                            "off": {k: v for k, v in off.items() if k != "ids"}}}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
