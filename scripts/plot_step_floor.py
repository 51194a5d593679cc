#!/usr/bin/env python3
"""The time of one engine step against its floor, as the rows per step grow; packed products before/after.

On a random model with Qwen3-0.6B's shapes (--layers of its 28; made in-process, nothing
downloaded), the L5 engine's forward runs decode steps of 1 to 64 requests (each with --context
tokens cached) and prefill chunks of 128 and 256 rows, twice per round: with its large matrix
products (2**20 weights or more: every matrix of Qwen3-0.6B) on oneDNN's packed weights
(l5_eviction/fast_linear.py, the default) and with `nn.Linear` (before). Rounds alternate the
two, best of --repeat kept. Each step's floor is max(bytes / bandwidth, FLOPs / matmul rate),
with the constants measured in the same run (harness.benchmark.measure_machine).
Prints the table and draws docs/img/l5_step_floor.png (--plot PATH to change, --no-plot to skip).

    python scripts/plot_step_floor.py                  # 4 layers, about 5 minutes on 2 quiet cores
    python scripts/plot_step_floor.py --layers 28 --repeat 2
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from harness.benchmark import ModelCost, StepShape, load_average, measure_machine, best_of, print_table  # noqa: E402
from harness.tiny_models import QWEN3_0_6B, make_random_model  # noqa: E402
from l2_paged import BlockAllocator  # noqa: E402
from l3_block_kernel import BlockKvPool  # noqa: E402
from l5_eviction import EngineRequest, KvManager, StepRunner, load_engine_model  # noqa: E402
from l5_eviction.fast_linear import PackedLinear  # noqa: E402

DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_ROWS = (128, 256)
DEFAULT_PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "l5_step_floor.png"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="layers of the 0.6B shape (default 4 of 28)")
    p.add_argument("--context", type=int, default=64, help="cached tokens of each decoding request (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="alternating rounds, best kept (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--plot", default=str(DEFAULT_PLOT), help=f"where to draw the figure (default {DEFAULT_PLOT})")
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    return p.parse_args(argv)


class StepBench:
    """Requests prefilled once; each timed call runs one forward of `rows` rows and advances them."""

    def __init__(self, model, context: int, calls: int):
        cfg, rng = model.config, random.Random(0)
        decode_len = context + calls * 2 * len(DECODE_ROWS) + 1  # every decode point, both ways
        prefill_len = calls * 2 * sum(PREFILL_ROWS) + 1
        lengths = [decode_len] * max(DECODE_ROWS) + [prefill_len]
        tokens = sum(lengths) + 16 * len(lengths)
        pool_blocks = tokens // 16 + len(lengths)
        self.runner = StepRunner(model, KvManager(BlockAllocator(pool_blocks, 16),
                                                  BlockKvPool(cfg, pool_blocks, 16, model.dtype, model.device)))
        self.reqs = [EngineRequest([rng.randrange(cfg.vocab_size) for _ in range(n)], 1, request_id=i)
                     for i, n in enumerate(lengths)]
        per_forward = max(1, 256 // context)  # each decoding request: `context` tokens cached
        for i in range(0, max(DECODE_ROWS), per_forward):
            group = self.reqs[i:min(i + per_forward, max(DECODE_ROWS))]
            self.runner.forward_logits(group, [context] * len(group))

    def run(self, kind: str, rows: int) -> StepShape:
        reqs, num_new = (self.reqs[:rows], [1] * rows) if kind == "decode" else ([self.reqs[-1]], [rows])
        shape = StepShape.of_requests([(r.cur_len, n) for r, n in zip(reqs, num_new)])
        self.runner.forward_logits(reqs, num_new)
        return shape


def linear_sets(model) -> dict:
    """{"packed oneDNN": ..., "nn.Linear": ...}: each a list of (parent, name, module), one per packed product."""
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, PackedLinear)]
    plain = []
    for parent, name, packed in slots:
        linear = torch.nn.Linear(1, 1, bias=False)
        linear.weight = packed.weight  # the same parameter, so the same logits up to summation order
        plain.append((parent, name, linear))
    return {"packed oneDNN": slots, "nn.Linear": plain}


def install(linears: list) -> None:
    for parent, name, module in linears:
        setattr(parent, name, module)


def measure(model, ways: dict, args) -> list[dict]:
    points = [("decode", r) for r in DECODE_ROWS] + [("prefill", r) for r in PREFILL_ROWS]
    bench = StepBench(model, args.context, args.repeat + 1)
    best = {(name, p): float("inf") for name in ways for p in points}
    shapes = {}
    with torch.inference_mode():
        for round_ in range(args.repeat + 1):  # round 0: warm-up
            for point in points:
                for name, linears in ways.items():
                    install(linears)
                    start = time.perf_counter()
                    shapes[point] = bench.run(*point)
                    if round_:
                        best[name, point] = min(best[name, point], time.perf_counter() - start)
            print(f"  round {round_}/{args.repeat} done (load average {load_average()})", flush=True)
    install(ways["packed oneDNN"])
    return [{"kind": kind, "rows": rows, "shape": shapes[kind, rows],
             **{name: best[name, (kind, rows)] for name in ways}} for kind, rows in points]


def draw(table: list[dict], cost: ModelCost, machine, ways, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [t["rows"] for t in table]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in zip(ways, ("o-", "s--")):
        ax.plot(rows, [1e3 * t[name] for t in table], style, label=f"measured, {name}")
    ax.plot(rows, [1e3 * cost.floor_s(t["shape"], machine) for t in table], "k-", lw=2, label="floor")
    ax.plot(rows, [1e3 * cost.bytes(t["shape"]) / machine.read_bytes_per_s for t in table], "k:",
            label="bytes / bandwidth")
    ax.plot(rows, [1e3 * cost.flops(t["shape"]) / machine.matmul_flops_per_s for t in table], "k-.",
            label="FLOPs / matmul rate")
    ax.set(xscale="log", yscale="log", xlabel="rows per step (1-64: decode, 128 and 256: one prefill chunk)",
           ylabel="ms per step", title=title)
    ax.set_xticks(rows, [str(r) for r in rows])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if min(args.layers, args.context, args.repeat, args.threads or 1) < 1:
        print("error: --layers, --context, --repeat and --threads must be at least 1", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        config = {k: v for k, v in QWEN3_0_6B.items() if k != "num_hidden_layers"}
        path = make_random_model(Path(tmp) / "m", hf_init=False, num_hidden_layers=args.layers, **config)
        model = load_engine_model(path)
    if not isinstance(model.lm_head, PackedLinear):
        print("error: this torch has no oneDNN CPU path; nothing to compare", file=sys.stderr)
        return 2
    ways = linear_sets(model)
    before = measure_machine(model.config)
    table = measure(model, ways, args)
    machine = best_of(before, measure_machine(model.config))
    cost = ModelCost.of(model.config, 4)
    print(f"\n{args.layers} layers of the 0.6B shape, {torch.get_num_threads()} thread(s), {machine.line()}, "
          f"load average {load_average()}")
    rows = [{"step": f"{t['kind']} {t['rows']}", **{f"{n} ms": 1e3 * t[n] for n in ways},
             "speed-up": t["nn.Linear"] / t["packed oneDNN"], "floor ms": 1e3 * cost.floor_s(t["shape"], machine),
             "% of floor": 100 * cost.floor_s(t["shape"], machine) / t["packed oneDNN"],
             "bound by": "memory" if cost.bytes(t["shape"]) / machine.read_bytes_per_s
             >= cost.flops(t["shape"]) / machine.matmul_flops_per_s else "compute"} for t in table]
    print_table(rows)
    if not args.no_plot:
        draw(table, cost, machine, ways, args.plot,
             f"One L5 step, Qwen3-0.6B shape ({args.layers} layers), fp32, {torch.get_num_threads()} CPU thread(s), "
             f"load {load_average().split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
