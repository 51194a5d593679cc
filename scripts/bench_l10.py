#!/usr/bin/env python3
"""L10 benchmark: speculative decoding against plain decoding, ours and HF's, with ids compared.

Systems, each making exactly --max-new-tokens per request (EOS off, so all do the same work):
  L8 plain            the L8 engine, no speculation
  L10 prompt lookup   the L10 engine, n-gram drafter, k = --k (adapted per request)
  L10 draft model     the L10 engine, the embedded draft model (assets/tiny-qwen3-kjv-draft)
  HF greedy           transformers `generate`, greedy (batch: one left-padded `generate`)
  HF prompt lookup    `generate(prompt_lookup_num_tokens=--k)`       (batch 1 only: HF's limit)
  HF assistant        `generate(assistant_model=<the same draft>)`  (batch 1 only)
Workloads: batch 1 (each of the KJV prompts alone, one after the other) and a batch of --batch
mixed requests at once (the prompts cut at different lengths), on the embedded model; then batch 1
on a Qwen3-0.6B-shaped random model with --layers-0.6b layers (a random segment repeated three
times: prompt lookup proposes its continuation, which a random model does not follow; no draft
model exists for it): near-zero acceptance, what failed guesses cost.
Every system runs once untimed, then --repeat rounds in turns (alternating, so load coming and
going hits all alike); the best round is reported. `forwards/token` counts the target's forwards
each generated token waited for (1.0 for plain decoding; HF's are counted with a forward hook).
`floor ms` is the sum over a system's forwards of max(bytes / bandwidth, FLOPs / matmul rate), the
constants measured in the same run (harness.benchmark): ours recorded as they run (the target's
forwards, a verify's head on all its k + 1 rows, and the draft model's own), HF greedy's counted
from its padded shape; HF's speculative runs are not visible ("n/a").

    python scripts/bench_l10.py                                 # everything (several minutes on CPU)
    python scripts/bench_l10.py --markdown docs/benchmarks.md   # rewrite its section there
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import OneLineParser, guard_startup, run_main  # noqa: E402

guard_startup()  # Ctrl-C while torch loads: one line, exit 2 (run_main takes over for the work)

import torch  # noqa: E402

from harness import hf_reference as hf  # noqa: E402
from harness.benchmark import (check_bench_args, write_text_atomic, ModelCost, bench_command, best_of, hf_generate, load_average,  # noqa: E402
                               machine_line, markdown_table, measure_machine, padded_batch_steps, print_table,
                               record_forwards, replace_section)
from harness.smoke import DEFAULT_MODEL, load_tokenizer  # noqa: E402
from harness.tiny_models import QWEN3_0_6B, make_random_model  # noqa: E402
from l2_paged import blocks_needed  # noqa: E402
from l5_eviction import load_engine_model  # noqa: E402
from l8_prefix import SampledWorkItem, make_prefix_engine  # noqa: E402
from l10_speculative import DraftModelDrafter, PromptLookupDrafter, make_spec_engine  # noqa: E402

DRAFT_MODEL = DEFAULT_MODEL.parent / "tiny-qwen3-kjv-draft"
PROMPTS = ["And the LORD spake unto Moses, saying", "In the beginning God created the heaven and the earth.",
           "Blessed are the", "Thus saith the LORD"]
COLUMNS = ["workload", "system", "tokens/s", "speed-up", "forwards/token", "acceptance", "floor ms", "% of floor",
           "ids = HF greedy"]


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="timed rounds, best kept (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a busy 2-core machine)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the rows to PATH")
    p.add_argument("--markdown", metavar="PATH", default=None, help="rewrite the L10 section of PATH")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--k", type=int, default=5, help="proposals per step (HF: prompt_lookup_num_tokens)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--layers-0.6b", dest="layers_06b", type=int, default=4)
    p.add_argument("--max-new-tokens-0.6b", dest="new_06b", type=int, default=32)
    p.add_argument("--skip-0.6b", dest="skip_06b", action="store_true")
    return check_bench_args(p.parse_args(argv), p)


# ---------------------------------------------------------------- systems: prompts -> (ids, stats)

def ours(model, drafter_fn, k: int, block_size: int = 16):
    def run(prompts, max_new):
        num_blocks = sum(blocks_needed(len(p) + max_new + k + 1, block_size) for p in prompts)
        items = [SampledWorkItem(p, max_new) for p in prompts]
        if drafter_fn is None:
            engine = make_prefix_engine(model, num_blocks, block_size)
        else:
            engine = make_spec_engine(model, num_blocks, block_size, drafter=drafter_fn(num_blocks), k=k)
        engine.eos_ids = set()  # as HF's runs: exactly max_new tokens each
        steps = {"target": record_forwards(engine.runner), "draft": []}
        if isinstance(getattr(engine, "drafter", None), DraftModelDrafter):
            steps["draft"] = record_forwards(engine.drafter.runner)
        requests = engine.run(items)
        ids = [requests[i].output_ids for i in range(len(prompts))]
        steps = {name: [shape for shape, _ in log] for name, log in steps.items()}
        if drafter_fn is None:
            return ids, {"forwards/token": 1.0, "acceptance": None, "steps": steps}
        s = engine.summary()
        return ids, {"forwards/token": s["forwards_per_token"], "acceptance": s["acceptance_rate"], "steps": steps}
    return run


def hf_system(hf_model, batched: bool, **generate_kwargs):
    counter = {"calls": 0}
    hf_model.register_forward_pre_hook(lambda *_: counter.__setitem__("calls", counter["calls"] + 1))

    def run(prompts, max_new):
        start = counter["calls"]
        if generate_kwargs:
            ids = [hf_assisted(hf_model, p, max_new, **generate_kwargs) for p in prompts]
        else:
            ids = hf_generate(hf_model, prompts, max_new, batched=batched)
        calls = counter["calls"] - start
        per_token = calls / max_new / (1 if batched else len(prompts))
        steps = None if generate_kwargs else {"target": padded_batch_steps([len(p) for p in prompts], max_new),
                                              "draft": []}
        return ids, {"forwards/token": per_token if not generate_kwargs else calls / (max_new * len(prompts)),
                     "acceptance": None, "steps": steps}
    return run, counter


@torch.inference_mode()
def hf_assisted(model, prompt, max_new, **kwargs):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------- timing

def time_rounds(systems: dict, prompts, max_new, repeat: int, one_by_one: bool) -> dict:
    """name -> (best seconds, ids, stats); one untimed run each, then rounds in turns."""
    def call(run):
        if not one_by_one:
            return run(prompts, max_new)
        results = [run([p], max_new) for p in prompts]
        stats = {key: _mean([r[1][key] for r in results]) for key in ("forwards/token", "acceptance")}
        stats["steps"] = _joined([r[1]["steps"] for r in results])
        return [r[0][0] for r in results], stats

    best = {}
    for name, run in systems.items():
        ids, stats = call(run)
        best[name] = [float("inf"), ids, stats]
    for _ in range(repeat):
        for name, run in systems.items():
            start = time.perf_counter()
            call(run)
            best[name][0] = min(best[name][0], time.perf_counter() - start)
    return best


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _joined(step_logs: list):
    """The forwards of runs one after the other; None if any run's are not visible."""
    if any(log is None for log in step_logs):
        return None
    return {name: [shape for log in step_logs for shape in log[name]] for name in ("target", "draft")}


