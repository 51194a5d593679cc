"""L4: one paged attention for prefill and decode. A ragged batch of query rows (cu_seqlens) reads
K/V straight through each request's block table with a causal offset; cascade attention reads a
prefix many requests share once."""

from .attention import PagedPrefillAttention
from .cascade import cascade_attention, common_prefix_blocks
from .meta import PagedStepMeta, build_paged_meta
from .runner import PagedPrefillRunner, load_prefill_model
from .varlen import BACKENDS, merge_states, paged_prefill_attention, paged_prefill_reference, query_positions

__all__ = [
    "PagedPrefillAttention", "cascade_attention", "common_prefix_blocks", "PagedStepMeta", "build_paged_meta",
    "PagedPrefillRunner", "load_prefill_model", "BACKENDS", "merge_states", "paged_prefill_attention",
    "paged_prefill_reference", "query_positions",
]
