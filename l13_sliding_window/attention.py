"""L5's engine attention, reading its group's metadata: the model every L13 engine runs.

    GroupedStepMeta ──groups[self.group]──► L4's paged attention over that group's tables, every
                                            row of a sliding layer reading its last W positions
                                            only (the layer's window, applied by L4's kernels)
"""

from __future__ import annotations

from pathlib import Path

import torch

from l5_eviction import MixedBatchAttention, load_engine_model

from .groups import kv_cache_groups


class GroupedAttention(MixedBatchAttention):
    def __init__(self, cfg, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.group = next(g for g, group in enumerate(kv_cache_groups(cfg)) if layer_idx in group.layers)

    def forward(self, x, cos, sin, pool, meta):
        return super().forward(x, cos, sin, pool, meta.groups[self.group])


def load_hybrid_model(model_dir: str | Path, dtype=torch.float32, device="cpu", packed_linears: bool = True):
    """The model L13's engine runs: L5's, with attention that reads its group's tables."""
    return load_engine_model(model_dir, dtype, device, packed_linears, attention_cls=GroupedAttention)