def floor_s(steps, costs: dict, machine):
    if steps is None:
        return None
    return sum(costs[name].run_floor_s(shapes, machine) for name, shapes in steps.items() if shapes)


def rows_for(label, best, reference_ids, tokens, costs: dict, machine):
    """One row per system; "machine" (not a column) carries the constants its floor used."""
    base = best["HF greedy"][0]
    rows = []
    for name, (seconds, ids, stats) in best.items():
        floor = floor_s(stats["steps"], costs, machine)
        rows.append({"workload": label, "system": name, "tokens/s": tokens / seconds, "speed-up": base / seconds,
                     "forwards/token": stats["forwards/token"], "acceptance": stats["acceptance"],
                     "floor ms": None if floor is None else 1e3 * floor,
                     "% of floor": None if floor is None else 100 * floor / seconds,
                     "ids = HF greedy": "yes" if ids == reference_ids else "NO", "machine": machine.line()})
    return rows


def costs_of(model, draft=None) -> dict:
    """The bytes and FLOPs of a forward of the target (and of the draft model, if there is one)."""
    itemsize = model.dtype.itemsize
    costs = {"target": ModelCost.of(model.config, itemsize)}
    if draft is not None:
        costs["draft"] = ModelCost.of(draft.config, itemsize)
    return costs


