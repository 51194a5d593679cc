#!/usr/bin/env python3
"""The output head's product on a few rows, five ways, against one read of its weights.

logits [rows, vocab] = x [rows, hidden] @ W.T with Qwen3-0.6B's head (151,936 x 1,024, float32,
random): `F.linear` (MKL's sgemm), oneDNN on the plain layout, oneDNN on the weights packed for
4-row blocks (what the engine uses, l5_eviction/fast_linear.py), the head cut into 4,096-row
pieces, and `W @ x.T` (the tall layout); and, for scale, summing W (one read of its 622 MB).
Methods take turns within each round; best of --repeat rounds.

    python scripts/bench_head.py --rows 1,2,4,6,32 --repeat 5
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import OneLineParser, guard_startup, run_main  # noqa: E402

guard_startup()  # Ctrl-C while torch loads: one line, exit 2 (run_main takes over for the work)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.benchmark import check_bench_args, print_table  # noqa: E402
from harness.tiny_models import QWEN3_0_6B  # noqa: E402
from l5_eviction.fast_linear import PackedLinear, onednn_product  # noqa: E402

PIECE = 4096


def methods(weight: torch.Tensor) -> dict:
    dense = torch.nn.Linear(1, 1, bias=False)
    dense.weight = torch.nn.Parameter(weight, requires_grad=False)
    return {"F.linear": lambda x: F.linear(x, weight),
            "oneDNN plain": lambda x: onednn_product(x, weight),
            "oneDNN packed": PackedLinear(dense),
            f"{PIECE}-row pieces": lambda x: torch.cat([F.linear(x, w) for w in weight.split(PIECE)], dim=1),
            "W @ x.T": lambda x: torch.mm(weight, x.t()).t(),
            "sum of W": lambda x: weight.sum()}


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,6,32", help="row counts, comma-separated (default 1,2,4,6,32)")
    p.add_argument("--repeat", type=int, default=5, help="rounds, best kept (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = check_bench_args(p.parse_args(argv), p)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1 or args.repeat < 1 or (args.threads or 1) < 1:
        print("error: --rows takes integers >= 1 separated by commas; --repeat and --threads at least 1",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    weight = torch.randn(QWEN3_0_6B["vocab_size"], QWEN3_0_6B["hidden_size"]) * 0.02
    ways, table = methods(weight), []
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, weight.shape[1])
            want, best = F.linear(x, weight), {name: float("inf") for name in ways}
            for name, way in ways.items():  # warm-up, and every way computes the same logits
                if name != "sum of W":
                    torch.testing.assert_close(way(x), want, rtol=1e-4, atol=1e-4)
            for _ in range(args.repeat):
                for name, way in ways.items():
                    start = time.perf_counter()
                    way(x)
                    best[name] = min(best[name], time.perf_counter() - start)
            table.append({"rows": n, **{f"{name} ms": 1e3 * t for name, t in best.items()},
                          "F.linear / packed": best["F.linear"] / best["oneDNN packed"]})
    print(f"{torch.get_num_threads()} thread(s), load average " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print_table(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
