#!/usr/bin/env python3
"""The L5 engine beside llama.cpp and HF: one request decoding alone, and 32 requests at once.

A practitioner serving a small model on a CPU would reach for llama.cpp. This runs it, through
llama-cpp-python, on the same weights (converted by llama.cpp's own convert_hf_to_gguf.py, in F32
and in F16 with an F16 KV cache) and the same work as the course's engine and HF:

  batch-1 decode      one request of 32 prompt tokens (random ids, fixed seed) decodes --new
                      tokens; tok/s of its decode steps, the prompt's step left out (HF's
                      `generate` timed by a logits processor); the median step of a run, the
                      best of three runs in a round, the systems' runs alternating
  32-request mixed    bench_l5's workload (prompts 8-128 tokens, 8-64 new, all at once, EOS off):
                      generated tokens / wall seconds. The engine and llama.cpp step it alike:
                      every running request's decode, then up to 256 prompt tokens, one forward
                      per step (llama.cpp: one llama_decode over its unified KV cache). HF batched
                      is one left-padded `generate`; HF continuous is transformers' own manager
                      (page size 16, the engine's pool, max_batch_tokens --hf-batch-tokens).

Rounds alternate the systems (load on a shared machine hits all alike); the best of --repeat is
kept. "ids = HF": requests whose ids equal HF's greedy ids.

llama.cpp is optional: `make peer` builds llama-cpp-python (4 to 15 minutes on 2 cores) and
unpacks its llama.cpp tree for the converter; without it the llama.cpp rows say why.

    python scripts/bench_peer.py                                   # the embedded model, 2 threads
    python scripts/bench_peer.py --markdown docs/benchmarks.md
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_l5's workload, bench_step's decode timing

from harness.cli import OneLineParser, guard_startup, run_main  # noqa: E402

guard_startup()

import torch  # noqa: E402

import bench_l5  # noqa: E402
import bench_step  # noqa: E402
from harness import hf_reference as hf  # noqa: E402
from harness import llama_peer  # noqa: E402
from harness.benchmark import (bench_command, hf_continuous_config, hf_generate, load_average, machine_line,  # noqa: E402
                               markdown_table, print_table, replace_section, serve_engine, serve_hf_continuous)
from harness.smoke import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from l1_contiguous import load_config  # noqa: E402
from l5_eviction import DEFAULT_PREFILL_CHUNK, load_engine_model, make_engine  # noqa: E402

RUNS_ALONE = 3  # batch-1 runs per system and round, alternating, the best kept
SYSTEMS = ["L5 engine", "llama.cpp F32 (KV f32)", "llama.cpp F16 (KV f16)", "HF batched generate",
           "HF continuous batching"]
COLUMNS = ["system", "mixed tok/s", "mixed x HF CB", "mixed ids = HF", "batch-1 tok/s", "batch-1 x HF",
           "batch-1 ids = HF"]


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format model folder (default: the embedded model)")
    p.add_argument("--new", type=int, default=64, help="tokens the batch-1 request decodes (default 64)")
    p.add_argument("--requests", type=int, default=bench_l5.WORKLOAD_SHAPE.requests,
                   help=f"requests of the mixed workload (default {bench_l5.WORKLOAD_SHAPE.requests})")
    p.add_argument("--repeat", type=int, default=3, help="rounds, best kept (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads for every system (default 2)")
    p.add_argument("--hf-batch-tokens", type=int, default=1024,
                   help="HF continuous max_batch_tokens (default 1024, bench_l5's sweep's pick on the embedded model)")
    p.add_argument("--llama-cpp", default=str(llama_peer.DEFAULT_LLAMA_CPP),
                   help="a llama.cpp source tree, for its converter (default: .peer/llama.cpp, made by `make peer`)")
    p.add_argument("--markdown", metavar="PATH", default=None, help="rewrite the `bench_peer` section of PATH")
    args = p.parse_args(argv)
    for name in ("new", "requests", "repeat", "threads", "hf_batch_tokens"):
        if getattr(args, name) < (2 if name == "new" else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'new' else 1}")
    return args


class Peers:
    """llama.cpp's two set-ups on one model, or why there are none."""

    def __init__(self, model_dir: Path, llama_cpp_dir: Path, threads: int, n_ctx: int, tmp: Path):
        self.why_not = llama_peer.available()
        self.peers = {}
        if self.why_not:
            return
        try:
            for name, kind in ((SYSTEMS[1], "f32"), (SYSTEMS[2], "f16")):
                gguf = llama_peer.convert(model_dir, tmp / f"model-{kind}.gguf", kind, llama_cpp_dir)
                self.peers[name] = llama_peer.LlamaCppPeer(gguf, kv=kind, threads=threads, n_ctx=n_ctx)
        except (FileNotFoundError, RuntimeError) as exc:
            self.why_not = str(exc)

    def close(self):
        for peer in self.peers.values():
            peer.close()


