"""L1's KV cache: one contiguous K and V tensor per layer for a single request.

    layer i:  K[i]  [max_seq_len, H_kv, D]
              ┌────┬────┬────┬────┬────┬──────────────── ··· ─┐
              │ t0 │ t1 │ t2 │ t3 │ t4 │  (allocated, unused)  │
              └────┴────┴────┴────┴────┴──────────────── ··· ─┘
                                       ▲ length: next write offset = valid entries
"""

from __future__ import annotations

import torch

from .config import Qwen3Config
from .errors import InputError


class CacheFullError(InputError):
    """More tokens than the contiguous cache was sized for."""


class ContiguousKvCache:
    def __init__(self, cfg: Qwen3Config, max_seq_len: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        shape = (max_seq_len, cfg.num_key_value_heads, cfg.head_dim)
        # torch.empty: never-written entries are garbage, and nothing reads past `length`.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.max_seq_len = max_seq_len
        self.length = 0  # valid entries; after prefilling T tokens it is T, not T + 1

    def check_room(self, num_new: int) -> None:
        """Raise before a forward that would write past the end (it would fail mid-layer)."""
        if self.length + num_new > self.max_seq_len:
            raise CacheFullError(
                f"cache holds {self.length} of {self.max_seq_len} positions and cannot take "
                f"{num_new} more; make the cache larger or generate fewer tokens")

    def advance(self, num_new: int) -> None:
        """Called once after each forward: the `num_new` tokens just written are now valid."""
        self.check_room(num_new)
        self.length += num_new

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
