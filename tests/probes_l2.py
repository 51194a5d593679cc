"""L2's planted bugs (see probes.py: under the judge, imported in the worker)."""

from __future__ import annotations

from l2_paged import PagedAttention


class Layer0Attention(PagedAttention):
    """The forgotten layer_idx: every layer writes and reads layer 0's K/V."""

    def kv_step(self, k, v, pool, meta):
        pool.set_kv(0, meta.slot_mapping, k, v)
        return pool.K[0][meta.kv_indices], pool.V[0][meta.kv_indices]
