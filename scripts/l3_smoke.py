#!/usr/bin/env python3
"""L3 smoke test: L2's batched run on the block-tensor pool, decode attention walking block tables
(the CUDA kernel on a GPU, its PyTorch reference elsewhere,
or with --backend emulated the kernel's own code on the CPU); each request must equal HF alone."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # l2_smoke, whose pool options L3 keeps

from harness.cli import starting  # noqa: E402

with starting():  # a Ctrl-C during these imports (a second or more) ends in one line, exit 2
    import l2_smoke  # noqa: E402
    from harness.smoke import LessonRun, run_smoke  # noqa: E402
    from l3_block_kernel import (  # noqa: E402
        DECODE_BACKENDS, BlockKvPool, BlockTableRunner, check_backend_device, default_backend, load_block_model)


LESSON = "L3"


def add_options(parser):
    l2_smoke.add_options(parser)
    parser.add_argument("--backend", choices=DECODE_BACKENDS, default=None,
                        help="decode attention: the CUDA kernel, emulated (the kernel's own code on the CPU; "
                             "slow), the PyTorch reference, or gather (PyTorch, copies the blocks; fast on CPU) "
                             "(default: kernel on CUDA, reference on CPU)")


def run(args, setup) -> LessonRun:
    l2_smoke.check_options(args)
    backend = args.backend or default_backend(setup.device)
    check_backend_device(backend, setup.device)
    model = load_block_model(setup.model_dir, setup.dtype, setup.device)
    result = l2_smoke.run_requests(args, setup, model, BlockKvPool,
                                   lambda m, pool, alloc: BlockTableRunner(m, pool, alloc, backend=backend))
    result.figures = {"backend": backend, **result.figures}
    return result


if __name__ == "__main__":
    sys.exit(run_smoke(LESSON, __doc__, run, add_options))
