"""One step's metadata, per KV cache group: each group's layers read through their own tables.

    GroupedStepMeta
      positions, cu_seqlens_q           the batch's rows, the same for every group
      groups[0]  full group             L4's step metadata on that group's tables
      groups[1]  sliding group, W       L4's step metadata on that group's tables, whose entries
                                        behind the window are NULL_BLOCK (-1): L4's attention reads
                                        a row at p from position p - W + 1 on (the layer's window),
                                        so a freed block is never read, prefill chunk or decode

A group's tables are handed to L4's builder through a `GroupView`: a request as one group sees it
(that group's table as its blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l4_paged_prefill import build_paged_meta

from .groups import KvCacheGroup
from .tables import HybridRequest, TableSlots


@dataclass
class GroupView:
    """What L4's metadata builder reads of a request, for one group's table."""

    request_id: int
    tokens: list[int]
    cur_len: int
    blocks: list[int]
    slot_indices: TableSlots


@dataclass
class GroupedStepMeta:
    positions: torch.Tensor  # [T] int64, the rows' positions (RoPE reads them once for all layers)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: request r's rows are [cu[r], cu[r + 1])
    max_query_len: int  # the most rows one request brings (1: a step of decodes only)
    groups: list  # per group: the PagedStepMeta its layers read


def build_grouped_meta(reqs: list[HybridRequest], num_new: list[int], groups: list[KvCacheGroup],
                       block_size: int, device, backend: str):
    """Input ids [T] and a GroupedStepMeta for `num_new[r]` new tokens of each request, whose
    tables must already cover them."""
    ids, per_group = None, []
    for g in range(len(groups)):
        ids, meta = build_paged_meta(group_views(reqs, g, block_size), num_new, device, backend)
        per_group.append(meta)
    first = per_group[0]
    return ids, GroupedStepMeta(positions=first.positions, cu_seqlens_q=first.cu_seqlens_q,
                                max_query_len=first.max_query_len, groups=per_group)


def group_views(reqs: list[HybridRequest], g: int, block_size: int) -> list[GroupView]:
    return [GroupView(r.request_id, r.tokens, r.cur_len, list(r.tables[g]), TableSlots(r.tables[g], block_size))
            for r in reqs]