def run_round(model, hf_model, peers: Peers, items, prompt, args, results: dict) -> None:
    """Every system once on both workloads; results[system] collects (mixed tok/s, mixed ids,
    batch-1 tok/s, batch-1 ids). The batch-1 runs alternate the systems run by run, so that each
    system's best meets the machine in the same state as the others'."""
    demand = bench_l5.demand_blocks(items, 16)
    tokens = sum(w.max_new_tokens for w in items)

    def make():
        engine = make_engine(model, demand, 16, prefill_chunk=DEFAULT_PREFILL_CHUNK)
        engine.eos_ids = set()
        return engine
    served = serve_engine(make, items, [0.0] * len(items))
    mixed = {SYSTEMS[0]: (served.ids, served.serve_s)}  # system -> (ids, seconds)
    for name, peer in peers.peers.items():
        mixed[name] = peer.serve(items, DEFAULT_PREFILL_CHUNK)
    start = time.perf_counter()
    outs = hf_generate(hf_model, [w.prompt_ids for w in items], max(w.max_new_tokens for w in items), batched=True)
    mixed[SYSTEMS[3]] = [o[:w.max_new_tokens] for o, w in zip(outs, items)], time.perf_counter() - start
    config = hf_continuous_config(16, demand, args.hf_batch_tokens, block_sharing=False)
    served = serve_hf_continuous(hf_model, items, [0.0] * len(items), config)
    mixed[SYSTEMS[4]] = served.ids, served.serve_s

    alone_runs = {SYSTEMS[0]: lambda: bench_step.decode_steps(model, [prompt], args.new),
                  **{name: (lambda peer=peer: peer.decode_alone(prompt, args.new)[::-1])
                     for name, peer in peers.peers.items()},
                  SYSTEMS[3]: lambda: bench_step.hf_decode_run(hf_model, [prompt], args.new)}
    alone = {name: [] for name in alone_runs}  # system -> [(median step seconds, ids)] per run
    for _ in range(RUNS_ALONE):
        for name, run in alone_runs.items():
            alone[name].append(run())
    for name, (ids, seconds) in mixed.items():
        step_s, alone_ids = min(alone[name], key=lambda run: run[0]) if name in alone else (None, None)
        results[name].append((tokens / seconds, ids, 1 / step_s if step_s else None, alone_ids))


