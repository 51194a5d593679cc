"""Copy-on-write: a block held by more than one table is never written; a writer copies it first.

After a fork (n samples of one prompt) every sample holds the prompt's blocks, including a
partially filled last block. The next token of each sample goes into that block, so each writer
but the last gets its own copy (the last one, now holding the only reference, writes in place):

    before   A,B,C ──► [p0 p1 p2 p3][p4 p5 _ _]       ref counts: 3, 3
    A writes A ──► [p0 p1 p2 p3][p4 p5 a6 _]'         copy: ref of the shared block drops to 2
    B writes B ──► [p0 p1 p2 p3][p4 p5 b6 _]''        copy: ref drops to 1
    C writes C ──► [p0 p1 p2 p3][p4 p5 c6 _]          in place: C holds the only reference
"""

from __future__ import annotations

from l3_block_kernel import BlockKvPool
from l5_eviction import EngineRequest

from .prefix_allocator import PrefixBlockAllocator


def shared_write_block(req: EngineRequest, alloc: PrefixBlockAllocator) -> int | None:
    """Index in req.blocks of the block the next token is written to, if that block is shared."""
    i = req.cur_len // alloc.block_size
    if i < len(req.blocks) and alloc.ref_count[req.blocks[i]] > 1:
        return i
    return None


def copy_on_write(req: EngineRequest, alloc: PrefixBlockAllocator, pool: BlockKvPool) -> bool:
    """Give `req` a private copy of its shared write block; True if a copy was made."""
    # BEGIN SOLUTION
    i = shared_write_block(req, alloc)
    if i is None:
        return False
    old = req.blocks[i]
    (new,) = alloc.alloc_blocks(1)
    for k, v in zip(pool.k_blocks, pool.v_blocks):
        k[new] = k[old]
        v[new] = v[old]
    alloc.free([old])  # one reference fewer on the shared block
    req.blocks[i] = new
    bs = alloc.block_size
    req.slot_indices[i * bs:(i + 1) * bs] = range(new * bs, (new + 1) * bs)
    return True
    # END SOLUTION
