"""One step's metadata, per KV cache group: each group's layers read through their own tables.

    GroupedStepMeta
      positions, cu_seqlens_q           the batch's rows (decodes first), the same for every group
      groups[0]  full group             L5's step metadata on that group's tables (block tables
                                        for the decodes, gather + causal mask for prefill chunks)
      groups[1]  sliding group, W       decodes: L3's block tables (NULL behind the window) with
                                        window starts, the kernel walking the window's blocks only;
                                        prefill chunks: a gather of each request's window only,
                                        first_needed_position(W, start) to the last new token,
                                        masked so a query at p reads p - W < s <= p

A group's tables are handed to the earlier lessons' builders through a `GroupView`: a request as
one group sees it (that group's table as its blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from l1_contiguous import window_mask
from l2_paged.meta import cumulative_offsets
from l3_block_kernel import BlockForwardMeta, build_block_meta
from l5_eviction import build_step_meta
from l5_eviction.mixed import MixedBatchMeta

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
            ids, meta = build_sliding_meta(reqs, num_new, g, group.window, block_size, device, backend)
        else:
            ids, meta = build_step_meta(group_views(reqs, g, block_size), num_new, device, backend)
        per_group.append(meta)
    first = per_group[0]
    return ids, GroupedStepMeta(positions=first.positions, cu_seqlens_q=first.cu_seqlens_q, groups=per_group)


def group_views(reqs: list[HybridRequest], g: int, block_size: int) -> list[GroupView]:
    return [GroupView(r.request_id, r.tokens, r.cur_len, list(r.tables[g]), TableSlots(r.tables[g], block_size))
            for r in reqs]


def build_sliding_meta(reqs: list[HybridRequest], num_new: list[int], g: int, window: int, block_size: int,
                       device, backend: str):
    """Group g's metadata when it is sliding: the decodes (first) walk their tables from the window's
    start, the prefill chunks gather their windows; a step with both gets L5's MixedBatchMeta."""
    num_decode = num_new.count(1)
    if num_decode == 0:
        return build_window_meta(reqs, num_new, g, window, block_size, device)
    decode_ids, decode = build_window_decode_meta(reqs[:num_decode], g, window, block_size, device, backend)
    if num_decode == len(reqs):
        return decode_ids, decode
    prefill_ids, prefill = build_window_meta(reqs[num_decode:], num_new[num_decode:], g, window, block_size, device)
    meta = MixedBatchMeta(positions=torch.cat([decode.positions, prefill.positions]),
                          cu_seqlens_q=torch.cat([decode.cu_seqlens_q, prefill.cu_seqlens_q[1:] + num_decode]),
                          decode=decode, prefill=prefill)
    return torch.cat([decode_ids, prefill_ids]), meta


def build_window_decode_meta(reqs: list[HybridRequest], g: int, window: int, block_size: int, device,
                             backend: str) -> tuple[torch.Tensor, BlockForwardMeta]:
    """One new token per request: L3's block tables of group g (NULL_BLOCK behind the window, never
    read) and each token's window start, the oldest position it reads (`window_starts`)."""
    # L3's reference walks whole contexts only (it is the oracle there): windows take the gather.
    backend = "gather" if backend == "reference" else backend
    ids, meta = build_block_meta(group_views(reqs, g, block_size), [1] * len(reqs), device, backend)
    starts = [first_needed_position(window, r.cur_len) for r in reqs]
    return ids, replace(meta, window_starts=torch.tensor(starts, dtype=torch.int32, device=device))


def build_window_meta(reqs: list[HybridRequest], num_new: list[int], g: int, window: int, block_size: int,
                      device) -> tuple[torch.Tensor, BlockForwardMeta]:
    """A gather of each request's window in group g: every row takes the masked (prefill) path
    (L13's engines use it for prefill chunks; a decode row would work too, at the cost of a copy).

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

    q_pos, cu_q = as_tensor(positions), as_tensor(cumulative_offsets(num_new))
    meta = BlockForwardMeta(
        positions=q_pos, slot_mapping=as_tensor(slots), kv_indices=as_tensor(kv), cu_seqlens_q=cu_q,
        cu_seqlens_k=None, attn_mask=window_causal_mask(q_pos, as_tensor(q_req), as_tensor(k_pos),
                                                        as_tensor(k_req), window),
        is_prefill=True)
    return as_tensor(ids), meta


def window_causal_mask(q_pos, q_req, k_pos, k_req, window: int) -> torch.Tensor:
    """[T, S] bool: query t reads key s iff both are one request's and 0 <= pos(t) - pos(s) < window."""
    return (q_req[:, None] == k_req[None, :]) & window_mask(q_pos, k_pos, window)
