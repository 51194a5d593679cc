#!/usr/bin/env python3
"""L10 smoke test: the prompts decoded with speculation, once per drafter (prompt lookup, then the
embedded draft model), every request's ids equal to HF's greedy ids for its prompt alone; prints
each drafter's acceptance rate and target forwards per generated token, and checks that every
block of the target's pool and of the draft's pool is free (or cached free) at the end."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # l5_smoke, whose pool check L10 keeps

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    import l5_smoke  # noqa: E402
    from harness.smoke import DEFAULT_MODEL, LessonRun, RequestResult, run_smoke  # noqa: E402
    from l1_contiguous import InputError  # noqa: E402
    from l2_paged import blocks_needed  # noqa: E402
    from l3_block_kernel import check_backend_device  # noqa: E402
    from l5_eviction.mixed import ENGINE_BACKENDS  # noqa: E402
    from l5_eviction import engine_backend, load_engine_model  # noqa: E402
    from l8_prefix import SampledWorkItem  # noqa: E402
    from l10_speculative import DraftModelDrafter, PromptLookupDrafter, make_spec_engine  # noqa: E402


LESSON = "L10"
DEFAULT_DRAFT = DEFAULT_MODEL.parent / "tiny-qwen3-kjv-draft"
DRAFTERS = ("prompt-lookup", "draft-model")


def add_options(parser):
    parser.add_argument("--drafter", choices=[*DRAFTERS, "both"], default="both",
                        help="who proposes tokens (default: both, one run each)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model folder (same tokenizer as --model); default: the embedded "
                             "draft when --model is the embedded model")
    parser.add_argument("--k", type=int, default=4, help="proposals per step, 1..16 (default 4)")
    parser.add_argument("--fixed-k", action="store_true",
                        help="always propose k tokens (default: adapt k per request from its acceptance)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="target pool size (default: enough for every request at once)")
    parser.add_argument("--prefix-sharing", choices=["on", "off"], default="on")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (greedy: all equal HF)")
    parser.add_argument("--backend", choices=ENGINE_BACKENDS, default=None,
                        help="attention: L4's paged path for every row (default: kernel on CUDA, cpu for "
                             "float32 on a CPU, else reference; emulated: the CUDA kernel's own code on the CPU, slowly)")


def check_options(args) -> None:
    if not 1 <= args.k <= 16:
        raise InputError(f"--k must be in 1..16 (proposals per step), got {args.k}")
    if args.block_size < 1 or args.n < 1:
        raise InputError(f"--block-size and --n must be at least 1, got {args.block_size} and {args.n}")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise InputError(f"--num-blocks must be at least 1, got {args.num_blocks}; leave it out for a pool that "
                         "holds every request")


def drafters_to_run(args, setup) -> list[str]:
    names = list(DRAFTERS) if args.drafter == "both" else [args.drafter]
    if "draft-model" in names and draft_dir(args, setup) is None:
        if args.drafter == "draft-model":
            raise InputError("--drafter draft-model needs --draft-model DIR for a model other than the "
                             "embedded one (a draft must share the target's tokenizer)")
        names.remove("draft-model")  # "both" on another model: prompt lookup only, said in the figures
    return names


def draft_dir(args, setup) -> Path | None:
    if args.draft_model is not None:
        if not Path(args.draft_model).is_dir():
            raise InputError(f"--draft-model {args.draft_model} is not a folder; pass an HF-format model folder")
        return Path(args.draft_model)
    return DEFAULT_DRAFT if setup.model_dir.resolve() == DEFAULT_MODEL.resolve() else None


def make_drafter(name: str, args, setup, model, num_blocks: int):
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    return DraftModelDrafter.load(draft_dir(args, setup), model, num_blocks, args.block_size)


def run(args, setup) -> LessonRun:
    check_options(args)
    items = [SampledWorkItem(p.ids, setup.max_new_tokens, n=args.n) for p in setup.prompts]
    need = [blocks_needed(len(w.prompt_ids) + w.max_new_tokens, args.block_size) for w in items for _ in range(w.n)]
    num_blocks = l5_smoke.checked_pool(sum(need) if args.num_blocks is None else args.num_blocks, items,
                                        args.block_size)
    model = load_engine_model(setup.model_dir, setup.dtype, setup.device)
    backend = args.backend or engine_backend(setup.device, setup.dtype)
    check_backend_device(backend, setup.device)
    results, figures = [], {"k": args.k, "adaptive_k": not args.fixed_k, "block_size": args.block_size,
                            "prefix_sharing": args.prefix_sharing, "backend": backend}
    for name in drafters_to_run(args, setup):
        drafter = make_drafter(name, args, setup, model, num_blocks)
        engine = make_spec_engine(model, num_blocks, args.block_size, drafter=drafter, k=args.k,
                                  adaptive_k=not args.fixed_k, prefix_sharing=args.prefix_sharing == "on",
                                  backend=backend)
        requests = engine.run(items)
        engine.alloc.check()
        ordered = sorted(requests.values(), key=lambda r: (r.group, r.sample_index))
        results += [RequestResult(r.prompt_ids, r.output_ids, label=f"[{name}]") for r in ordered]
        figures[name] = drafter_figures(engine, drafter)
    return LessonRun(results, figures)


def drafter_figures(engine, drafter) -> dict:
    s = engine.summary()
    out = {key: s[key] for key in ("acceptance_rate", "proposed", "accepted", "forwards", "generated_tokens",
                                   "forwards_per_token", "draft_forwards", "blocks_total", "blocks_peak_used",
                                   "prefix_hit_tokens", "cow_copies")}
    out["acceptance_rate"] = round(out["acceptance_rate"], 3)
    out["forwards_per_token"] = round(out["forwards_per_token"], 3)
    out["preemptions"] = s["preempted_recompute"] + s["preempted_swap"]
    out["all_blocks_free_at_end"] = s["blocks_free_at_end"] == s["blocks_total"]
    if isinstance(drafter, DraftModelDrafter):
        out["draft_blocks_free_at_end"] = drafter.alloc.num_free == drafter.alloc.num_blocks
    return out


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options))
