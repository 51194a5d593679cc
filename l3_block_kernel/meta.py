"""L3's ForwardMeta: L2's, plus block tables for the decode path.

Prefill batches still go through L2's gather (they need a causal mask over many queries); pure
decode batches carry block tables and context lengths instead of kv_indices and a mask, so no
per-step list of every history slot is built at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l2_paged import ForwardMeta, Request, build_meta

from .block_table import build_block_tables


@dataclass
class BlockForwardMeta(ForwardMeta):
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32 (decode only)
    context_lens: torch.Tensor | None = None  # [B] int32: keys each request reads, new token included
    backend: str = "auto"  # paged attention: "kernel", "reference" or "auto"
    window_starts: torch.Tensor | None = None  # [B] int32, decode only: L13's sliding layers read from here


def build_block_meta(reqs: list[Request], num_new: list[int], device, backend: str = "auto"):
    """Input ids [T] and BlockForwardMeta; requests' blocks must be reserved already."""
    if any(n != 1 for n in num_new):
        ids, meta = build_meta(reqs, num_new, device)
        return ids, BlockForwardMeta(**vars(meta), backend=backend)
    positions = [r.cur_len for r in reqs]

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    tables, context_lens = build_block_tables(reqs, [p + 1 for p in positions], device)
    meta = BlockForwardMeta(
        positions=as_tensor(positions),
        slot_mapping=as_tensor([r.slot_indices[p] for r, p in zip(reqs, positions)]),
        kv_indices=None, cu_seqlens_k=None, attn_mask=None,  # the decode path walks block tables
        cu_seqlens_q=torch.arange(len(reqs) + 1, device=device),
        is_prefill=False, block_tables=tables, context_lens=context_lens, backend=backend)
    return as_tensor([r.tokens[p] for r, p in zip(reqs, positions)]), meta
