#!/usr/bin/env python3
"""Every lesson's smoke script in bfloat16 (or float16), judged by harness/compare.py's rule, with
the teacher-forced comparison run on every request (--teacher-forced always), so the table shows
how far our logits are from HF's along HF's own path even where the ids agree.

    python scripts/bench_bf16.py                         # embedded model, CPU, bfloat16
    python scripts/bench_bf16.py --shape-0.6b --layers 28 # a random Qwen3-0.6B-shaped model too
    python scripts/bench_bf16.py --device cuda --markdown docs/benchmarks.md

Per lesson: requests whose ids equal HF's, requests that diverge at a near-tie and match HF
teacher-forced, failures, and the largest teacher-forced |logit difference| (in logits and in
spacings of bfloat16 at the row's magnitude: the unit the rule's bounds are stated in).
Exit status: 0 when every run passes the rule, 1 otherwise, 2 on bad options.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import OneLineParser, run_main, starting  # noqa: E402

with starting():
    import argparse  # noqa: E402
    import json  # noqa: E402
    import subprocess  # noqa: E402
    import tempfile  # noqa: E402
    import time  # noqa: E402

    from harness import compare  # noqa: E402
    from harness.benchmark import check_bench_args, markdown_table, print_table, replace_section  # noqa: E402
    from harness.tiny_models import QWEN3_0_6B, make_random_model  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
LESSONS = ["l1", "l2", "l3", "l5", "l8", "l10", "l11"]
COLUMNS = ["model", "lesson", "requests", "equal", "near-tie", "fail", "max forced diff",
           "in spacings", "seconds", "verdict"]
# Without a tokenizer (the random 0.6B shape) the prompts are given as ids; L10's draft model
# defaults to the embedded one, which has another vocabulary, so only prompt lookup runs there.
SHAPE_PROMPTS = [[(7 * i + 3 * j) % 150000 + 100 for j in range(n)] for i, n in enumerate((5, 17, 33))]


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--lessons", default=",".join(LESSONS), help="comma-separated (default: all)")
    p.add_argument("--shape-0.6b", dest="shape_06b", action="store_true",
                   help="also a random model with Qwen3-0.6B's shapes (made in a temporary folder)")
    p.add_argument("--layers", type=int, default=28, help="layers of the 0.6B-shaped model (default 28)")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--markdown", default=None, help="rewrite this file's bf16 section (docs/benchmarks.md)")
    args = check_bench_args(p.parse_args(argv), p)
    lessons = [x for x in args.lessons.replace(" ", "").split(",") if x]
    unknown = [x for x in lessons if x not in LESSONS]
    if unknown or not lessons:
        p.error(f"--lessons {','.join(unknown) or '(empty)'}: choose from {','.join(LESSONS)}")
    args.lessons = lessons
    return args


def run_lesson(lesson: str, model_dir: Path | None, args) -> tuple[dict | None, float, str]:
    argv = [sys.executable, str(SCRIPTS / f"{lesson}_smoke.py"), "--dtype", args.dtype, "--device", args.device,
            "--teacher-forced", "always", "--max-new-tokens", str(args.max_new_tokens), "--json"]
    if model_dir is not None:
        argv += ["--model", str(model_dir)]
        for ids in SHAPE_PROMPTS:
            argv += ["--prompt-ids", ",".join(map(str, ids))]
        if lesson == "l10":
            argv += ["--drafter", "prompt-lookup"]
    started = time.monotonic()
    run = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.monotonic() - started
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    report = json.loads(last) if last.startswith("{") else None
    return report, seconds, (run.stderr.strip().splitlines() or [""])[-1]


def row_of(label: str, lesson: str, report: dict | None, seconds: float, error: str) -> dict:
    if report is None:
        return {"model": label, "lesson": lesson.upper(), "verdict": f"no report: {error[:80]}", "seconds": seconds}
    kinds = [r["verdict"] for r in report["requests"]]
    diffs = [r.get("teacher_forced_max_logit_diff") or 0.0 for r in report["requests"]]
    spacings = [r.get("teacher_forced_max_spacings") or 0.0 for r in report["requests"]]
    return {"model": label, "lesson": lesson.upper(), "requests": len(kinds), "equal": kinds.count("equal"),
            "near-tie": kinds.count("near-tie"), "fail": kinds.count("fail"), "max forced diff": max(diffs),
            "in spacings": max(spacings), "seconds": seconds, "verdict": "PASS" if report["match"] else "FAIL"}


def models(args, tmp: Path):
    yield "embedded (4 layers)", None
    if args.shape_06b:
        config = {k: v for k, v in QWEN3_0_6B.items() if k != "num_hidden_layers"}
        path = make_random_model(tmp / "qwen3-0.6b-shaped", hf_init=False, num_hidden_layers=args.layers,
                                 dtype="bfloat16", **config)
        yield f"0.6B shape ({args.layers} layers)", path


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, model_dir in models(args, Path(tmp)):
            for lesson in args.lessons:
                rows.append(row_of(label, lesson, *run_lesson(lesson, model_dir, args)))
                print(f"{label} {lesson}: {rows[-1]['verdict']}", flush=True)
    print()
    print_table(rows, COLUMNS, floatfmt=".3g")
    rule = (f"Rule (harness/compare.py): ids equal, or the first divergence is a near-tie (each side's id in "
            f"the other's top {compare.TOP_FEW}, both gaps within {compare.TIE_FACTOR:g}x the logit bound) and "
            f"every teacher-forced row within the logit bound of HF's ({compare.LOGIT_SPACINGS_PER_SQRT_LAYER:g} "
            f"x sqrt(layers) spacings: {compare.logit_spacings(4):g} at 4 layers, {compare.logit_spacings(28):.1f} "
            f"at 28), picking HF's id wherever HF's top-2 gap exceeds the tie bound. 'in spacings': the largest "
            f"teacher-forced difference over every row of every request. {args.device}, {args.dtype}.")
    print(rule)
    if args.markdown:
        text = (f"`python scripts/bench_bf16.py{' --shape-0.6b --layers ' + str(args.layers) if args.shape_06b else ''}"
                f"{' --device ' + args.device if args.device != 'cpu' else ''}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n"
                + markdown_table(rows, COLUMNS, floatfmt=".3g") + "\n\n" + rule)
        replace_section(args.markdown, f"bf16 {args.device}", text)
    return 0 if all(r["verdict"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
