"""L2: a token-flat paged KV pool, a block allocator, and several requests decoded together."""

from .allocator import BlockAllocator, OutOfBlocksError
from .attention import PagedAttention
from .meta import ForwardMeta, build_meta, ragged_causal_mask
from .pool import KvPool, bytes_per_block, cuda_kv_budget, num_blocks_for_budget, parse_size
from .request import Request, blocks_needed, kv_positions_needed, release, reserve
from .runner import PagedRunner, PoolStats, load_paged_model

__all__ = [
    "BlockAllocator", "OutOfBlocksError", "PagedAttention", "ForwardMeta", "build_meta",
    "ragged_causal_mask", "KvPool", "bytes_per_block", "cuda_kv_budget", "num_blocks_for_budget",
    "parse_size", "Request", "blocks_needed", "kv_positions_needed", "release", "reserve", "PagedRunner", "PoolStats",
    "load_paged_model",
]
