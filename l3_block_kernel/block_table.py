"""Block tables: each request's block ids as one row of a padded int32 tensor.

    request   blocks        block_tables [3, 3]   context_lens [3]
    A         [7, 2, 9]     [[7, 2, 9],           [40,
    B         [4]            [4, 0, 0],             3,
    C         [1, 5]         [1, 5, 0]]            17]      (block_size 16)

Token p of request r lives at block_tables[r, p // block_size], row p % block_size of that block.
Padding entries (the zeros after B's and C's blocks) are never read: context_lens stops the walk
before them. 0 rather than -1 keeps a stray read inside the pool while debugging a kernel.
"""

from __future__ import annotations

import torch

from l2_paged import Request


def build_block_tables(reqs: list[Request], context_lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> block_tables [B, max_blocks] int32, context_lens [B] int32."""
    # BEGIN SOLUTION
    width = max(len(r.blocks) for r in reqs)
    rows = [r.blocks + [0] * (width - len(r.blocks)) for r in reqs]
    tables = torch.tensor(rows, dtype=torch.int32, device=device)
    return tables, torch.tensor(context_lens, dtype=torch.int32, device=device)
    # END SOLUTION
