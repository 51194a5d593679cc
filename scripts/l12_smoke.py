#!/usr/bin/env python3
"""L12 smoke test: L8's workload (a shared system prompt, one prompt sampled n = 3 times) on a pool
that stores K and V in fp8 e4m3 or int8 with calibrated scales; every request's ids must equal
those of HF's Qwen3 running a cache that quantizes the same way (harness/quantized_cache.py), and
every block must be free (or cached free) at the end. Also reports what the quantization costs
against the float32 pool on held-out King James text (top-1 agreement, KL, perplexity)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # l8_smoke: L12 runs L8's workload

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    import l8_smoke  # noqa: E402
    from harness.quantized_cache import QuantizingCache  # noqa: E402
    from harness.smoke import LessonRun, RequestResult, encode, run_smoke  # noqa: E402
    from l3_block_kernel import check_backend_device  # noqa: E402
    from l5_eviction import engine_backend  # noqa: E402
    from l12_quantized_kv import FORMATS, GRANULARITIES, kv_format  # noqa: E402
    from l12_quantized_kv.accuracy import CALIBRATION_TEXT, HELDOUT_TEXT, accuracy_cost, read_passages  # noqa: E402
    from l12_quantized_kv.engine import calibrate, load_quantized_model, make_quantized_engine  # noqa: E402


LESSON = "L12"


def add_options(parser):
    l8_smoke.add_options(parser)
    parser.add_argument("--kv-format", choices=list(FORMATS), default="fp8",
                        help="how the pool stores K and V: fp8 (e4m3) or int8 (default fp8)")
    parser.add_argument("--scales", choices=list(GRANULARITIES), default="head",
                        help="head: one calibrated scale per layer and KV head (default); tensor: one per "
                             "layer; one: 1.0 everywhere, no calibration")
    parser.add_argument("--no-accuracy", action="store_true",
                        help="skip the accuracy figures against the float32 pool")


def calibration_prompts(setup) -> tuple[list[list[int]], str]:
    """The calibration text when the model has a tokenizer, else the prompts themselves."""
    if setup.tokenizer is None:
        return [p.ids for p in setup.prompts], "the prompts (no tokenizer)"
    limit = setup.cfg.max_position_embeddings
    return [encode(setup.tokenizer, p)[:limit] for p in read_passages(CALIBRATION_TEXT)], CALIBRATION_TEXT.name


def run(args, setup) -> LessonRun:
    l8_smoke.check_options(args)
    items = l8_smoke.workload(args, setup)
    num_blocks = l8_smoke.pool_blocks(args, items)
    model = load_quantized_model(setup.model_dir, setup.dtype, setup.device)
    backend = args.backend or engine_backend(setup.device, setup.dtype)
    check_backend_device(backend, setup.device)
    calibration, calibrated_on = calibration_prompts(setup)
    scales = calibrate(model, calibration, kv_format(args.kv_format), args.scales, args.block_size)
    engine = make_quantized_engine(model, scales, num_blocks, args.block_size,
                                   prefix_sharing=args.prefix_sharing == "on", preempt=args.preempt,
                                   prefill_chunk=args.prefill_chunk, backend=backend)
    requests = engine.run(items)
    engine.alloc.check()
    ordered = sorted(requests.values(), key=lambda r: (r.group, r.sample_index))
    n_of = {r.group: 1 + max(s.sample_index for s in ordered if s.group == r.group) for r in ordered}
    results = [RequestResult(r.prompt_ids, r.output_ids, label=l8_smoke._label(r, n_of[r.group])) for r in ordered]
    figures = l8_smoke.figures(args, engine, items, backend)
    figures.update(kv_format=args.kv_format, scales=args.scales, calibrated_on=calibrated_on,
                   k_scale_range=_range(scales.k), v_scale_range=_range(scales.v))
    if not args.no_accuracy and setup.tokenizer is not None:
        limit = setup.cfg.max_position_embeddings
        heldout = [encode(setup.tokenizer, p)[:limit] for p in read_passages(HELDOUT_TEXT)]
        cost = accuracy_cost(model, scales, heldout, args.block_size)
        figures["accuracy_vs_float32"] = {k: round(v, 5) if isinstance(v, float) else v for k, v in cost.items()}
    oracle = QuantizingCache(args.kv_format, [s.to(setup.device) for s in scales.k],
                             [s.to(setup.device) for s in scales.v])
    return LessonRun(results, figures, hf_cache=oracle)


def _range(layers) -> list[float]:
    values = [float(x) for s in layers for x in s]
    return [min(values), max(values)]


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options))
