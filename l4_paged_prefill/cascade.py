"""Cascade attention: a prefix that every request of a step shares is read once, for all of them.

    request a: blocks [7, 2, 9, 4]    request b: blocks [7, 2, 5]    request c: blocks [7, 2, 6, 1]
                       └─┬─┘                            └─┬─┘                           └─┬─┘
                  shared prefix: blocks 7, 2 (num_common_blocks = 2)

    prefix pass   every query row of a, b and c against blocks 7 and 2: one "request" of T rows,
                  no causal rule (each row comes after the whole prefix)    -> out_p, lse_p
    suffix pass   each request's rows against its own blocks from column 2 on,
                  with the causal rule                                       -> out_s, lse_s
    result        merge_states(out_p, lse_p, out_s, lse_s)

The plain path reads blocks 7 and 2 once per request (and, in the CUDA kernel, once per tile of
query rows); the cascade reads them once per tile of the whole batch's rows. With many requests
behind one long system prompt (L8's shared-prefix bursts) that is most of the step's key traffic.
The result is the same attention: softmax over the union of two disjoint key sets is the merge of
the softmaxes over each (varlen.merge_states).
"""

from __future__ import annotations

import torch

from .varlen import merge_states, paged_prefill_attention


def common_prefix_blocks(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                         block_size: int) -> int:
    """How many leading block-table columns the cascade may read once for every request of a step.

    A column counts only if every request holds the same block there, and the cascade's prefix
    pass reads it without a causal rule: so every key in the shared columns must lie before
    every request's first query row (each request's first new position is context_len -
    query_len). Fewer than two requests share nothing worth a second pass: 0.
    """
    # BEGIN SOLUTION
    if len(block_tables) < 2:
        return 0
    computed = min(length - n for length, n in zip(context_lens, query_lens))  # keys before every query
    count = 0
    for column in zip(*block_tables):
        if (count + 1) * block_size > computed or any(block != column[0] for block in column):
            break
        count += 1
    return count
    # END SOLUTION


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, num_common_blocks: int,
                      scale: float | None = None, *, backend: str = "auto", max_query_len: int | None = None,
                      check_values: bool = True) -> torch.Tensor:
    """`paged_prefill_attention` of the same inputs (no window), with the first num_common_blocks
    table columns (the same blocks in every row, before every query: `common_prefix_blocks`) read
    in one pass for all rows. Returns out [T, H, D] in q's dtype."""
    # BEGIN SOLUTION
    options = dict(scale=scale, backend=backend, check_values=check_values, return_lse=True)
    if num_common_blocks == 0:
        return paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                       max_query_len=max_query_len, **options)[0]
    prefix_len = num_common_blocks * k_cache.shape[1]
    all_rows = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    out_prefix, lse_prefix = paged_prefill_attention(
        q, k_cache, v_cache, all_rows, torch.tensor([prefix_len], dtype=torch.int32, device=q.device),
        block_tables[:1, :num_common_blocks], max_query_len=q.shape[0], causal=False, **options)
    out_own, lse_own = paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                               max_query_len=max_query_len, key_begin=prefix_len, **options)
    return merge_states(out_prefix, lse_prefix, out_own, lse_own)[0].to(q.dtype)
    # END SOLUTION
