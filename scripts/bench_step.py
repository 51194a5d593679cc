#!/usr/bin/env python3
"""Where a decode step's time goes: the L5 engine's step by phase, at 1, 4 and 32 requests, beside
its floor and HF's own decode step.

For each model (the embedded one, and a random model with Qwen3-0.6B's shapes and --layers-0.6b of
its 28 layers, made in-process) and each batch size B, B requests of a 32-token prompt (random
ids, fixed seed) each decode --new tokens on the L5 engine, all in one batch. The decode steps
after the prefill are timed:

  step ms        a whole decode step, best of --repeat runs, nothing attached
  HF step ms     HF's `generate` on the same B prompts: (time for --new tokens - time for 1) / (--new - 1),
                 i.e. its decode steps without its prefill, best of --repeat
  floor ms       max(bytes the step must read / read bandwidth, FLOPs / matmul rate), both measured
                 now (harness.benchmark), at the run's middle context length
  by phase       one more run with a timer on each phase (the timers' own cost shows as "timed
                 step ms" minus "step ms"):
                   schedule   the scheduler's plan
                   metadata   input ids and step metadata (positions, slots, block tables as tensors)
                   attention  every layer's attention (q/k/v, norms, rotary, cache write, paged
                              attention, o_proj)
                   mlp        every layer's MLP
                   norms      the layers' two RMSNorms and the final one
                   head       the output head on each request's last row
                   sample     picking each request's token from its logits (greedy)
                   commit     appending the tokens, finishing requests, freeing their blocks
                   other      the rest: reserving blocks, embedding, rotary tables, the step's
                              rollback snapshot, its timeline record
  and a picture of the phases beside the floor (--plot; with --markdown docs/benchmarks.md, docs/img/step_phases.png).

    python scripts/bench_step.py                        # both models, 2 threads
    python scripts/bench_step.py --skip-0.6b --markdown docs/benchmarks.md
    python scripts/bench_step.py --plot /tmp/phases.png
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import OneLineParser, guard_startup, run_main  # noqa: E402

guard_startup()

import torch  # noqa: E402

from harness import hf_reference as hf  # noqa: E402
from harness.benchmark import (ModelCost, StepShape, bench_command, load_average, machine_line,  # noqa: E402
                               markdown_table, measure_machine, print_table, replace_section)
from harness.smoke import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from harness.tiny_models import QWEN3_0_6B, make_random_model  # noqa: E402
from l1_contiguous import load_config  # noqa: E402
from l5_eviction import WorkItem, load_engine_model, make_engine  # noqa: E402

PROMPT_LEN = 32
PHASES = ["schedule", "metadata", "attention", "mlp", "norms", "head", "sample", "commit", "other"]
PICTURE = Path("img") / "step_phases.png"  # with --markdown and no --plot: beside the markdown file
COLUMNS = ["model", "requests", "step ms", "HF step ms", "HF / ours", "floor ms", "% of floor",
           *[f"{p} ms" for p in PHASES], "timed step ms"]


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format model folder (default: the embedded model)")
    p.add_argument("--new", type=int, default=32, help="tokens each request decodes (default 32)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per system, best kept (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--layers-0.6b", dest="layers_06b", type=int, default=4,
                   help="layers of the 0.6B-shaped model (default 4 of 28)")
    p.add_argument("--batches", default="1,4,32", help="requests per step to measure, comma-separated (default 1,4,32)")
    p.add_argument("--skip-0.6b", dest="skip_06b", action="store_true", help="the embedded model only")
    p.add_argument("--markdown", metavar="PATH", default=None, help="rewrite the `bench_step` section of PATH")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="draw the phases beside the floor to PATH (with --markdown, by default img/step_phases.png "
                        "beside the markdown file)")
    args = p.parse_args(argv)
    if args.markdown and args.plot is None:
        args.plot = str(Path(args.markdown).parent / PICTURE)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}: give counts like 1,4,32")
    if not args.batches or min(args.batches) < 1:
        p.error("--batches: every count must be at least 1")
    for name in ("new", "repeat", "threads", "layers_06b"):
        if getattr(args, name) < (2 if name == "new" else 1):
            p.error(f"--{name.replace('_06b', '-0.6b').replace('_', '-')} must be at least {2 if name == 'new' else 1}")
    return args


def prompts(batch: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(10, vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def decode_steps(model, batch_prompts: list[list[int]], new: int, timers=None) -> tuple[float, list[int]]:
    """Median seconds of the decode steps (the prefill step excluded; the median, not the mean, so
    that a burst of load from outside hits a few steps, not the figure), and the first request's ids."""
    bs = 16
    engine = make_engine(model, num_blocks=len(batch_prompts) * (-(-(PROMPT_LEN + new) // bs)) + 1, block_size=bs,
                         prefill_chunk=len(batch_prompts) * PROMPT_LEN)
    for p in batch_prompts:
        engine.add_request(WorkItem(p, new))
    engine.step()  # every prompt is prefilled in the first step (its budget is all of them)
    if timers is not None:
        timers.attach(engine)
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    if timers is not None:
        timers.detach()
    return statistics.median(steps), engine.requests[0].output_ids


class PhaseTimers:
    """Timers on one engine's phases, through forward hooks and wrapped bound methods (the
    engine's own code is not changed). Seconds per phase, summed over the steps timed."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.handles, self.restore = [], []
        self.step_seconds = 0.0

    def attach(self, engine) -> None:
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.runner, "build_meta", "metadata")
        self.wrap(engine, "sample", "sample")
        self.wrap(engine, "commit", "commit")
        model = engine.model
        for layer in model.model.layers:
            self.hook(layer.self_attn, "attention")
            self.hook(layer.mlp, "mlp")
            self.hook(layer.input_layernorm, "norms")
            self.hook(layer.post_attention_layernorm, "norms")
        self.hook(model.model.norm, "norms")
        self.hook(model.lm_head, "head")
        self.wrap(engine, "step", None)  # the whole step: "other" is what the phases leave

    def wrap(self, obj, name: str, phase: str | None) -> None:
        """Time `obj.name(...)` into `phase` (None: the whole step)."""
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if phase is None:
                    self.step_seconds += time.perf_counter() - start
                else:
                    self.seconds[phase] += time.perf_counter() - start
        setattr(obj, name, timed)
        self.restore.append((obj, name))

    def hook(self, module, phase: str) -> None:
        starts = []
        self.handles.append(module.register_forward_pre_hook(lambda m, a: starts.append(time.perf_counter())))

        def done(m, a, out):
            self.seconds[phase] += time.perf_counter() - starts.pop()
        self.handles.append(module.register_forward_hook(done))

    def detach(self) -> None:
        """Remove the timers; "other" becomes the steps' time the phases do not account for."""
        for handle in self.handles:
            handle.remove()
        for obj, name in self.restore:
            delattr(obj, name)  # the class's method shows through again
        self.seconds["other"] = self.step_seconds - sum(v for k, v in self.seconds.items() if k != "other")


class StepClock:
    """A logits processor noting the time each generate step reaches it: the differences are HF's
    decode steps (its forward, its sampling and its bookkeeping), timed like the engine's."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

    def median_step(self) -> float:
        return statistics.median(b - a for a, b in zip(self.times, self.times[1:]))


def hf_decode_run(hf_model, batch_prompts: list[list[int]], new: int) -> tuple[float, list[int]]:
    """One HF generate of `new` tokens (new >= 2): its median decode step seconds, and the first
    request's ids."""
    from transformers import LogitsProcessorList

    ids = torch.tensor(batch_prompts)
    clock = StepClock()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    return clock.median_step(), out[0, PROMPT_LEN:].tolist()


def hf_decode_step(hf_model, batch_prompts: list[list[int]], new: int) -> tuple[float, list[int]]:
    """HF generate's median decode step seconds, the best of three runs, and the first request's ids."""
    hf_decode_run(hf_model, batch_prompts, 2)  # warm-up
    runs = [hf_decode_run(hf_model, batch_prompts, new) for _ in range(3)]
    return min(s for s, _ in runs), runs[0][1]


def bench_model(label: str, model_dir: Path, args) -> list[dict]:
    cfg = load_config(model_dir)
    model = load_engine_model(model_dir)
    hf_model = hf.load_hf_model(str(model_dir))
    machine = measure_machine(cfg)
    cost = ModelCost.of(cfg, itemsize=4)
    rows = []
    for batch in args.batches:
        batch_prompts = prompts(batch, cfg.vocab_size)
        decode_steps(model, batch_prompts[:1], 3)  # warm-up
        runs = [decode_steps(model, batch_prompts, args.new) for _ in range(args.repeat)]
        ours = min(s for s, _ in runs)
        theirs, hf_ids = hf_decode_step(hf_model, batch_prompts, args.new)
        timers = PhaseTimers()
        decode_steps(model, batch_prompts, args.new, timers)
        steps = args.new - 1
        timed_s = timers.step_seconds / steps  # the mean, as the phases are: they add up inside it
        floor = cost.floor_s(StepShape.of_requests([(PROMPT_LEN + args.new // 2, 1)] * batch), machine)
        rows.append({"model": label, "requests": batch, "step ms": 1e3 * ours, "HF step ms": 1e3 * theirs,
                     "HF / ours": theirs / ours, "floor ms": 1e3 * floor, "% of floor": 100 * floor / ours,
                     **{f"{p} ms": 1e3 * timers.seconds[p] / steps for p in PHASES}, "timed step ms": 1e3 * timed_s,
                     "ids = HF": runs[0][1] == hf_ids})
    rows[0]["machine"] = machine.line()
    return rows


def reading(rows: list[dict]) -> str:
    """What the smallest batch of each model says, in its own numbers."""
    out = []
    for row in rows:
        if row["requests"] != min(r["requests"] for r in rows if r["model"] == row["model"]):
            continue
        share = {p: row[f"{p} ms"] / row["timed step ms"] for p in PHASES}
        out.append(f"{row['model']}, {row['requests']} request(s): the step takes {row['step ms'] / row['floor ms']:.1f}x "
                   f"its floor; of the timed step, attention {share['attention']:.0%}, MLP {share['mlp']:.0%}, "
                   f"norms {share['norms']:.0%}, head {share['head']:.0%}, scheduling and metadata "
                   f"{share['schedule'] + share['metadata']:.0%}, sampling and commit "
                   f"{share['sample'] + share['commit']:.0%}, the rest {share['other']:.0%}.")
    return " ".join(out)


def draw(rows: list[dict], path: str) -> None:
    """One panel per model: per batch size, the timed step's phases stacked, the floor and HF's step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 1, figsize=(8, 1.2 + 1.3 * len(rows)), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in rows if r["model"] == model]
        labels = [f"{r['requests']} req." for r in mine]
        left = [0.0] * len(mine)
        for i, phase in enumerate(PHASES):
            widths = [r[f"{phase} ms"] for r in mine]
            ax.barh(labels, widths, left=left, color=colors[i % len(colors)], label=phase)
            left = [a + b for a, b in zip(left, widths)]
        ax.scatter([r["floor ms"] for r in mine], labels, marker="|", s=400, color="black", zorder=3, label="floor")
        ax.scatter([r["HF step ms"] for r in mine], labels, marker="x", s=60, color="red", zorder=3,
                   label="HF's step")
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("ms per decode step")
    axes[0, 0].legend(fontsize=7, ncol=4, loc="best")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows: list[dict], command: str, load_at_start: str, threads: int, picture: str | None) -> str:
    """`picture`: the plot's path relative to the markdown file, or None."""
    image = f"\n\n![a decode step's phases beside its floor and HF's step]({picture})" if picture else ""
    return (f"## Where a decode step's time goes\n\n{machine_line(threads, load_at_start)}\n\n`{command}`; "
            f"B requests of {PROMPT_LEN} random prompt tokens decode together; \"step ms\" and \"HF step ms\": the "
            "median decode step of a run, the best of the runs (HF's `generate` timed by a logits processor); per "
            "phase, the mean over the decode steps of one run with timers attached (\"timed step ms\", the mean "
            "step of that run). "
            f"{rows[0]['machine']}.\n\n" + markdown_table(rows, COLUMNS + ["ids = HF"]) + "\n\n" + reading(rows)
            + " A small model's step is dispatch-bound: each torch operation costs microseconds whatever its size, "
            "so far from its floor the step's time follows the number of operations, not the bytes." + image)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_at_start = load_average()
    model_dir = resolve_model_dir(args.model)
    rows = bench_model(model_dir.name, model_dir, args)
    if not args.skip_06b:
        with tempfile.TemporaryDirectory() as tmp:
            config = {k: v for k, v in QWEN3_0_6B.items() if k != "num_hidden_layers"}
            path = make_random_model(Path(tmp) / "qwen3-0.6b-shaped", hf_init=False,
                                     num_hidden_layers=args.layers_06b, **config)
            rows += bench_model(f"0.6B-shaped, {args.layers_06b} layers", path, args)
    print_table(rows, COLUMNS + ["ids = HF"], floatfmt=".2f")
    if args.markdown:
        command = bench_command("bench_step.py", sys.argv[1:] if argv is None else argv)
        replace_section(args.markdown, "bench_step", markdown(
            rows, command, load_at_start, args.threads,
            args.plot and os.path.relpath(args.plot, Path(args.markdown).resolve().parent)))
    if args.plot:
        draw(rows, args.plot)
    return 0 if all(r["ids = HF"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, "nothing was written"))
