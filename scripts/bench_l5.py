#!/usr/bin/env python3
"""L5 benchmark: throughput of the continuous-batching engine vs HF, and as its pool shrinks.

The workload is --requests requests (default 32) with mixed prompt and output lengths drawn from
a fixed seed, all arriving at step 0; every request makes exactly its own number of new tokens
(EOS does not stop it). Throughput = generated tokens asked for / wall seconds from handing the
requests over to the last token, prefill included; building the L5 engine or HF's continuous
batching manager (KV pool included) and stopping it are timed apart ("set-up s", "teardown s").
Each system first runs the first 4 requests untimed (a warm-up), then --repeat rounds in which
every system runs the whole workload once (interleaved, so that load coming and going on a shared
machine hits all of them alike); the best round is reported, the median beside it.

  L5 engine           this lesson's engine, pool = 100% of what the requests need together,
                      prefill budget --prefill-chunk tokens per step (default 256, the engine's)
  HF batched          transformers `generate` on one left-padded batch; it runs every row to the
                      longest output, and only the tokens asked for are counted
  HF continuous       transformers' own paged continuous batching (`init_continuous_batching`),
                      each request with its own max_new_tokens, set like the L5 engine: page size
                      = block size, num_blocks = the L5 engine's pool (ratio 1.0), no block sharing
                      (L5 has none), max_batch_tokens the best of a sweep (--hf-batch-tokens: one
                      untimed run each on the embedded model, printed; the 0.6B shape reuses it)
  L5 pool 50% / 25%   the engine with half / a quarter of the blocks: preemption, by recompute
                      and by swap

and the same requests arriving in 4 waves, a quarter of the longest output apart (in engine
steps): the L5 engine admits each wave as it comes, a static batcher runs one padded batch per
wave, each after the one before ("HF batched, 4 waves").

Two models, the same workload shape: the one given by --model (default: the embedded model), with
every system above, and a random model with Qwen3-0.6B's shapes (hidden 1024, 16 / 8 heads of 128,
vocabulary 151936) and --layers-0.6b of its 28 layers (default 4; made in-process, nothing
downloaded), with the first three systems only (--full-0.6b: all of them) and --repeat-0.6b
rounds. --skip-0.6b leaves it out, --only-0.6b runs it alone. --markdown PATH rewrites the
`bench_l5` section of PATH.

Every table has a floor column: the sum over a system's steps of max(bytes it must read / read
bandwidth, FLOPs it must do / matmul rate), both constants measured in the same run
(harness.benchmark), and "% of floor" = floor / measured time. The L5 engine's steps are recorded
as it runs (its decode-only steps and those with prefill rows are then compared with their floor
apart); HF batched's are counted from its padded shape; HF continuous's are not visible, and its
floor is that of the L5 engine's steps.

    python scripts/bench_l5.py                          # both models; cuda bf16 if present, else cpu fp32
    python scripts/bench_l5.py --skip-0.6b --requests 64 --json bench_l5.json
    python scripts/bench_l5.py --device cuda --full-0.6b --repeat-0.6b 3
    python scripts/bench_l5.py --only-0.6b --layers-0.6b 28      # all 28 layers (tens of minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import tempfile
import time
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import guard_startup, run_main  # noqa: E402

guard_startup()  # Ctrl-C while torch loads: one line, exit 2 (run_main takes over for the work)

import torch  # noqa: E402

from harness import hf_reference as hf  # noqa: E402
from harness.benchmark import (check_bench_args, write_text_atomic, Machine, ModelCost, ServeRun, StepShape, bench_command, bench_parser,  # noqa: E402
                               hf_continuous_config, hf_generate, load_average, machine_line, markdown_table,
                               best_of, measure_machine, padded_batch_steps, parse_batch_tokens, print_table, record_steps,
                               replace_section, serve_engine, serve_hf_continuous, timed, tokens_per_s)
from harness.smoke import resolve_model  # noqa: E402
from harness.tiny_models import QWEN3_0_6B, make_random_model  # noqa: E402
from l1_contiguous import InputError, load_config  # noqa: E402
from l2_paged import blocks_needed  # noqa: E402
from l5_eviction import DEFAULT_PREFILL_CHUNK, WorkItem, load_engine_model, make_engine  # noqa: E402


@dataclass(frozen=True)
class Settings:
    block_size: int = 16  # the course's default, as vLLM's
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per step (all prefills together)
    repeat: int = 3
    device: str = "cpu"
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Shape:
    """A workload's shape: how many requests and the ranges (inclusive) of their lengths."""

    requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]


