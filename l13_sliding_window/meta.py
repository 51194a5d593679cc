"""One step's metadata, per KV cache group: each group's layers read through their own tables.

    GroupedStepMeta
      positions, cu_seqlens_q           the batch's rows (decodes first), the same for every group
      groups[0]  full group             L5's step metadata on that group's tables (block tables
                                        for the decodes, gather + causal mask for prefill chunks)
      groups[1]  sliding group, W       a gather of each request's window only: the keys from
                                        first_needed_position(W, start) to the last new token,
                                        masked so a query at p reads p - W < s <= p

A group's tables are handed to the earlier lessons' builders through a `GroupView`: a request as
one group sees it (that group's table as its blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l1_contiguous import window_mask
from l2_paged.meta import _cumsum
from l3_block_kernel import BlockForwardMeta
from l5_eviction import build_step_meta

from .groups import KvCacheGroup, first_needed_position
from .tables import HybridRequest, TableSlots


@dataclass
class GroupView:
    """What L2's and L3's metadata builders read of a request, for one group's table."""

    request_id: int
    tokens: list[int]
    cur_len: int
    blocks: list[int]
    slot_indices: TableSlots


@dataclass
class GroupedStepMeta:
    positions: torch.Tensor  # [T] int64, the rows' positions (RoPE reads them once for all layers)
    cu_seqlens_q: torch.Tensor  # [B + 1] int64: request r's rows are [cu[r], cu[r + 1])
    groups: list  # per group: the metadata its layers read (see the module's picture)


def build_grouped_meta(reqs: list[HybridRequest], num_new: list[int], groups: list[KvCacheGroup],
                       block_size: int, device, backend: str):
    """Input ids [T] and a GroupedStepMeta for `num_new[r]` new tokens of each request, whose
    tables must already cover them. Requests with one new token first (as L5 builds a step)."""
    ids, per_group = None, []
    for g, group in enumerate(groups):
        if group.is_sliding:
            ids, meta = build_window_meta(reqs, num_new, g, group.window, block_size, device)
        else:
            views = [GroupView(r.request_id, r.tokens, r.cur_len, list(r.tables[g]),
                               TableSlots(r.tables[g], block_size)) for r in reqs]
            ids, meta = build_step_meta(views, num_new, device, backend)
        per_group.append(meta)
    first = per_group[0]
    return ids, GroupedStepMeta(positions=first.positions, cu_seqlens_q=first.cu_seqlens_q, groups=per_group)


def build_window_meta(reqs: list[HybridRequest], num_new: list[int], g: int, window: int, block_size: int,
                      device) -> tuple[torch.Tensor, BlockForwardMeta]:
    """A gather of each request's window in group g: every row takes the masked (prefill) path.

    Request r's keys are positions first..end-1 with first = first_needed_position(window, start):
    nothing behind the window is gathered, so a freed block is never read.
    """
    ids, positions, slots, kv, q_req, k_req, k_pos = [], [], [], [], [], [], []
    for r, (req, n) in enumerate(zip(reqs, num_new)):
        start, end = req.cur_len, req.cur_len + n
        first = first_needed_position(window, start)
        table_slots = TableSlots(req.tables[g], block_size)
        ids += req.tokens[start:end]
        positions += range(start, end)
        slots += table_slots[start:end]
        kv += table_slots[first:end]
        q_req += [r] * n
        k_req += [r] * (end - first)
        k_pos += range(first, end)

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    q_pos, cu_q = as_tensor(positions), as_tensor(_cumsum(num_new))
    meta = BlockForwardMeta(
        positions=q_pos, slot_mapping=as_tensor(slots), kv_indices=as_tensor(kv), cu_seqlens_q=cu_q,
        cu_seqlens_k=None, attn_mask=window_causal_mask(q_pos, as_tensor(q_req), as_tensor(k_pos),
                                                        as_tensor(k_req), window),
        is_prefill=True)
    return as_tensor(ids), meta


def window_causal_mask(q_pos, q_req, k_pos, k_req, window: int) -> torch.Tensor:
    """[T, S] bool: query t reads key s iff both are one request's and 0 <= pos(t) - pos(s) < window."""
    return (q_req[:, None] == k_req[None, :]) & window_mask(q_pos, k_pos, window)
