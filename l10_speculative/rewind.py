"""Rewind: give back the K/V of rejected tokens.

The verify forward wrote K/V for all k + 1 rows. After acceptance only the first `new_len`
positions hold tokens of the sequence; the rest must be forgotten. Block size 4, prompt p0..p4,
last token t5 (no K/V yet), proposals d1..d4, verify rows t5 d1 d2 d3 d4; d1 accepted, d2 not:

    after verify  [p0 p1 p2 p3][p4 t5 d1 d2][d3 d4 __ __]     cur_len 10
    rewind to 7   [p0 p1 p2 p3][p4 t5 d1 ..]                  cur_len 7, third block freed
    (the target's bonus token g1 is appended next; its K/V is written by the next step)

In a contiguous cache rewinding is only `cur_len = new_len`. In a paged pool the same, plus every
block past ceil(new_len / block_size) goes back to the allocator: it holds no accepted token, and
the pool is shared, so a held block would be one another request waits for (or is preempted for).
Stale K/V left in the kept last block is never read (reads stop at cur_len) and is overwritten next.
"""

from __future__ import annotations

from l2_paged import BlockAllocator, Request, blocks_needed


def rewind(req: Request, alloc: BlockAllocator, new_len: int) -> None:
    """Move `req.cur_len` back to `new_len` and free its blocks past the new end."""
    if not 0 <= new_len <= req.cur_len:
        raise ValueError(f"request {req.request_id}: cannot rewind to {new_len}: it has K/V for "
                         f"{req.cur_len} tokens (rewind only moves back)")
    # BEGIN SOLUTION
    keep = blocks_needed(new_len, alloc.block_size)
    alloc.free(req.blocks[keep:])
    del req.blocks[keep:]
    del req.slot_indices[keep * alloc.block_size:]
    req.cur_len = new_len
    # END SOLUTION
