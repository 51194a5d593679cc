"""L3: the pool seen as blocks, block tables, and a paged-attention decode kernel (CUDA) with a
PyTorch reference of the same algorithm for machines without a GPU."""

from .attention import BlockTableAttention
from .block_table import build_block_tables
from .meta import BlockForwardMeta, build_block_meta
from .paged_attention import paged_attention, paged_attention_gather, paged_attention_reference
from .pool import BlockKvPool
from .runner import DECODE_BACKENDS, BlockTableRunner, check_backend_device, default_backend, load_block_model

__all__ = [
    "BlockTableAttention", "build_block_tables", "BlockForwardMeta", "build_block_meta",
    "paged_attention", "paged_attention_gather", "paged_attention_reference", "BlockKvPool", "BlockTableRunner",
    "DECODE_BACKENDS", "check_backend_device", "default_backend", "load_block_model",
]
