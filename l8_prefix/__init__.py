"""L8: prefix sharing with hashed full blocks, reference counts, copy-on-write and n > 1 samples."""

from .block_hash import block_key, chain_keys, tagged_key
from .cow import copy_on_write, shared_write_block
from .engine import (GREEDY_BELOW, PrefixCounters, PrefixEngine, PrefixRequest, PrefixScheduler, SampledWorkItem,
                     draw, is_greedy, make_prefix_engine)
from .prefix_allocator import PrefixBlockAllocator

__all__ = [
    "block_key", "chain_keys", "tagged_key", "copy_on_write", "shared_write_block", "PrefixCounters", "PrefixEngine",
    "PrefixRequest", "PrefixScheduler", "SampledWorkItem", "draw", "make_prefix_engine", "GREEDY_BELOW", "is_greedy",
    "PrefixBlockAllocator",
]
