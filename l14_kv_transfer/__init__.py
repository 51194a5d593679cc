"""L14: K/V outside the pool: a connector, an offload tier (CPU memory, files) keyed by L8's chained
block hashes, and prefill and decode in two processes with blocks sent between their pools."""

from .connector import (MODES, ConnectorCounters, ConnectorMeta, KvConnector, LoadJob, OffloadConnector, block_shape,
                        kv_identity, read_block, write_block)
from .engine import OffloadEngine, OffloadKvManager, OffloadRequest, make_offload_engine, make_store
from .tiers import BlockLoadError, CpuTier, FileTier, LruTier, TieredStore

__all__ = [
    "MODES", "ConnectorCounters", "ConnectorMeta", "KvConnector", "LoadJob", "OffloadConnector", "block_shape",
    "kv_identity", "read_block", "write_block", "OffloadEngine", "OffloadKvManager", "OffloadRequest",
    "make_offload_engine", "make_store", "BlockLoadError", "CpuTier", "FileTier", "LruTier", "TieredStore",
]
