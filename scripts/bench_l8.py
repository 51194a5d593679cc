#!/usr/bin/env python3
"""L8 benchmark: requests behind one long shared prefix, prefix sharing on vs off, against HF's continuous batching.

Workload (fixed seed): --requests requests (default 32), each a shared --prefix-len-token prefix
(default 256) followed by its own --tail-len-token tail (default 32), random ids from the model's
vocabulary, each making exactly --max-new-tokens new tokens (EOS off, so every system does the
same work). Two arrival patterns, on a wall clock shared by every system:
  burst       all requests handed over at once
  staggered   request i handed over i x --stagger-ms milliseconds after the first
The clock starts when the first request is handed over and stops at the last token of the last
request; TTFT of a request runs from its hand-over to its first token. Building an engine or
HF's manager (its KV cache included) and stopping it are timed apart (set-up, teardown).

Systems:
  L8 ...              this lesson's engine (default prefill budget 256 tokens per step; a request
                      whose prefix another is computing is held, at most 8 steps), sharing on/off;
                      on the burst also with no prefill cap (one forward for every arrival), with
                      and without the hold: "no cap, no hold" is the engine before in-batch sharing
  HF continuous ...   transformers' continuous batching manager (`init_continuous_batching`),
                      page size = our block size, num_blocks = our pool (ratio 1.0), block sharing
                      on/off like ours, max_batch_tokens the best of --hf-batch-tokens (a sweep,
                      one untimed run each, printed) unless a single value is given
Every system runs the workload once untimed, then --repeat rounds in turns (alternating, so load
coming and going on a shared machine hits all alike); the best round per system is reported, and
every request's ids are compared with HF's (sharing on) ones. "floor s": the sum over a system's
steps of max(bytes / read bandwidth, FLOPs / matmul rate), constants measured in the same run
(harness.benchmark); our engines' steps are recorded as they run, HF's are not visible and its
floor is that of our engine with the same sharing.

A Qwen3-0.6B-shaped random model with --layers-0.6b layers (default 4; weights made in-process,
nothing downloaded) runs the burst with --requests-0.6b requests (default 16), --repeat-0.6b rounds,
HF with the max_batch_tokens its sweep chose on the embedded model's burst.

On CPU the default is one torch thread: the embedded model is tiny, and on a busy 2-core machine a
second thread makes every parallel region wait for the other thread's time slice.

    python scripts/bench_l8.py                                   # embedded model + 0.6B shape
    python scripts/bench_l8.py --skip-0.6b --repeat 5 --json bench_l8.json
    python scripts/bench_l8.py --markdown docs/benchmarks.md     # rewrite its section there (make bench)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import guard_startup, run_main  # noqa: E402

guard_startup()  # Ctrl-C while torch loads: one line, exit 2 (run_main takes over for the work)

import torch  # noqa: E402

from harness import hf_reference as hf  # noqa: E402
from harness.benchmark import (check_bench_args, write_text_atomic, Machine, ModelCost, bench_command, bench_parser, best_of,  # noqa: E402
                               hf_continuous_config, load_average, machine_line, markdown_table, measure_machine,
                               parse_batch_tokens, print_table, record_steps, replace_section, serve_engine,
                               serve_hf_continuous)
from harness.smoke import resolve_model  # noqa: E402
from harness.tiny_models import QWEN3_0_6B, make_random_model  # noqa: E402
from l1_contiguous import InputError, load_config  # noqa: E402
from l2_paged import blocks_needed  # noqa: E402
from l5_eviction import DEFAULT_PREFILL_CHUNK, WorkItem, engine_backend, load_engine_model  # noqa: E402
from l8_prefix import make_prefix_engine  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = bench_parser(__doc__.split("\n\n")[0], repeat=3)
    p.add_argument("--requests", type=int, default=32, help="requests in the workload (default 32)")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens of the shared prefix (default 256)")
    p.add_argument("--tail-len", type=int, default=32, help="tokens of each request's own tail (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="new tokens per request (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="our block size = HF's page size (default 16)")
    p.add_argument("--stagger-ms", type=float, default=10.0,
                   help="staggered arrivals: milliseconds between two hand-overs (default 10)")
    p.add_argument("--hf-batch-tokens", default="auto",
                   help="HF max_batch_tokens: one value, comma-separated values to sweep, or auto "
                        "(default: sweep 256 + requests, 512, 1024)")
    p.add_argument("--skip-0.6b", dest="skip_06b", action="store_true", help="leave out the 0.6B-shaped model")
    p.add_argument("--layers-0.6b", dest="layers_06b", type=int, default=4,
                   help="layers of the Qwen3-0.6B-shaped random model (default 4 of its 28)")
    p.add_argument("--requests-0.6b", dest="requests_06b", type=int, default=16,
                   help="requests of its burst (default 16)")
    p.add_argument("--repeat-0.6b", dest="repeat_06b", type=int, default=1, help="its timed rounds (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's ids")
    p.add_argument("--cascade", choices=["auto", "off"], default="auto",
                   help="L4's cascade attention over the shared prefix in our engine: auto (the manager's "
                        "rule: 8 requests sharing 256 tokens) or off, to measure what it saves")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 on cpu, torch's choice on cuda); see the notes above")
    p.add_argument("--markdown", metavar="PATH", default=None,
                   help="also write the tables as the `bench_l8` section of the markdown file PATH")
    return check_bench_args(p.parse_args(argv), p)


def check(args, cfg) -> None:
    for name in ("requests", "tail_len", "max_new_tokens", "block_size", "repeat", "layers_06b", "requests_06b",
                 "repeat_06b"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise InputError(f"--threads must be at least 1, got {args.threads}")
    if args.prefix_len < 0 or args.stagger_ms < 0:
        raise InputError("--prefix-len and --stagger-ms must be at least 0")
    length = args.prefix_len + args.tail_len + args.max_new_tokens
    if length > cfg.max_position_embeddings:
        raise InputError(f"a request needs {length} positions; the model has {cfg.max_position_embeddings}")
    batch_tokens(args)


def batch_tokens(args, requests: int | None = None) -> list[int]:
    return parse_batch_tokens(args.hf_batch_tokens, [DEFAULT_PREFILL_CHUNK + (requests or args.requests), 512, 1024])


def make_workload(requests: int, args, vocab_size: int) -> list[WorkItem]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(vocab_size) for _ in range(args.prefix_len)]
    return [WorkItem(prefix + [rng.randrange(vocab_size) for _ in range(args.tail_len)], args.max_new_tokens)
            for _ in range(requests)]


# ---------------------------------------------------------------- the systems


def ours(model, num_blocks: int, args, backend: str, sharing: bool, **engine_kwargs):
    step_logs = []

    def make():
        engine = make_prefix_engine(model, num_blocks, args.block_size, prefix_sharing=sharing, backend=backend,
                                    **engine_kwargs)
        engine.eos_ids = set()  # exactly max_new_tokens each, as HF with EOS off
        engine.kv.cascade = args.cascade == "auto"
        step_logs.append(record_steps(engine))
        return engine

    def run(items, offsets):
        served = serve_engine(make, items, offsets)
        served.steps = step_logs.pop()
        return served
    return run


def theirs(model, num_blocks: int, args, sharing: bool, max_batch_tokens: int):
    config = hf_continuous_config(args.block_size, num_blocks, max_batch_tokens, sharing)
    return lambda items, offsets: serve_hf_continuous(model, items, offsets, config)


def sweep_hf(hf_model, num_blocks, args, items, offsets, candidates) -> dict[bool, tuple[int, list]]:
    """sharing -> (best max_batch_tokens, [(value, serve s, TTFT mean s)]); one run each."""
    best = {}
    for sharing in (True, False):
        tried = []
        for value in candidates:
            run = theirs(hf_model, num_blocks, args, sharing, value)(items, offsets)
            tried.append((value, run.serve_s, run.ttft_mean_s))
        best[sharing] = (min(tried, key=lambda t: t[1])[0], tried)
    return best


def time_rounds(systems: dict, items, offsets, repeat: int) -> dict:
    """Each system once untimed, then `repeat` rounds in turns; the best round (least serve time) of each."""
    for run in systems.values():
        run(items[:2], offsets[:2])
    best = {}
    for k in range(repeat):
        for name, run in systems.items():
            r = run(items, offsets)
            if name not in best or r.serve_s < best[name].serve_s:
                best[name] = r
        print(f"  round {k + 1}/{repeat} done", flush=True)
    return best


def floors(best: dict, cost: ModelCost, machine: Machine) -> dict[str, float]:
    """Each system's floor: its steps' (HF's, not visible, are those of our engine with the same sharing)."""
    out = {}
    for name, r in best.items():
        ours_like = "L8, sharing " + ("off" if "sharing off" in name else "on")
        steps = r.steps if r.steps is not None else best[ours_like].steps
        out[name] = cost.run_floor_s([shape for shape, _ in steps], machine)
    return out


def rows_for(best: dict, reference: str, tokens: int, floor: dict[str, float]) -> list[dict]:
    rows = []
    for name, r in best.items():
        e = r.engine
        hf_name = "HF continuous, sharing " + ("off" if "sharing off" in name else "on")
        row = {"system": name, "prefill tokens computed": e.metrics()["prefill_tokens_computed"] if e else None,
               "held": e.prefix.held_for_prefix if e else None, "serve s": r.serve_s,
               "tok/s": tokens / r.serve_s, "floor s": floor[name], "% of floor": 100 * floor[name] / r.serve_s,
               "TTFT mean ms": 1e3 * r.ttft_mean_s, "TTFT max ms": 1e3 * max(r.ttft_s),
               "set-up s": r.setup_s, "teardown s": r.teardown_s,
               "HF serve / this": best[hf_name].serve_s / r.serve_s if hf_name in best else None,
               "HF TTFT / this": best[hf_name].ttft_mean_s / r.ttft_mean_s if hf_name in best else None,
               "same ids as HF": f"{sum(a == b for a, b in zip(r.ids, best[reference].ids))}/{len(r.ids)}"}
        rows.append(row)
    return rows


COLUMNS = ["system", "prefill tokens computed", "held", "serve s", "tok/s", "floor s", "% of floor", "TTFT mean ms", "TTFT max ms",
           "set-up s", "teardown s", "HF serve / this", "HF TTFT / this", "same ids as HF"]


def bench_workload(label, our_model, hf_model, items, offsets, args, backend, repeat, burst: bool,
                   hf_batch_tokens: dict | None = None) -> dict:
    """One workload, every system. hf_batch_tokens: sharing -> HF's max_batch_tokens (default: sweep)."""
    num_blocks = sum(blocks_needed(len(w.prompt_ids) + w.max_new_tokens, args.block_size) for w in items)
    candidates = batch_tokens(args, len(items))
    if hf_batch_tokens:
        swept = {s: (value, []) for s, value in hf_batch_tokens.items()}
    elif len(candidates) > 1:
        swept = sweep_hf(hf_model, num_blocks, args, items, offsets, candidates)
    else:
        swept = {s: (candidates[0], []) for s in (True, False)}
    systems = {
        "L8, sharing on": ours(our_model, num_blocks, args, backend, True),
        "L8, sharing off": ours(our_model, num_blocks, args, backend, False),
        "HF continuous, sharing on": theirs(hf_model, num_blocks, args, True, swept[True][0]),
        "HF continuous, sharing off": theirs(hf_model, num_blocks, args, False, swept[False][0]),
    }
    if burst:
        systems["L8, sharing on, no prefill cap"] = ours(our_model, num_blocks, args, backend, True, prefill_chunk=None)
    before = measure_machine(our_model.config, our_model.dtype)
    best = time_rounds(systems, items, offsets, repeat)
    if burst:  # the engine before in-batch sharing: one giant forward, every request computes the prefix
        unshared = ours(our_model, num_blocks, args, backend, True, prefill_chunk=None, max_prefix_hold=0)
        best["L8, sharing on, no prefill cap, no hold (1 run)"] = unshared(items, offsets)
    machine = best_of(before, measure_machine(our_model.config, our_model.dtype))
    tokens = sum(w.max_new_tokens for w in items)
    rows = rows_for(best, "HF continuous, sharing on", tokens,
                    floors(best, ModelCost.of(our_model.config, our_model.dtype.itemsize), machine))
    hf_settings = {s: f"page_size {args.block_size}, num_blocks {num_blocks} (1.0x ours), max_batch_tokens "
                      f"{swept[s][0]}, allow_block_sharing {s}" for s in (True, False)}
    print(f"\n== {label}")
    for s, (value, tried) in swept.items():
        if tried:
            print(f"HF sweep, sharing {'on' if s else 'off'}: " + ", ".join(
                f"{v}: {t:.2f} s (TTFT {1e3 * f:.0f} ms)" for v, t, f in tried) + f" -> {value}")
    print_table(rows, COLUMNS, floatfmt=".2f")
    print(f"floor s: the sum over a system's steps of max(bytes / bandwidth, FLOPs / matmul rate), {machine.line()} "
          "(HF continuous: our engine's steps with the same sharing; its own are not visible)")
    return {"label": label, "machine": machine.line(), "pool_blocks": num_blocks, "hf_settings": hf_settings,
            "hf_batch_tokens": {s: value for s, (value, _) in swept.items()},
            "hf_sweep": {("on" if s else "off"): tried for s, (_, tried) in swept.items()}, "rows": rows}


def bench_model(label, model_dir, args, device, dtype, backend, requests, repeat, staggered: bool,
                hf_batch_tokens: dict | None = None) -> list[dict]:
    """The burst (the staggered arrivals too if `staggered`); extra L8 rows only when HF's budget is swept."""
    cfg = load_config(model_dir)
    our_model = load_engine_model(model_dir, dtype, device)
    hf_model = hf.load_hf_model(str(model_dir), device, dtype)
    items = make_workload(requests, args, cfg.vocab_size)
    results = [bench_workload(f"{label}: burst ({requests} requests at once)", our_model, hf_model, items,
                              [0.0] * requests, args, backend, repeat, burst=hf_batch_tokens is None,
                              hf_batch_tokens=hf_batch_tokens)]
    if staggered:
        offsets = [i * args.stagger_ms / 1e3 for i in range(requests)]
        results.append(bench_workload(f"{label}: staggered (one every {args.stagger_ms:g} ms)", our_model, hf_model,
                                      items, offsets, args, backend, repeat, burst=False))
    return results


def markdown(results: list[dict], args, command: str, load_at_start: str) -> str:
    p, t = args.prefix_len, args.tail_len
    out = ["## L8: prefix sharing, and HF's continuous batching", "",
           f"`{command}` — {machine_line(torch.get_num_threads(), load_at_start)}.", "",
           f"Workload: requests sharing a {p}-token prefix with their own {t}-token tails (random ids, seed "
           f"{args.seed}), {args.max_new_tokens} new tokens each, EOS off. Clock: first request handed over → last "
           "token; TTFT: hand-over → first token; set-up (engine or manager with its KV cache) and teardown "
           f"timed apart. Best of {args.repeat} alternating rounds ({args.repeat_06b} on the 0.6B shape) after an "
           "untimed run; the machine is shared, so ratios within a table are the meaningful figures. "
           "\"HF serve / this\" > 1: this system is faster than HF's continuous batching with the same sharing.", ""]
    for r in results:
        out += [f"### {r['label']}", "",
                f"HF settings: sharing on: {r['hf_settings'][True]}; sharing off: {r['hf_settings'][False]}.", ""]
        for mode, tried in r["hf_sweep"].items():
            if tried:
                out += [f"HF max_batch_tokens sweep, sharing {mode} (one run each): " + ", ".join(
                    f"{v} → {s:.2f} s" for v, s, _ in tried) + ".", ""]
        out += [markdown_table(r["rows"], COLUMNS), "",
                f"Floor constants measured in this run: {r['machine']}. HF continuous's floor is our engine's steps "
                "with the same sharing (its own steps are not visible); arrivals spread over time leave idle gaps "
                "that no floor counts.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model_dir, cfg, device, dtype = resolve_model(args)
        check(args, cfg)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.threads or device == "cpu":
        torch.set_num_threads(args.threads or 1)
    backend = engine_backend(device, dtype)
    load_at_start = load_average()
    print(machine_line(torch.get_num_threads()))
    print(f"device {device} · dtype {str(dtype).removeprefix('torch.')} · backend {backend} · block_size "
          f"{args.block_size} · our prefill budget {DEFAULT_PREFILL_CHUNK} tokens/step")
    results = bench_model(str(model_dir.name), model_dir, args, device, dtype, backend, args.requests, args.repeat,
                          staggered=True)
    if not args.skip_06b:
        with tempfile.TemporaryDirectory() as tmp:
            config = {k: v for k, v in QWEN3_0_6B.items() if k != "num_hidden_layers"}
            path = make_random_model(Path(tmp) / "qwen3-0.6b-shaped", hf_init=False,
                                     num_hidden_layers=args.layers_06b, **config)
            label = f"Qwen3-0.6B-shaped random model, {args.layers_06b} of 28 layers"
            # HF's budget: what its sweep chose on the embedded model's burst (sweeping here costs minutes)
            results += bench_model(label, path, args, device, dtype, backend, args.requests_06b, args.repeat_06b,
                                   staggered=False, hf_batch_tokens=results[0]["hf_batch_tokens"])
    command = bench_command("bench_l8.py", argv if argv is not None else sys.argv[1:])
    if args.markdown:
        replace_section(args.markdown, "bench_l8", markdown(results, args, command, load_at_start))
        print(f"wrote the bench_l8 section of {args.markdown}")
    if args.json:
        write_text_atomic(args.json, json.dumps({"results": results}, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
