"""L13: hybrid models (sliding-window layers beside full ones), one block table per KV cache group."""

from .attention import GroupedAttention, load_hybrid_model
from .engine import HybridEngine, HybridParts, HybridPreemptor, make_hybrid_engine
from .groups import (NULL_BLOCK, KvCacheGroup, blocks_at_peak, first_needed_position, group_size, kv_cache_groups,
                     layer_slots, window_block_bound)
from .kv_manager import HybridKvManager
from .meta import GroupedStepMeta, build_grouped_meta
from .pool import GroupedKvPool
from .sharing import attach_cached_prefix, copy_on_write_tables, group_key, hybrid_hit_blocks, without_windows
from .speculative import HybridSpecEngine, make_hybrid_spec_engine, rewind_tables
from .tables import (HybridRequest, blocks_to_grow, free_behind_window, grow_tables, release_tables, set_tables,
                     trim_tables)

__all__ = [
    "GroupedAttention", "load_hybrid_model", "HybridEngine", "HybridParts", "HybridPreemptor", "HybridKvManager",
    "make_hybrid_engine", "NULL_BLOCK", "KvCacheGroup", "blocks_at_peak", "first_needed_position", "group_size",
    "kv_cache_groups", "layer_slots",
    "window_block_bound", "GroupedStepMeta", "build_grouped_meta", "GroupedKvPool",
    "attach_cached_prefix", "copy_on_write_tables", "group_key", "hybrid_hit_blocks", "without_windows",
    "HybridRequest", "blocks_to_grow", "free_behind_window", "grow_tables", "release_tables", "set_tables",
    "trim_tables", "HybridSpecEngine", "make_hybrid_spec_engine", "rewind_tables",
]
