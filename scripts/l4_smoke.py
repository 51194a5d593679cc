#!/usr/bin/env python3
"""L4 smoke test: L3's batched run with every step on one paged attention for prefill and decode.
Prompts go in chunks of --prefill-chunk tokens, in the same forwards as the decodes of requests
whose prompts are done; each row reads its keys through its block table (no gather, no mask), on
the C++ CPU kernel (float32 on a CPU), the CUDA kernel (on a GPU), its emulation or the PyTorch
reference. Each request must equal HF alone."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # l2_smoke, whose pool options L4 keeps

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    import l2_smoke  # noqa: E402
    from harness.smoke import LessonRun, run_smoke  # noqa: E402
    from l1_contiguous import InputError  # noqa: E402
    from l3_block_kernel import BlockKvPool  # noqa: E402
    from l4_paged_prefill.runner import PagedPrefillRunner, load_prefill_model  # noqa: E402
    from l4_paged_prefill.varlen import BACKENDS  # noqa: E402


LESSON = "L4"
DEFAULT_CHUNK = 7  # not a multiple of the block size: chunks start and end inside blocks


def add_options(parser):
    l2_smoke.add_options(parser)
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="attention: cpu (the C++ kernel, float32), emulated (the CUDA kernel's own code "
                             "on the CPU; slow), kernel (CUDA), reference (PyTorch), or auto (default: kernel "
                             "on CUDA, cpu for float32 on a CPU, else reference)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_CHUNK,
                        help=f"prompt tokens per request per step (default {DEFAULT_CHUNK}); 0 feeds each prompt whole")


def run(args, setup) -> LessonRun:
    l2_smoke.check_options(args)
    if args.prefill_chunk < 0:
        raise InputError(f"--prefill-chunk must be 0 (whole prompts) or positive, got {args.prefill_chunk}")
    if args.backend in ("cpu", "emulated") and setup.device != "cpu":
        raise InputError(f"--backend {args.backend} runs on the CPU; drop --device cuda or use --backend kernel")
    if args.backend == "kernel" and setup.device != "cuda":
        raise InputError("--backend kernel runs on CUDA only; add --device cuda, or use --backend emulated")
    chunk = args.prefill_chunk or None
    model = load_prefill_model(setup.model_dir, setup.dtype, setup.device)
    result = l2_smoke.run_requests(
        args, setup, model, BlockKvPool,
        lambda m, pool, alloc: PagedPrefillRunner(m, pool, alloc, backend=args.backend, prefill_chunk=chunk))
    result.figures = {"backend": args.backend, "prefill_chunk": chunk, **result.figures}
    return result


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options))
