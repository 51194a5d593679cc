"""ForwardMeta: where a flat batch of new tokens writes its K/V and what each token reads.

A batch is ragged: request r contributes n_r new tokens (its whole prompt at prefill, one token at
decode), laid end to end. Example with block_size 4, A holding blocks [2, 0] and B holding [1]:

    A: prompt of 6 tokens (prefill)      B: decode at position 2
    positions     0  1  2  3  4  5        2
    slot_mapping  8  9 10 11  0  1        6        (slot = block * 4 + within)
    kv_indices    8  9 10 11  0  1  |  4  5  6     (each request's history, concatenated)
    cu_seqlens_q  [0, 6, 7]          cu_seqlens_k [0, 6, 9]
    attn_mask     a query reads only its own request's keys at positions <= its own
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request


@dataclass
class ForwardMeta:
    positions: torch.Tensor  # [T] int64, position of each new token in its request
    slot_mapping: torch.Tensor  # [T] int64, pool slot where each new token's K/V is written
    kv_indices: torch.Tensor  # [S] int64, 1-D: the slots read, request after request
    cu_seqlens_q: torch.Tensor  # [B + 1] int64, request r's new tokens are [cu_q[r], cu_q[r+1])
    cu_seqlens_k: torch.Tensor  # [B + 1] int64, request r's keys are kv_indices[cu_k[r]:cu_k[r+1]]
    attn_mask: torch.Tensor | None  # [T, S] bool, True where token t may read key s
    is_prefill: bool  # False only when every request brings exactly one token (pure decode)


def build_meta(reqs: list[Request], num_new: list[int], device) -> tuple[torch.Tensor, ForwardMeta]:
    """Input ids [T] and the ForwardMeta for `num_new[r]` new tokens of each request.

    The new tokens of r are r.tokens[r.cur_len : r.cur_len + num_new[r]]; its blocks must already
    be reserved for cur_len + num_new[r] positions.
    """
    ids, positions, slots = new_token_rows(reqs, num_new)
    kv, q_req, k_req, k_pos = [], [], [], []
    for r, (req, n) in enumerate(zip(reqs, num_new)):
        end = req.cur_len + n
        kv += req.slot_indices[:end]
        q_req += [r] * n
        k_req += [r] * end
        k_pos += range(end)

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    positions_t = as_tensor(positions)
    meta = ForwardMeta(
        positions=positions_t,
        slot_mapping=as_tensor(slots),
        kv_indices=as_tensor(kv),
        cu_seqlens_q=as_tensor(cumulative_offsets(num_new)),
        cu_seqlens_k=as_tensor(cumulative_offsets([r.cur_len + n for r, n in zip(reqs, num_new)])),
        attn_mask=ragged_causal_mask(positions_t, as_tensor(q_req), as_tensor(k_pos), as_tensor(k_req)),
        is_prefill=any(n != 1 for n in num_new),
    )
    return as_tensor(ids), meta


def new_token_rows(reqs: list[Request], num_new: list[int]) -> tuple[list[int], list[int], list[int]]:
    """The batch's new rows, request after request: (token ids, positions, slots). ValueError if a
    request's blocks do not cover its new tokens yet."""
    ids, positions, slots = [], [], []
    for req, n in zip(reqs, num_new):
        start, end = req.cur_len, req.cur_len + n
        if len(req.slot_indices) < end:
            raise ValueError(f"request {req.request_id} has {len(req.slot_indices)} slots reserved and "
                             f"needs {end}; call reserve() before building its metadata")
        ids += req.tokens[start:end]
        positions += range(start, end)
        slots += req.slot_indices[start:end]
    return ids, positions, slots


def ragged_causal_mask(q_pos, q_req, k_pos, k_req) -> torch.Tensor | None:
    """[T, S] bool: token t reads key s iff both belong to one request and pos(s) <= pos(t).

    Built once per forward and shared by every layer. None when one request decodes one token.
    """
    if q_pos.numel() == 1:
        return None
    # BEGIN SOLUTION
    same_request = q_req[:, None] == k_req[None, :]
    return same_request & (k_pos[None, :] <= q_pos[:, None])
    # END SOLUTION


def cumulative_offsets(values: list[int]) -> list[int]:
    """[0, v0, v0 + v1, ...]: where each request's rows start in a flat batch (cu_seqlens), and the end."""
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
