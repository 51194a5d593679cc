#!/usr/bin/env python3
"""L1 smoke test: greedy decoding with one contiguous KV cache per layer, checked against HF."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    import torch  # noqa: E402

    from harness.forcing import force_contiguous  # noqa: E402
    from harness.smoke import LessonRun, RequestResult, run_smoke  # noqa: E402
    from l1_contiguous import ContiguousKvCache, InputError, Qwen3ForCausalLM, greedy_generate  # noqa: E402


LESSON = "L1"


def add_options(parser):
    parser.add_argument("--cache-len", type=int, default=None,
                        help="positions in each request's contiguous cache (default: prompt + max-new-tokens)")


def run(args, setup) -> LessonRun:
    model = Qwen3ForCausalLM.from_pretrained(setup.model_dir, setup.dtype, setup.device)
    results, cache_bytes = [], 0
    for prompt in setup.prompts:
        need = len(prompt.ids) + setup.max_new_tokens
        cache_len = need if args.cache_len is None else args.cache_len
        if cache_len < need:
            raise InputError(f"--cache-len {cache_len} is shorter than prompt ({len(prompt.ids)}) + "
                             f"--max-new-tokens ({setup.max_new_tokens}); raise --cache-len")
        cache = ContiguousKvCache(setup.cfg, cache_len, setup.dtype, setup.device)
        gen = greedy_generate(model, prompt.ids, setup.max_new_tokens, cache)
        results.append(RequestResult(prompt.ids, gen.new_ids, logits=torch.stack(gen.logits)))
        cache_bytes = max(cache_bytes, cache.nbytes())
    return LessonRun(results, {"kv_bytes_per_token": setup.cfg.kv_bytes_per_token(model.dtype.itemsize),
                               "largest_cache_bytes": cache_bytes})


def teacher_force(args, setup, paths):
    """L1 has no runner to force: feed each request HF's ids through a contiguous cache instead."""
    model = Qwen3ForCausalLM.from_pretrained(setup.model_dir, setup.dtype, setup.device)
    for prompt, path in paths.paths.items():
        for g, row in enumerate(force_contiguous(model, list(prompt), path)):
            paths.rows[prompt][g].append(row)
    return paths


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options, teacher_force=teacher_force))
