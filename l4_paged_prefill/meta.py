"""L4's ForwardMeta: one description for every row of a step, prefill chunk or decode.

    requests      a: 4 new tokens at 6..9     b: 1 at 6 (a decode)     c: 2 at 0..1 (a first chunk)
    positions     [6 7 8 9 | 6 | 0 1]          slot_mapping: where each row's K/V is written
    cu_seqlens_q  [0, 4, 5, 7]                 context_lens [10, 7, 2]   block_tables [3, max_blocks]

No kv_indices (a list of every key slot the batch reads) and no [T, S] mask: each row finds its
keys through its request's block table and the causal offset (varlen.py). The metadata grows
with the number of new rows and of table entries, not with the rows times the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l2_paged import Request
from l2_paged.meta import cumulative_offsets, new_token_rows
from l3_block_kernel import build_block_tables


@dataclass
class PagedStepMeta:
    positions: torch.Tensor  # [T] int64: position of each new row in its request
    slot_mapping: torch.Tensor  # [T] int64: pool slot where each new row's K/V is written
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: request r's rows are [cu[r], cu[r + 1])
    context_lens: torch.Tensor  # [B] int32: keys of request r after this step's writes
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int  # the most rows one request brings (the CUDA grid's size, known on the host)
    backend: str = "auto"  # varlen.paged_prefill_attention's backend
    num_common_blocks: int = 0  # leading table columns every request shares: cascade (cascade.py)
    plan: object = None  # the step's varlen.PagedPrefillPlan, made by its first layer (attention.py)

    @property
    def is_prefill(self) -> bool:
        """Whether some request brings more than one row (L2's meaning; L4's attention does not ask)."""
        return self.max_query_len > 1


def build_paged_meta(reqs: list[Request], num_new: list[int], device, backend: str = "auto",
                     num_common_blocks: int = 0) -> tuple[torch.Tensor, PagedStepMeta]:
    """Input ids [T] and the PagedStepMeta for `num_new[r]` new tokens of each request, which must
    have slots reserved for cur_len + num_new[r] positions."""
    # ids, positions and slots as the rows of one tensor: one copy to the device, not three (a
    # decode step of a small model spends more on making tensors than on some of its layers)
    ids, positions, slots = torch.tensor(new_token_rows(reqs, num_new), dtype=torch.int64, device=device)
    tables, context_lens = build_block_tables(reqs, [r.cur_len + n for r, n in zip(reqs, num_new)], device)
    meta = PagedStepMeta(positions=positions, slot_mapping=slots,
                         cu_seqlens_q=torch.tensor(cumulative_offsets(num_new), dtype=torch.int32, device=device),
                         context_lens=context_lens, block_tables=tables, max_query_len=max(num_new, default=0),
                         backend=backend, num_common_blocks=num_common_blocks)
    return ids, meta
