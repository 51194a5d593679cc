"""L2's runner on the block-tensor pool, with the decode step on the paged-attention path."""

from __future__ import annotations

from pathlib import Path

import torch

from l2_paged import PagedRunner, load_paged_model

from .attention import BlockTableAttention
from .meta import build_block_meta


def load_block_model(model_dir: str | Path, dtype=torch.float32, device="cpu"):
    return load_paged_model(model_dir, dtype, device, attention_cls=BlockTableAttention)


def default_backend(device) -> str:
    return "kernel" if torch.device(device).type == "cuda" else "reference"


class BlockTableRunner(PagedRunner):
    def __init__(self, model, pool, alloc, stop_ids=None, backend: str | None = None):
        super().__init__(model, pool, alloc, stop_ids)
        self.backend = backend or default_backend(model.device)

    def build_meta(self, reqs, num_new):
        return build_block_meta(reqs, num_new, self.model.device, self.backend)
