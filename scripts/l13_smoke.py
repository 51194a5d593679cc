#!/usr/bin/env python3
"""L13 smoke test: a hybrid model (sliding-window layers beside full ones) through the engine with
one block table per KV cache group. By default the embedded model runs as a hybrid: layers 0 and 2
read the last 64 positions, 1 and 3 everything, on passages of text longer than the window, in two
turns: each conversation comes back with its answer and a follow-up, and finds its first turn
cached (the hybrid hit rule). Every request must end with HF's ids for the same hybrid config; a
sliding group must never hold more than ceil(W / block_size) + 1 blocks in a decode; every block
must be free (or cached free) at the end."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    from harness.smoke import LessonRun, RequestResult, encode, run_smoke  # noqa: E402
    from harness.tiny_models import EMBEDDED_HYBRID_WINDOW, as_hybrid  # noqa: E402
    from l1_contiguous import InputError, load_config  # noqa: E402
    from l1_contiguous.config import MIN_WINDOW, WINDOW_1_WHY  # noqa: E402
    from l3_block_kernel import check_backend_device  # noqa: E402
    from l5_eviction.mixed import ENGINE_BACKENDS  # noqa: E402
    from l5_eviction import DEFAULT_PREFILL_CHUNK, MODES, WorkItem, engine_backend  # noqa: E402
    from l13_sliding_window import blocks_at_peak, kv_cache_groups, load_hybrid_model, make_hybrid_engine  # noqa: E402


LESSON = "L13"
PASSAGES = Path(__file__).resolve().parent.parent / "assets" / "kjv-heldout.txt"
DEFAULT_SPANS = [(0, 150), (700, 90), (1400, 40), (2100, 130)]  # (character offset, prompt tokens)
FOLLOW_UP = (2800, 20)  # the second turn's new text, after each first turn's prompt and answer


def add_options(parser):
    parser.add_argument("--as-hybrid", choices=["auto", "off"], default="auto",
                        help="auto (default): a model whose config has no sliding layers runs as a hybrid "
                             "(--window, --sliding-layers) through a copy of its config; off: as it is")
    parser.add_argument("--window", type=int, default=EMBEDDED_HYBRID_WINDOW,
                        help=f"sliding window in positions for --as-hybrid, at least 2 (default "
                             f"{EMBEDDED_HYBRID_WINDOW}; HF's cache does not slide a window of 1)")
    parser.add_argument("--sliding-layers", default=None,
                        help="layers that slide for --as-hybrid, e.g. 0,2 (default: every other layer from 0)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="pool size, at least 1 (default, when not given: enough for every request at once)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help=f"at most this many prompt tokens per step (default {DEFAULT_PREFILL_CHUNK})")
    parser.add_argument("--preempt", choices=MODES, default="recompute",
                        help="how a request is preempted when the pool runs out (default: recompute)")
    parser.add_argument("--prefix-sharing", choices=["on", "off"], default="on",
                        help="reuse cached blocks under the hybrid hit rule (default: on)")
    parser.add_argument("--hit-rule", choices=["hybrid", "all-blocks"], default="hybrid",
                        help="hybrid (default): a hit needs what the next token reads; all-blocks: every block "
                             "of every group, as a cache that ignores windows asks")
    parser.add_argument("--keep-behind-window", action="store_true",
                        help="blocks a window left behind stay cached for later hits (default: they are freed)")
    parser.add_argument("--turns", type=int, choices=[1, 2], default=2,
                        help="2 (default): each request comes back once, with its answer and a follow-up")
    parser.add_argument("--backend", choices=ENGINE_BACKENDS, default=None,
                        help="attention: L4's paged path for every row (default: kernel on CUDA, cpu for "
                             "float32 on a CPU, else reference; emulated: the CUDA kernel's own code on the CPU, slowly)")


def hybrid_folder(args, setup) -> None:
    """Point `setup` at a hybrid copy of the model's config, unless it is a hybrid already (or --as-hybrid off)."""
    if args.as_hybrid == "off" or setup.cfg.sliding_layers:
        return
    layers = setup.cfg.num_hidden_layers
    sliding = parse_layers(args.sliding_layers, layers) if args.sliding_layers else set(range(0, layers, 2))
    if args.window < 1:
        raise InputError(f"--window must be at least 1 position, got {args.window}; and 1 is refused too (HF's "
                         f"cache does not slide it): use {MIN_WINDOW} or more")
    if args.window < MIN_WINDOW:
        raise InputError(f"--window {args.window} is refused, use {MIN_WINDOW} or more: {WINDOW_1_WHY}")
    folder = Path(tempfile.mkdtemp(prefix="l13-hybrid-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    types = ["sliding_attention" if i in sliding else "full_attention" for i in range(layers)]
    args.hybrid_copy = (str(folder), str(setup.model_dir))  # (the copy, the user's folder) for messages
    setup.model_dir = as_hybrid(setup.model_dir, folder, args.window, types)
    setup.cfg = load_config(setup.model_dir)


def load_model(args, setup):
    """The hybrid model. The copy's files are links to the user's, so an error about one of them
    (weights cut short) names the user's file, the one to fix, not the temporary copy."""
    try:
        return load_hybrid_model(setup.model_dir, setup.dtype, setup.device)
    except InputError as exc:
        copy, theirs = getattr(args, "hybrid_copy", ("", ""))
        if not copy or copy not in str(exc):
            raise
        raise type(exc)(str(exc).replace(copy, theirs)) from None


def parse_layers(spec: str, num_layers: int) -> set[int]:
    try:
        layers = {int(part) for part in spec.split(",") if part.strip()}
    except ValueError:
        raise InputError(f"--sliding-layers takes layer numbers like 0,2, got {spec!r}") from None
    if not layers or not all(0 <= i < num_layers for i in layers):
        raise InputError(f"--sliding-layers must name layers from 0 to {num_layers - 1}, got {spec!r}")
    return layers


def workload(args, setup) -> list[WorkItem]:
    """Given prompts, or passages of held-out text longer than the window (one arriving per step)."""
    if args.prompt or args.prompt_ids or setup.tokenizer is None:
        prompts = [p.ids for p in setup.prompts]
    else:
        text = PASSAGES.read_text()
        prompts = [encode(setup.tokenizer, text[start:])[:length] for start, length in DEFAULT_SPANS]
    return [WorkItem(ids, setup.max_new_tokens, arrival_step=i) for i, ids in enumerate(prompts)]


def follow_up(args, setup, prompt: list[int]) -> list[int]:
    """The second turn's new text: a passage of the held-out text, or (raw ids) the prompt's first ids."""
    if setup.tokenizer is None or args.prompt_ids:
        return prompt[:8]
    start, length = FOLLOW_UP
    return encode(setup.tokenizer, PASSAGES.read_text()[start:])[:length]


def run(args, setup) -> LessonRun:
    for name, value in (("--block-size", args.block_size), ("--num-blocks", args.num_blocks),
                        ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and value < 1:  # --num-blocks 0 is no pool, not "the default"
            raise InputError(f"{name} must be at least 1, got {value}")
    hybrid_folder(args, setup)
    items = workload(args, setup)
    groups = kv_cache_groups(setup.cfg)
    longest = max(len(w.prompt_ids) for w in items) * 2 + setup.max_new_tokens + 20  # a second turn, at most
    peaks = [blocks_at_peak(groups, longest + w.max_new_tokens - 1, args.block_size, args.prefill_chunk)
             for w in items]
    model = load_model(args, setup)
    backend = args.backend or engine_backend(setup.device, setup.dtype)
    check_backend_device(backend, setup.device)
    num_blocks = sum(peaks) if args.num_blocks is None else args.num_blocks
    engine = make_hybrid_engine(model, num_blocks, args.block_size, preempt=args.preempt,
                                prefill_chunk=args.prefill_chunk, backend=backend,
                                prefix_sharing=args.prefix_sharing == "on", hybrid_hit_rule=args.hit_rule == "hybrid",
                                keep_behind_window=args.keep_behind_window)
    first = list(engine.run(items).values())
    if args.turns == 2:  # each conversation comes back after its first turn has finished
        # The teacher-forced rerun (bf16, harness/forcing.py) sends the first run's second turns: its
        # first turns follow HF's ids, and prompts built from those would not be the ones compared.
        if getattr(args, "second_turn_prompts", None) is None:
            args.second_turn_prompts = [r.tokens + follow_up(args, setup, r.prompt_ids) for r in first]
        engine.run([WorkItem(prompt, r.max_new_tokens, arrival_step=engine.now + i)
                    for i, (prompt, r) in enumerate(zip(args.second_turn_prompts, first))])
    results = [RequestResult(r.prompt_ids, r.output_ids,
                             label=f"turn {1 + (r.request_id >= len(items))}, arrives at step {r.arrival_step}")
               for r in engine.requests.values()]
    summary = engine.summary()
    keep = ("kv_cache_groups", "layers_per_group", "padding_layer_slots", "sliding_windows", "bytes_per_block", "blocks_total",
            "blocks_peak_used", "blocks_free_at_end", "decode_window_blocks_peak", "decode_window_block_bound",
            "preempted_recompute", "preempted_swap", "tokens_recomputed", "steps", "prefill_tokens_total",
            "prefix_hit_tokens", "hit_rate", "cow_copies")
    figures = {"backend": backend, "block_size": args.block_size, "prefill_chunk": args.prefill_chunk,
               "preempt_mode": args.preempt, "prefix_sharing": args.prefix_sharing, "hit_rule": args.hit_rule,
               "keep_behind_window": args.keep_behind_window, "sliding_layers": list(setup.cfg.sliding_layers),
               **{key: summary[key] for key in keep}, "blocks_demanded": sum(peaks),
               "window_bound_held": summary["decode_window_blocks_peak"] <= summary["decode_window_block_bound"],
               "all_blocks_free_at_end": summary["blocks_free_at_end"] == summary["blocks_total"]}
    engine.alloc.check()  # every block in exactly one place, key maps agree
    if not figures["window_bound_held"] or not figures["all_blocks_free_at_end"]:
        raise AssertionError(f"the engine broke its own bound or leaked: {figures}")  # a bug: exit 3
    return LessonRun(results, figures)


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options))
