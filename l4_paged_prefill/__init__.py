"""L4: one paged attention for prefill and decode. A ragged batch of query rows (cu_seqlens) reads
K/V straight through each request's block table with a causal offset; cascade attention reads a
prefix many requests share once."""

from .varlen import merge_states, paged_prefill_attention, paged_prefill_reference, query_positions

__all__ = ["merge_states", "paged_prefill_attention", "paged_prefill_reference", "query_positions"]
