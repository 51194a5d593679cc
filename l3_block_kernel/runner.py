"""L2's runner on the block-tensor pool, with the decode step on the paged-attention path."""

from __future__ import annotations

from pathlib import Path

import torch

from l1_contiguous.errors import InputError

from l2_paged import PagedRunner, load_paged_model

from .attention import BlockTableAttention
from .meta import build_block_meta


def load_block_model(model_dir: str | Path, dtype=torch.float32, device="cpu"):
    return load_paged_model(model_dir, dtype, device, attention_cls=BlockTableAttention)


# What a smoke script or an engine may ask for by name ("auto" is the library's own default).
DECODE_BACKENDS = ("kernel", "emulated", "cpu", "gather", "reference")


def default_backend(device) -> str:
    return "kernel" if torch.device(device).type == "cuda" else "reference"


def check_backend_device(backend: str, device) -> None:
    """The kernel needs CUDA; its CPU emulation needs the CPU. Raises InputError saying which flag to change."""
    kind = torch.device(device).type
    if backend == "kernel" and kind != "cuda":
        raise InputError("--backend kernel runs on CUDA only; add --device cuda, or use --backend emulated "
                         "(the kernel's code on the CPU) or reference")
    if backend in ("emulated", "cpu") and kind != "cpu":
        raise InputError(f"--backend {backend} runs on the CPU; drop --device cuda or use --backend kernel")


class BlockTableRunner(PagedRunner):
    def __init__(self, model, pool, alloc, stop_ids=None, backend: str | None = None):
        super().__init__(model, pool, alloc, stop_ids)
        self.backend = backend or default_backend(model.device)

    def build_meta(self, reqs, num_new):
        return build_block_meta(reqs, num_new, self.model.device, self.backend)
