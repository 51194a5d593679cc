#!/usr/bin/env python3
"""L8 smoke test: requests that share a long system prompt, and one prompt sampled n = 3 times, run
with prefix sharing on (or off); every request and every sample must end with the ids HF gives its
prompt alone, and every block must be free (or cached free) at the end."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # l5_smoke, whose pool check L8 keeps

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    import l5_smoke  # noqa: E402
    from harness.smoke import LessonRun, RequestResult, encode, run_smoke  # noqa: E402
    from l1_contiguous import InputError  # noqa: E402
    from l2_paged import blocks_needed  # noqa: E402
    from l3_block_kernel import check_backend_device  # noqa: E402
    from l5_eviction.mixed import ENGINE_BACKENDS  # noqa: E402
    from l5_eviction import DEFAULT_PREFILL_CHUNK, MODES, engine_backend, load_engine_model  # noqa: E402
    from l8_prefix import SampledWorkItem, make_prefix_engine  # noqa: E402


LESSON = "L8"
# A KJV-style "system prompt" every default request starts with (85 tokens with the embedded
# tokenizer: 5 full blocks of 16 are shared, the rest of each prompt is its own).
SYSTEM_PROMPT = (
    "Thou art a faithful scribe of the house of the LORD, and thou shalt answer in the words of the "
    "book of the law. Speak not of thine own heart, neither add thou unto the words, nor take away "
    "from them; but let thy speech be yea, yea, and nay, nay. And whatsoever is asked of thee, answer "
    "it plainly, as a wise servant answereth his master.")
TAILS = [  # (text after the system prompt, samples)
    ("In the beginning God created", 1),
    ("And the LORD spake unto Moses, saying", 1),
    ("Hear, O Israel", 1),
    ("The LORD is my shepherd", 1),
    ("And God said, Let there be light", 3),  # n = 3: its partial last block is copied on write
]


def add_options(parser):
    parser.add_argument("--prefix-sharing", choices=["on", "off"], default="on",
                        help="share cached full blocks between requests and samples (default: on)")
    parser.add_argument("--n", type=int, default=1,
                        help="samples per given prompt (greedy, so all must equal HF); default 1. "
                             "The default workload has its own: 1 for four prompts, 3 for the fifth")
    parser.add_argument("--arrivals", choices=["staggered", "together"], default="staggered",
                        help="staggered (default): one request per step, each finds the earlier ones' "
                             "blocks cached; together: all at step 0, and the engine holds the later "
                             "ones until the first has computed the shared blocks (held_for_prefix)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="pool size (default: enough for every request and sample without sharing)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help="at most this many prompt tokens per step, all prefills together "
                             f"(default {DEFAULT_PREFILL_CHUNK}, the engine's)")
    parser.add_argument("--preempt", choices=MODES, default="recompute",
                        help="how a request is preempted when the pool runs out (default: recompute)")
    parser.add_argument("--cascade", choices=["auto", "always", "off"], default="auto",
                        help="L4's cascade attention over the blocks every request of a step shares: auto "
                             "(default) when at least 8 requests share 256 tokens or more, always when two "
                             "requests share a block, or off")
    parser.add_argument("--backend", choices=ENGINE_BACKENDS, default=None,
                        help="attention: L4's paged path for every row (default: kernel on CUDA, cpu for "
                             "float32 on a CPU, else reference; emulated: the CUDA kernel's own code on the CPU, slowly)")


def workload(args, setup) -> list[SampledWorkItem]:
    """Given prompts (each --n times), or the default: five prompts behind one system prompt.

    One request arrives per step, so each later one finds the system prompt's blocks cached
    (--arrivals together: all at step 0; the later ones are held a step for the first's blocks).
    The default prompts are tokenized piece by piece and joined, so all start with the same ids.
    """
    if args.prompt or args.prompt_ids or setup.tokenizer is None:
        prompts = [(p.ids, args.n) for p in setup.prompts]
    else:
        system = encode(setup.tokenizer, SYSTEM_PROMPT)
        prompts = [(system + encode(setup.tokenizer, "\n" + tail), n) for tail, n in TAILS]
    step = 1 if args.arrivals == "staggered" else 0
    return [SampledWorkItem(ids, setup.max_new_tokens, arrival_step=i * step, n=n)
            for i, (ids, n) in enumerate(prompts)]


def check_options(args) -> None:
    if args.n < 1:
        raise InputError(f"--n must be at least 1 (samples per prompt), got {args.n}")
    for name, value in (("--block-size", args.block_size), ("--prefill-chunk", args.prefill_chunk)):
        if value < 1:
            raise InputError(f"{name} must be at least 1, got {value}")


def demand(items: list[SampledWorkItem], block_size: int) -> list[int]:
    """Blocks each request and sample needs alone, without sharing."""
    return [blocks_needed(len(w.prompt_ids) + w.max_new_tokens, block_size) for w in items for _ in range(w.n)]


def pool_blocks(args, items: list[SampledWorkItem]) -> int:
    need = demand(items, args.block_size)
    num_blocks = sum(need) if args.num_blocks is None else args.num_blocks
    return l5_smoke.checked_pool(num_blocks, items, args.block_size)


def run(args, setup) -> LessonRun:
    check_options(args)
    items = workload(args, setup)
    num_blocks = pool_blocks(args, items)
    model = load_engine_model(setup.model_dir, setup.dtype, setup.device)
    backend = args.backend or engine_backend(setup.device, setup.dtype)
    check_backend_device(backend, setup.device)
    engine = make_prefix_engine(model, num_blocks, args.block_size, prefix_sharing=args.prefix_sharing == "on",
                                preempt=args.preempt, prefill_chunk=args.prefill_chunk, backend=backend)
    engine.kv.cascade = args.cascade != "off"
    if args.cascade == "always":
        engine.kv.cascade_min_requests, engine.kv.cascade_min_prefix_tokens = 2, 0
    requests = engine.run(items)
    engine.alloc.check()  # every block in exactly one place, no negative count, key maps agree
    ordered = sorted(requests.values(), key=lambda r: (r.group, r.sample_index))
    n_of = {r.group: 1 + max(s.sample_index for s in ordered if s.group == r.group) for r in ordered}
    results = [RequestResult(r.prompt_ids, r.output_ids, label=_label(r, n_of[r.group])) for r in ordered]
    return LessonRun(results, figures(args, engine, items, backend))


def _label(req, n: int) -> str:
    sample = f", sample {req.sample_index + 1} of {n}" if n > 1 else ""
    return f"arrives at step {req.arrival_step}{sample}"


def figures(args, engine, items, backend) -> dict:
    """Engine counters at the end, plus the peaks of the per-step metrics (at the end nothing runs)."""
    timeline = engine.metrics_timeline
    summary = engine.summary()
    out = {"backend": backend, "cascade": args.cascade, "prefix_sharing": args.prefix_sharing, "preempt_mode": args.preempt,
           "block_size": args.block_size, "prefill_chunk": args.prefill_chunk, "arrivals": args.arrivals, "requests_and_samples": sum(w.n for w in items),
           "blocks_demanded": sum(demand(items, args.block_size)), **summary}
    # Prompt tokens every request and sample needed K/V for; with sharing on, forks get theirs from
    # their parent (fork_shared_tokens) instead of being admitted, so this is the total to compare.
    out["prefill_tokens_needed"] = summary["prefill_tokens_total"] + summary["fork_shared_tokens"]
    out["preemptions"] = summary["preempted_recompute"] + summary["preempted_swap"]
    out["peak_memory_utilization"] = max(m["memory_utilization"] for m in timeline)
    out["peak_sharing_ratio"] = max(m["sharing_ratio"] for m in timeline)
    out["peak_blocks_saved"] = max(m["blocks_saved"] for m in timeline)
    out["peak_shared_blocks"] = max(m["shared_blocks_now"] for m in timeline)
    out["held_for_prefix_per_step"] = [m["held_for_prefix"] for m in timeline]
    out["all_blocks_free_at_end"] = summary["blocks_free_at_end"] == summary["blocks_total"]
    return out


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options))