WORKLOAD_SHAPE = Shape(32, (8, 128), (8, 64))
WAVES = 4
WARM_UP_REQUESTS = 4
HEADLINE = ("L5 engine", "HF batched", "HF continuous")  # the 0.6B-shaped model's systems by default


@dataclass(frozen=True)
class System:
    """One way to run the workload, and the row it is compared with in the "x base" column."""

    run: Callable[[dict], list[list[int]]]
    base: str
    pool: int | None = None  # % of the demand (L5 only)
    mode: str = "-"


def parse_args(argv=None) -> argparse.Namespace:
    d = Settings()
    p = bench_parser(__doc__.split("\n\n")[0], repeat=d.repeat)  # --model --device --dtype --repeat --json
    p.add_argument("--requests", type=int, default=WORKLOAD_SHAPE.requests,
                   help=f"requests in the workload (default {WORKLOAD_SHAPE.requests})")
    p.add_argument("--skip-0.6b", dest="skip_06b", action="store_true",
                   help="leave out the Qwen3-0.6B-shaped random model")
    p.add_argument("--only-0.6b", dest="only_06b", action="store_true",
                   help="leave out the --model run (HF continuous then uses --hf-batch-tokens, 512 for auto)")
    p.add_argument("--layers-0.6b", dest="layers_06b", type=int, default=4,
                   help=f"layers of the 0.6B-shaped model (default 4 of its {QWEN3_0_6B['num_hidden_layers']})")
    p.add_argument("--repeat-0.6b", dest="repeat_06b", type=int, default=1,
                   help="timed rounds for the 0.6B-shaped model (default 1)")
    p.add_argument("--full-0.6b", dest="full_06b", action="store_true",
                   help="time every system on the 0.6B-shaped model, not only " + ", ".join(HEADLINE))
    p.add_argument("--block-size", type=int, default=d.block_size, help=f"L5 block size (default {d.block_size})")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help=f"L5 prompt tokens per step (default {d.prefill_chunk})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for every system (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads' lengths and ids")
    p.add_argument("--hf-batch-tokens", default="auto",
                   help="HF continuous max_batch_tokens: one value, comma-separated values to sweep, or auto "
                        "(default: sweep prefill chunk + requests, 512, 1024)")
    p.add_argument("--markdown", metavar="PATH", default=None,
                   help="also write the tables as the `bench_l5` section of the markdown file PATH")
    args = check_bench_args(p.parse_args(argv), p)
    if args.skip_06b and args.only_06b:
        p.error("--skip-0.6b and --only-0.6b together run nothing; give one of them")
    return args


def make_workload(shape: Shape, vocab_size: int, seed: int) -> list[WorkItem]:
    rng = random.Random(seed)
    return [WorkItem([rng.randrange(vocab_size) for _ in range(rng.randint(*shape.prompt_lens))],
                     rng.randint(*shape.output_lens)) for _ in range(shape.requests)]


def demand_blocks(items: list[WorkItem], block_size: int) -> int:
    """Blocks all requests hold at once at their longest (the last new token's K/V is never written)."""
    return sum(blocks_needed(len(w.prompt_ids) + w.max_new_tokens - 1, block_size) for w in items)


# ---------------------------------------------------------------- the ways to run a workload
# Each takes `last` (a dict where an L5 run leaves its engine) and returns every request's new ids.


def l5_runner(model, items, num_blocks: int, s: Settings, mode: str = "recompute"):
    step_logs = []  # one per engine made: [StepShape, seconds] per step

    def make():
        engine = make_engine(model, num_blocks, s.block_size, preempt=mode, prefill_chunk=s.prefill_chunk)
        engine.eos_ids = set()  # exactly max_new_tokens per request, as in the HF runs
        step_logs.append(record_steps(engine))
        return engine

    def run(last: dict):
        if any(w.arrival_step for w in items):  # waves: arrivals on the engine's own step clock
            served = timed_engine_run(make, items)
        else:
            served = serve_engine(make, items, [0.0] * len(items))
        last["engine"], last["served"], last["steps"] = served.engine, served, step_logs.pop()
        return served.ids
    return run


def timed_engine_run(make, items):
    """engine.run(items) on the clock (arrivals at their engine steps); a ServeRun without TTFT."""
    start = time.perf_counter()
    engine = make()
    setup_s = time.perf_counter() - start
    engine.run(items)
    serve_s = time.perf_counter() - start - setup_s
    return ServeRun([r.output_ids for r in engine.requests.values()], serve_s, [float("nan")] * len(items),
                    setup_s, 0.0, engine)


