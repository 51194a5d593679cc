"""L5's mixed-batch attention, reading its group's metadata: the model every L13 engine runs.

    GroupedStepMeta ──groups[self.group]──► L5's MixedBatchAttention: decodes walk block tables
                                            (a sliding group's from each row's window start),
                                            prefill chunks run masked SDPA (a sliding group's mask
                                            holds the window)
"""

from __future__ import annotations

from pathlib import Path

import torch

from l1_contiguous import attend
from l5_eviction import MixedBatchAttention, load_engine_model

from .groups import kv_cache_groups


class GroupedAttention(MixedBatchAttention):
    reads_windows = True  # a sliding group's mask (meta.py) holds the window

    def __init__(self, cfg, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.group = next(g for g, group in enumerate(kv_cache_groups(cfg)) if layer_idx in group.layers)

    def forward(self, x, cos, sin, pool, meta):
        return super().forward(x, cos, sin, pool, meta.groups[self.group])

    def attend(self, q, k_all, v_all, meta):
        if meta.is_prefill:  # the gathered keys and their mask, window included, come from meta
            return attend(q, k_all, v_all, meta.attn_mask)
        return super().attend(q, k_all, v_all, meta)  # a sliding group's decodes carry window_starts


def load_hybrid_model(model_dir: str | Path, dtype=torch.float32, device="cpu", packed_linears: bool = True):
    """The model L13's engine runs: L5's, with attention that reads its group's tables."""
    return load_engine_model(model_dir, dtype, device, packed_linears, attention_cls=GroupedAttention)