def rows_of(results: dict, why_not: str | None) -> list[dict]:
    """Best round per system and column; ratios to HF continuous (mixed) and HF generate (batch 1)."""
    best = {name: (max(r[0] for r in runs), runs[0][1], max((r[2] or 0) for r in runs) or None, runs[0][3])
            for name, runs in results.items() if runs}
    hf_mixed, hf_one = best[SYSTEMS[3]][1], best[SYSTEMS[3]][3]
    cb, one = best[SYSTEMS[4]][0], best[SYSTEMS[3]][2]
    rows = []
    for name in SYSTEMS:
        if name not in best:
            rows.append({"system": name, "mixed tok/s": f"not run: {why_not}"})
            continue
        mixed, mixed_ids, alone, alone_ids = best[name]
        rows.append({"system": name, "mixed tok/s": mixed, "mixed x HF CB": mixed / cb,
                     "mixed ids = HF": f"{sum(a == b for a, b in zip(mixed_ids, hf_mixed))}/{len(hf_mixed)}",
                     "batch-1 tok/s": alone, "batch-1 x HF": alone / one if alone and one else None,
                     "batch-1 ids = HF": None if alone_ids is None else alone_ids == hf_one})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_at_start = load_average()
    model_dir = resolve_model_dir(args.model)
    cfg = load_config(model_dir)
    shape = bench_l5.Shape(args.requests, bench_l5.WORKLOAD_SHAPE.prompt_lens, bench_l5.WORKLOAD_SHAPE.output_lens)
    items = bench_l5.make_workload(shape, cfg.vocab_size, seed=0)
    prompt = bench_step.prompts(1, cfg.vocab_size)[0]
    model, hf_model = load_engine_model(model_dir), hf.load_hf_model(str(model_dir))
    n_ctx = sum(len(w.prompt_ids) + w.max_new_tokens for w in items) + 64
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        peers = Peers(model_dir, Path(args.llama_cpp), args.threads, n_ctx, Path(tmp))
        try:
            warm = items[:4]
            serve_engine(lambda: make_engine(model, bench_l5.demand_blocks(warm, 16), 16), warm, [0.0] * len(warm))
            for peer in peers.peers.values():
                peer.serve(warm)
            results = {name: [] for name in SYSTEMS}
            for round_ in range(1, args.repeat + 1):
                run_round(model, hf_model, peers, items, prompt, args, results)
                print(f"  round {round_}/{args.repeat} done", flush=True)
        finally:
            peers.close()
    rows = rows_of(results, peers.why_not)
    print_table(rows, COLUMNS, floatfmt=".2f")
    if args.markdown:
        command = bench_command("bench_peer.py", sys.argv[1:] if argv is None else argv)
        replace_section(args.markdown, "bench_peer", markdown(rows, command, load_at_start, args.threads, model_dir.name,
                                                              len(items)))
    engine = rows[0]
    return 0 if engine["mixed ids = HF"] == f"{len(items)}/{len(items)}" and engine["batch-1 ids = HF"] else 1


def markdown(rows, command, load_at_start, threads, model_name, requests) -> str:
    return (f"## The engine beside llama.cpp\n\n{machine_line(threads, load_at_start)}\n\n`{command}`; {model_name}. "
            f"Mixed: bench_l5's {requests} requests at once (prompts 8-128, 8-64 new, EOS off), generated tokens over wall "
            "seconds, ratio to HF's continuous batching. Batch 1: one request of 32 prompt tokens, the median of its "
            "decode steps (HF's `generate` timed by a logits processor), the best of three runs a round with the "
            "systems' runs alternating, ratio to HF's `generate`. llama.cpp through llama-cpp-python "
            f"{llama_peer.PEER_VERSION}, the weights converted by its own converter, stepped like the engine "
            "(decodes, then up to 256 prompt tokens, one llama_decode per step). Best of the rounds.\n\n"
            + markdown_table(rows, COLUMNS) + reading(rows))


def reading(rows: list[dict]) -> str:
    """What the table says, in its own numbers (nothing when llama.cpp did not run)."""
    by = {r["system"]: r for r in rows}
    ours, peer = by[SYSTEMS[0]], by[SYSTEMS[1]]
    if not isinstance(peer.get("mixed tok/s"), float):
        return ""
    return (f"\n\nOn the mixed workload the engine makes {ours['mixed tok/s'] / peer['mixed tok/s']:.2f}x "
            f"llama.cpp F32's tokens per second; alone, one request decodes at "
            f"{ours['batch-1 tok/s'] / peer['batch-1 tok/s']:.2f}x its speed ({1e3 / ours['batch-1 tok/s']:.2f} against "
            f"{1e3 / peer['batch-1 tok/s']:.2f} ms a token). Both read the same weights each step; what the engine "
            "adds at one request is its Python and its torch operations' dispatch (bench_step's phases), which "
            "llama.cpp's one compiled graph per step does not pay, and which a batch of 32 shares.")


if __name__ == "__main__":
    sys.exit(run_main(main, "nothing was written"))
