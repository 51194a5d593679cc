"""L8: prefix sharing with hashed full blocks, reference counts, copy-on-write and n > 1 samples."""

from .block_hash import block_key, chain_keys, tagged_key
from .cow import copy_on_write, shared_write_block
from .engine import PrefixEngine, PrefixScheduler, make_prefix_engine
from .kv_manager import PrefixCounters, PrefixKvManager
from .prefix_allocator import PrefixBlockAllocator
from .request import PrefixRequest
from .sampling import GREEDY_BELOW, SampledWorkItem, draw, draw_or_fail, is_greedy

__all__ = [
    "block_key", "chain_keys", "tagged_key", "copy_on_write", "shared_write_block", "PrefixCounters", "PrefixEngine",
    "PrefixKvManager", "PrefixRequest", "PrefixScheduler", "SampledWorkItem", "draw", "draw_or_fail",
    "make_prefix_engine", "GREEDY_BELOW", "is_greedy", "PrefixBlockAllocator",
]