def hf_batched_runner(hf_model, items):
    def run(last: dict):
        last["steps"] = padded_batch_steps([len(w.prompt_ids) for w in items], max(w.max_new_tokens for w in items))
        outs = hf_generate(hf_model, [w.prompt_ids for w in items], max(w.max_new_tokens for w in items),
                           batched=True)
        return [out[:w.max_new_tokens] for out, w in zip(outs, items)]
    return run


def hf_waves_runner(hf_model, waves: list[list[WorkItem]]):
    """Static batching of requests that arrive in waves: one batch per wave, one after another."""
    batches = [hf_batched_runner(hf_model, wave) for wave in waves]

    def run(last: dict):
        ids, steps = [], []
        for batch in batches:
            ids += batch(last)
            steps += last["steps"]
        last["steps"] = steps
        return ids
    return run


def in_waves(items: list[WorkItem], num_waves: int) -> list[list[WorkItem]]:
    """Split into `num_waves` waves, a quarter of the longest output apart (for 4 waves)."""
    gap = max(w.max_new_tokens for w in items) // num_waves
    size = -(-len(items) // num_waves)
    return [[replace(w, arrival_step=k * gap) for w in items[k * size:(k + 1) * size]] for k in range(num_waves)]


def hf_continuous_runner(hf_model, items, s: Settings, max_batch_tokens: int):
    """transformers' continuous batching on this workload, or (None, why it cannot run here)."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: F401
    except ImportError as exc:
        return None, f"not in this transformers ({exc})"
    if not hasattr(hf_model, "init_continuous_batching"):
        return None, "this transformers has no continuous batching manager"
    config = hf_continuous_config(s.block_size, demand_blocks(items, s.block_size), max_batch_tokens,
                                  block_sharing=False)

    def run(last: dict, items=items):
        served = serve_hf_continuous(hf_model, items, [0.0] * len(items), config)
        last["served"] = served
        return served.ids

    try:
        run({}, items[:2])  # does it run at all on this machine?
    except Exception as exc:  # noqa: BLE001 - any failure is reported in the table, not raised
        return None, f"fails here: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return run, None


def sweep_hf_batch_tokens(hf_model, items, s: Settings, candidates: list[int]) -> tuple[int, list]:
    """HF continuous's max_batch_tokens with the least serving time (one run each), and the runs."""
    if len(candidates) == 1:
        return candidates[0], []
    tried = []
    for value in candidates:
        run, why_not = hf_continuous_runner(hf_model, items, s, value)
        if run is None:
            return value, []
        last: dict = {}
        run(last)
        tried.append((value, last["served"].serve_s))
    return min(tried, key=lambda t: t[1])[0], tried


# ---------------------------------------------------------------- one model


def systems_for(ours, theirs, items, s: Settings, hf_batch_tokens: int,
                full: bool = True) -> tuple[dict[str, System], str | None]:
    """The systems to time (full=False: the HEADLINE ones) and, when HF continuous cannot run here, why."""
    demand = demand_blocks(items, s.block_size)
    base, base_waves = "HF batched", f"HF batched, {WAVES} waves"
    systems = {"L5 engine": System(l5_runner(ours, items, demand, s), base, 100),
               base: System(hf_batched_runner(theirs, items), base)}
    run_cb, why_not = hf_continuous_runner(theirs, items, s, hf_batch_tokens)
    if run_cb is not None:
        systems["HF continuous"] = System(run_cb, base)
    if not full:
        return systems, why_not
    largest = max(demand_blocks([w], s.block_size) for w in items)
    for pct in (50, 25):
        num_blocks = max(demand * pct // 100, largest + 1)
        for mode in ("recompute", "swap"):
            systems[f"L5 pool {pct}% {mode}"] = System(l5_runner(ours, items, num_blocks, s, mode), base,
                                                       round(100 * num_blocks / demand), mode)
    waves = in_waves(items, WAVES)
    systems[f"L5 engine, {WAVES} waves"] = System(l5_runner(ours, sum(waves, []), demand, s), base_waves, 100)
    systems[base_waves] = System(hf_waves_runner(theirs, waves), base_waves)
    return systems, why_not


def time_rounds(systems: dict, warm_up: dict, repeat: int, device: str) -> tuple[dict, dict, dict, dict]:
    """Each of `warm_up` once, then `repeat` rounds running every system once.

    -> seconds (serving only, where the system reports it), ids, engines, the best round's ServeRun,
    and the steps of each system's best round (StepShape and seconds; HF: shapes only, seconds None)."""
    seconds, ids, engines, served, steps = {name: [] for name in systems}, {}, {}, {}, {}
    with torch.inference_mode():
        for system in warm_up.values():
            system.run({})
        for round_ in range(1, repeat + 1):
            for name, system in systems.items():
                last: dict = {}
                t = timed(lambda: ids.__setitem__(name, system.run(last)), repeat=1, warmup=0, device=device)
                engines[name] = last.get("engine")
                run = last.get("served")
                seconds[name].append(run.serve_s if run else t.best)
                if run and (name not in served or run.serve_s <= min(seconds[name])):
                    served[name] = run
                if seconds[name][-1] <= min(seconds[name]):
                    steps[name] = last.get("steps")
            print(f"  round {round_}/{repeat} done", flush=True)
    return seconds, ids, engines, served, steps


def table_rows(systems, seconds, ids, engines, served, floors: dict, tokens: int, num_requests: int) -> list[dict]:
    rows = []
    for name, system in systems.items():
        best = min(seconds[name])
        row = {"system": name, "pool %": system.pool, "mode": system.mode, "tokens": tokens, "best s": best,
               "median s": statistics.median(seconds[name]), "tok/s": tokens_per_s(tokens, best),
               "floor s": floors[name], "% of floor": 100 * floors[name] / best}
        if name in served:
            run = served[name]
            row["TTFT mean ms"] = None if math.isnan(run.ttft_mean_s) else 1e3 * run.ttft_mean_s
            row["set-up s"], row["teardown s"] = run.setup_s, run.teardown_s
        if engines[name] is not None:
            totals = engines[name].summary()
            row["preemptions"] = totals["preempted_recompute"] + totals["preempted_swap"]
            row["recomputed"] = totals["tokens_recomputed"]
            row["swapped MiB"] = totals["bytes_swapped_out"] / 2**20
        rows.append(row)
    speed = {row["system"]: row["tok/s"] for row in rows}
    for row in rows:
        row["x base"] = row["tok/s"] / speed[systems[row["system"]].base]
        same = sum(a == b for a, b in zip(ids[row["system"]], ids["L5 engine"]))
        row["same ids"] = f"{same}/{num_requests}"
    return rows


COLUMNS = ["system", "pool %", "mode", "tokens", "best s", "median s", "tok/s", "x base", "floor s", "% of floor",
           "TTFT mean ms",
           "set-up s", "teardown s", "preemptions", "recomputed", "swapped MiB", "same ids"]


def bench_model(label: str, model_dir: Path, items: list[WorkItem], s: Settings, candidates: list[int],
                full: bool = True) -> dict:
    """Every system on one model; HF continuous's max_batch_tokens: the best of `candidates` (one run each)."""
    cfg = load_config(model_dir)
    ours = load_engine_model(model_dir, s.dtype, s.device)
    theirs = hf.load_hf_model(str(model_dir), s.device, s.dtype)
    demand, tokens = demand_blocks(items, s.block_size), sum(w.max_new_tokens for w in items)
    print(f"\n== {label}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size} · "
          f"{len(items)} requests, prompts {sum(len(w.prompt_ids) for w in items)} tokens, "
          f"{tokens} new tokens, demand {demand} blocks of {s.block_size}")
    print("lengths (prompt+new): " + " ".join(f"{len(w.prompt_ids)}+{w.max_new_tokens}" for w in items))
    with torch.inference_mode():
        hf_batch_tokens, tried = sweep_hf_batch_tokens(theirs, items, s, candidates)
    if len(tried) > 1:
        print("HF continuous max_batch_tokens sweep (one run each): "
              + ", ".join(f"{v}: {t:.2f} s" for v, t in tried) + f" -> {hf_batch_tokens}")
    systems, why_not = systems_for(ours, theirs, items, s, hf_batch_tokens, full)
    warm_up, _ = systems_for(ours, theirs, items[:WARM_UP_REQUESTS], s, hf_batch_tokens, full)
    before = measure_machine(cfg, s.dtype)
    seconds, ids, engines, served, steps = time_rounds(systems, warm_up, s.repeat, s.device)
    machine = best_of(before, measure_machine(cfg, s.dtype))  # before and after the rounds: load varies
    print(f"this machine: {machine.line()} (best of before and after the rounds; load average {load_average()})")
    cost = ModelCost.of(cfg, s.dtype.itemsize)
    # HF continuous's own steps are not visible from outside: its floor is that of the same
    # requests scheduled as the L5 engine schedules them (no padding; its own step count may differ).
    steps["HF continuous"] = steps.get("HF continuous") or steps["L5 engine"]
    floors = {name: cost.run_floor_s([shape for shape, _ in _shapes(steps[name])], machine) for name in systems}
    rows = table_rows(systems, seconds, ids, engines, served, floors, tokens, len(items))
    step_kinds = step_kind_rows(steps["L5 engine"], cost, machine)
    if why_not:
        rows.append({"system": "HF continuous", "mode": why_not})
    print()
    print_table(rows, COLUMNS, floatfmt=".2f")
    print(f"x base: tok/s over HF batched's (over HF batched, {WAVES} waves' for the wave rows); "
          "same ids: requests whose ids equal the L5 engine's at full pool; floor s: the sum over the "
          "system's steps of max(bytes / bandwidth, FLOPs / matmul rate), with " + machine.line())
    print("\nL5 engine's steps (its best round) against their floor:")
    print_table(step_kinds, STEP_COLUMNS, floatfmt=".2f")
    return {"label": label, "model": str(model_dir), "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size, "prompt_tokens": sum(len(w.prompt_ids) for w in items),
            "requests": len(items), "new_tokens": tokens, "demand_blocks": demand, "repeat": s.repeat,
            "hf_settings": f"page_size {s.block_size}, num_blocks {demand} (1.0x the L5 pool), max_batch_tokens "
                           f"{hf_batch_tokens}, allow_block_sharing False", "hf_sweep": tried,
            "lengths": [[len(w.prompt_ids), w.max_new_tokens] for w in items], "rows": rows,
            "machine": {"read_bytes_per_s": machine.read_bytes_per_s, "matmul_flops_per_s": machine.matmul_flops_per_s,
                        "load average": load_average()},
            "step_kinds": step_kinds,
            "l5_steps": [{**asdict(shape), "seconds": sec, "floor_s": cost.floor_s(shape, machine)}
                         for shape, sec in steps["L5 engine"]]}


def _shapes(steps: list) -> list:
    """[(StepShape, seconds or None)] from an L5 step log ([shape, seconds]) or HF's shapes."""
    return [(s, None) if isinstance(s, StepShape) else tuple(s) for s in steps]


STEP_COLUMNS = ["steps", "kind", "rows per step", "measured s", "floor s", "% of floor", "bound by"]


def step_kind_rows(log: list, cost: ModelCost, machine: Machine) -> list[dict]:
    """The L5 engine's steps in two kinds, decode-only and with prefill rows: time vs floor."""
    rows = []
    for kind, pick in (("decode only", lambda s: s.rows == s.logit_rows), ("with prefill", lambda s: s.rows > s.logit_rows)):
        part = [(s, sec) for s, sec in _shapes(log) if pick(s)]
        if not part:
            continue
        floor = sum(cost.floor_s(s, machine) for s, _ in part)
        measured = sum(sec for _, sec in part)
        memory = sum(cost.bytes(s) / machine.read_bytes_per_s >= cost.flops(s) / machine.matmul_flops_per_s
                     for s, _ in part)
        rows.append({"steps": len(part), "kind": kind,
                     "rows per step": f"{min(s.rows for s, _ in part)}-{max(s.rows for s, _ in part)}",
                     "measured s": measured, "floor s": floor, "% of floor": 100 * floor / measured,
                     "bound by": f"memory in {memory}/{len(part)}"})
    return rows


def bench_06b(args, shape: Shape, s: Settings, hf_batch_tokens: int) -> dict:
    """The 0.6B shape, saved from a random init to a temporary folder (fp32, about 0.9 GB at 4 layers)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = {k: v for k, v in QWEN3_0_6B.items() if k != "num_hidden_layers"}
        path = make_random_model(Path(tmp) / "qwen3-0.6b-shaped", hf_init=False,
                                 num_hidden_layers=args.layers_06b, **config)
        label = f"Qwen3-0.6B-shaped random model, {args.layers_06b} of 28 layers"
        items = make_workload(shape, QWEN3_0_6B["vocab_size"], args.seed)
        return bench_model(label, path, items, replace(s, repeat=args.repeat_06b), [hf_batch_tokens],
                           full=args.full_06b)


def batch_tokens(args) -> list[int]:
    return parse_batch_tokens(args.hf_batch_tokens, [args.prefill_chunk + args.requests, 512, 1024])


MD_COLUMNS = ["system", "pool %", "best s", "median s", "tok/s", "x base", "floor s", "% of floor", "TTFT mean ms", "set-up s", "teardown s",
              "preemptions", "recomputed", "swapped MiB", "same ids"]


def markdown(results: list[dict], command: str, load_at_start: str) -> str:
    out = ["## L5: scheduling under memory pressure, and HF's continuous batching", "",
           f"`{command}` — {machine_line(torch.get_num_threads(), load_at_start)}.", "",
           "Workload: requests of mixed lengths (prompts 8–128 tokens, 8–64 new tokens, fixed seed), all handed over "
           "at once, EOS off. Seconds run from handing the requests over to the last token (serving only: building "
           "the engine or HF's manager with its KV cache, and stopping it, are the set-up and teardown columns). "
           "\"x base\": tokens/s over HF's batched `generate` (one left-padded batch; for the wave rows, one such "
           "batch per wave). Best of the alternating rounds after a warm-up; the machine is shared, so ratios "
           "within a table are the meaningful figures. \"same ids\": requests whose ids equal the L5 engine's.", ""]
    for r in results:
        out += [f"### {r['label']}: {r['layers']} layers, hidden {r['hidden']}, vocabulary {r['vocab']}", "",
                f"{r['requests']} requests, {r['prompt_tokens']} prompt tokens, {r['new_tokens']} new tokens, "
                f"demand {r['demand_blocks']} blocks; {r['repeat']} round(s). HF continuous: {r['hf_settings']}"
                + (" (sweep, one run each: " + ", ".join(f"{v} → {t:.2f} s" for v, t in r["hf_sweep"]) + ")"
                   if len(r["hf_sweep"]) > 1 else f" ({r.get('hf_chosen_by', 'chosen by the sweep on the first model')})")
                + ".", "",
                markdown_table(r["rows"], MD_COLUMNS), "",
                f"Floor: the sum over a system's steps of max(bytes / bandwidth, FLOPs / rate), with this machine's "
                f"{r['machine']['read_bytes_per_s'] / 1e9:.1f} GB/s and {r['machine']['matmul_flops_per_s'] / 1e9:.0f} "
                "GFLOP/s measured in the same run (HF continuous: the L5 engine's steps, its own are not visible). "
                "The L5 engine's steps:", "",
                markdown_table(r["step_kinds"], STEP_COLUMNS), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.requests < WARM_UP_REQUESTS or min(args.repeat, args.repeat_06b, args.layers_06b, args.threads or 1,
                                                   args.block_size, args.prefill_chunk) < 1:
            raise InputError("--repeat, --repeat-0.6b, --layers-0.6b, --threads, --block-size and "
                             f"--prefill-chunk must be at least 1, --requests at least {WARM_UP_REQUESTS}")
        model_dir, cfg, device, dtype = resolve_model(args)
        candidates = batch_tokens(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    s = Settings(args.block_size, args.prefill_chunk, args.repeat, device, dtype)
    header = {"device": device, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
              "transformers": transformers.__version__, "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "block_size": s.block_size,
              "prefill_chunk": s.prefill_chunk, "repeat": s.repeat,
              "load average": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    print(" · ".join(f"{key} {value}" for key, value in header.items()))
    shape = Shape(args.requests, WORKLOAD_SHAPE.prompt_lens, WORKLOAD_SHAPE.output_lens)
    results = []
    if not args.only_06b:
        results.append(bench_model(model_dir.name, model_dir, make_workload(shape, cfg.vocab_size, args.seed), s,
                                   candidates))
    if not args.skip_06b:  # HF's budget: what the sweep chose on the first model (sweeping here costs minutes)
        chosen = (int(results[0]["hf_settings"].split("max_batch_tokens ")[1].split(",")[0]) if results
                  else 512 if args.hf_batch_tokens == "auto" else candidates[0])
        results.append(bench_06b(args, shape, s, chosen))
        if args.only_06b:
            results[-1]["hf_chosen_by"] = ("given by --hf-batch-tokens" if args.hf_batch_tokens != "auto"
                                           else "512: --only-0.6b runs no sweep")
    if args.markdown:
        command = bench_command("bench_l5.py", argv if argv is not None else sys.argv[1:])
        replace_section(args.markdown, "bench_l5", markdown(results, command, header["load average"]))
        print(f"wrote the bench_l5 section of {args.markdown}")
    if args.json:
        write_text_atomic(args.json, json.dumps({**header, "models": results}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
