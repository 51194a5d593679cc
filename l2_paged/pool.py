"""L2's KV pool: token-flat, one `[num_slots, H_kv, D]` K and V per layer, shared by all requests.

    slot = block_id * block_size + within          (block_size 4 in this picture)

    K[layer]  slot: 0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14 15 | ...
                    block 0    | block 1    | block 2    | block 3     |
                    req A      | req B      | req A      | (free)      |

The pool knows nothing about owners; the allocator and the requests' block lists do.
"""

from __future__ import annotations

import re

import torch

from l1_contiguous import InputError, Qwen3Config

from .allocator import check_pool_shape


class KvPool:
    def __init__(self, cfg: Qwen3Config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        check_pool_shape(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_slots = num_blocks * block_size
        shape = (self.num_slots, cfg.num_key_value_heads, cfg.head_dim)
        # torch.empty, never zeroed: a slot is read only after it was written for its owner.
        self.K = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.V = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]

    def set_kv(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, H_kv, D] into slots slot_mapping [T] (int64, no slot twice) of one layer, in place."""
        # index_copy_, not K[slots] = k: the same writes, but index_put's CPU path splits even a few rows
        # across threads, which on a busy 2-core machine cost milliseconds per step (measured, bench_step).
        self.K[layer].index_copy_(0, slot_mapping, k)
        self.V[layer].index_copy_(0, slot_mapping, v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.K + self.V)

    @staticmethod
    def bytes_per_block(cfg: Qwen3Config, block_size: int, dtype: torch.dtype) -> int:
        """What one block of such a pool occupies (how make_engine checks a pool fits in memory)."""
        return bytes_per_block(cfg, block_size, dtype)


def bytes_per_block(cfg: Qwen3Config, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens across all layers."""
    return block_size * cfg.kv_bytes_per_token(dtype.itemsize)


def num_blocks_for_budget(cfg: Qwen3Config, budget_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks a KV memory budget holds, as engines size their pool."""
    n = budget_bytes // bytes_per_block(cfg, block_size, dtype)
    if n < 1:
        raise InputError(f"a KV budget of {budget_bytes} bytes holds no block of "
                         f"{bytes_per_block(cfg, block_size, dtype)} bytes; give more memory")
    return n


def cuda_kv_budget(fraction: float = 0.9, device: int = 0) -> int:
    """Bytes of KV a CUDA device can take: `fraction` of its currently free memory."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * fraction)


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """'64MiB' -> 67108864. Binary (KiB, MiB, GiB) and decimal (KB, MB, GB) units."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"cannot read memory size {text!r}; write it like 64MiB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