def bench_embedded(args) -> list[dict]:
    tok = load_tokenizer(DEFAULT_MODEL)
    prompts = [tok.encode(p) for p in PROMPTS]
    model = load_engine_model(DEFAULT_MODEL)
    draft = load_engine_model(DRAFT_MODEL)
    hf_model, hf_draft = hf.load_hf_model(str(DEFAULT_MODEL)), hf.load_hf_model(str(DRAFT_MODEL))
    n = args.max_new_tokens
    greedy_one, _ = hf_system(hf_model, batched=False)
    systems = {
        "HF greedy": greedy_one,
        "HF prompt lookup": hf_system(hf_model, False, prompt_lookup_num_tokens=args.k)[0],
        "HF assistant (draft)": hf_system(hf_model, False, assistant_model=hf_draft)[0],
        "L8 plain": ours(model, None, args.k),
        "L10 prompt lookup": ours(model, lambda nb: PromptLookupDrafter(), args.k),
        "L10 draft model": ours(model, lambda nb: DraftModelDrafter(draft, nb + 8), args.k),
    }
    reference = hf_generate(hf_model, prompts, n)
    costs, before = costs_of(model, draft), measure_machine(model.config)
    timings = time_rounds(systems, prompts, n, args.repeat, True)
    batch = [prompts[i % len(prompts)][:2 + i % 7] for i in range(args.batch)]  # mixed lengths, some shared
    batch_systems = {"HF greedy": hf_system(hf_model, batched=True)[0],
                     **{name: systems[name] for name in ("L8 plain", "L10 prompt lookup", "L10 draft model")}}
    batch_timings = time_rounds(batch_systems, batch, n, args.repeat, False)
    machine = best_of(before, measure_machine(model.config))
    print(f"this machine: {machine.line()}")
    rows = rows_for("embedded, batch 1", timings, reference, n * len(prompts), costs, machine)
    print_table(rows, COLUMNS, floatfmt=".2f")
    reference = hf_generate(hf_model, batch, n)
    batch_rows = rows_for(f"embedded, batch {args.batch}", batch_timings, reference, n * len(batch), costs, machine)
    print_table(batch_rows, COLUMNS, floatfmt=".2f")
    return rows + batch_rows


def bench_06b(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        shape = {**QWEN3_0_6B, "num_hidden_layers": args.layers_06b}
        model_dir = make_random_model(tmp, seed=0, init_std=0.02, hf_init=False, **shape)
        model = load_engine_model(model_dir)
        hf_model = hf.load_hf_model(str(model_dir))
        gen = torch.Generator().manual_seed(0)
        # A random segment three times: prompt lookup always proposes (the segment's continuation),
        # and a random model does not follow it: the cost of proposals that fail.
        prompts = [torch.randint(0, QWEN3_0_6B["vocab_size"], (16,), generator=gen).tolist() * 3]
        n = args.new_06b
        systems = {"HF greedy": hf_system(hf_model, False)[0],
                   "HF prompt lookup": hf_system(hf_model, False, prompt_lookup_num_tokens=args.k)[0],
                   "L8 plain": ours(model, None, args.k),
                   "L10 prompt lookup": ours(model, lambda nb: PromptLookupDrafter(), args.k)}
        reference = hf_generate(hf_model, prompts, n)
        before = measure_machine(model.config)
        timings = time_rounds(systems, prompts, n, args.repeat, True)
        machine = best_of(before, measure_machine(model.config))
        print(f"this machine: {machine.line()}")
        rows = rows_for(f"0.6B shape, {args.layers_06b} layers, batch 1", timings, reference, n,
                        costs_of(model), machine)
    print_table(rows, COLUMNS, floatfmt=".2f")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_at_start = load_average()
    rows = bench_embedded(args)
    if not args.skip_06b:
        rows += bench_06b(args)
    if args.json:
        import json
        write_text_atomic(args.json, json.dumps(rows, indent=2))
    if args.markdown:
        text = (f"## L10: speculative decoding, and HF's prompt lookup and assistant model\n\n{machine_line(args.threads, load_at_start)}\n\n"
                f"`{bench_command('bench_l10.py', sys.argv[1:] if argv is None else argv)}`: "
                f"{args.max_new_tokens} new tokens per request (0.6B shape: {args.new_06b}), k = {args.k}, "
                f"best of {args.repeat} alternating rounds. Speed-up is over HF greedy in the same workload. "
                "Floor: the sum over a system's forwards of max(bytes / bandwidth, FLOPs / matmul rate) (ours as "
                "recorded, the draft model's included; HF greedy's from its padded shape; HF's speculative runs "
                "are not visible), with "
                + "; ".join(sorted({f"{r['machine']} ({r['workload'].split(',')[0]})" for r in rows}))
                + ", measured in the same run.\n\n" + markdown_table(rows, COLUMNS))
        replace_section(args.markdown, "bench_l10", text)
    return 0 if all(r["ids = HF greedy"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
