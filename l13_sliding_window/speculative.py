"""L10's speculative decoding on a hybrid model: verify k + 1 rows, then rewind every group.

The verify forward writes k + 1 positions in every group. After acceptance the tables are cut back
to the accepted end, as L10's rewind cuts one table (`rewind_tables`). The trap is the sliding
groups: their blocks behind the window must be freed for the position the request really reached,
never for the verify's end, or a rejected proposal would have moved the window past blocks the
next token still reads. The manager frees after the rewind (L10's commit settles, then L8's commit
calls the manager's `after_forward`), so the window follows the accepted length.

Composition is by parts, not by a diamond of engines: L10's engine with L13's parts (HybridParts:
pool, preemptor, KV manager; the request's fields), and `rewind_kv` (L10's hook) cutting every
group's table.
"""

from __future__ import annotations

from dataclasses import dataclass

from l2_paged import blocks_needed
from l10_speculative import SpecEngine, SpecRequest
from l5_eviction import make_engine

from .engine import HybridParts
from .groups import NULL_BLOCK
from .tables import HybridRequest, set_tables


@dataclass
class HybridSpecRequest(SpecRequest, HybridRequest):
    """A request with proposals (L10) and one table per group (L13)."""


def rewind_tables(req: HybridRequest, alloc, new_len: int) -> None:
    """L10's rewind in every group: cur_len back to `new_len`, entries past its blocks freed."""
    if not 0 <= new_len <= req.cur_len:
        raise ValueError(f"request {req.request_id}: cannot rewind to {new_len}: it has K/V for "
                         f"{req.cur_len} tokens (rewind only moves back)")
    # BEGIN SOLUTION
    keep = blocks_needed(new_len, alloc.block_size)
    dropped = [b for table in req.tables for b in table[keep:] if b != NULL_BLOCK]
    if dropped:
        alloc.free(dropped)
    set_tables(req, [table[:keep] for table in req.tables] if req.tables else ())
    req.cur_len = new_len
    # END SOLUTION


class HybridSpecEngine(HybridParts, SpecEngine):
    """L10's engine with L13's parts: request fields, pool, preemptor and KV manager."""

    request_cls = HybridSpecRequest

    def rewind_kv(self, req: HybridSpecRequest, new_len: int) -> None:
        rewind_tables(req, self.alloc, new_len)


def make_hybrid_spec_engine(model, num_blocks: int, block_size: int = 16, **kwargs) -> HybridSpecEngine:
    return make_engine(model, num_blocks, block_size, engine_cls=HybridSpecEngine, **kwargs)
