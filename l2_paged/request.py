"""A request's bookkeeping, and `reserve()`, which grows its blocks on demand."""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import BlockAllocator


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 20
    request_id: int = 0
    blocks: list[int] = field(default_factory=list)  # owned block ids, in sequence order
    slot_indices: list[int] = field(default_factory=list)  # slot of every position the blocks cover
    cur_len: int = 0  # tokens whose K/V are in the pool; after prefilling T tokens: T
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False

    @property
    def tokens(self) -> list[int]:
        """Prompt then generated tokens; the last one has no K/V yet while decoding."""
        return self.prompt_ids + self.output_ids

    def wasted_slots(self, block_size: int) -> int:
        """Reserved but unfilled slots at the end of the last block (internal fragmentation)."""
        return len(self.blocks) * block_size - self.cur_len


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # ceil


def kv_positions_needed(prompt_len: int, max_new_tokens: int) -> int:
    """Positions of K/V a request writes at its longest: its last new token is never fed back."""
    return prompt_len + max_new_tokens - 1


def reserve(req: Request, alloc: BlockAllocator, target_len: int) -> None:
    """Make `req` own enough blocks for `target_len` positions. All-or-nothing on OutOfBlocksError."""
    # BEGIN SOLUTION
    missing = blocks_needed(target_len, alloc.block_size) - len(req.blocks)
    if missing <= 0:
        return
    new_blocks = alloc.alloc_blocks(missing)  # raises before req changes
    req.blocks.extend(new_blocks)
    for b in new_blocks:
        base = b * alloc.block_size
        req.slot_indices.extend(range(base, base + alloc.block_size))
    # END SOLUTION


def release(req: Request, alloc: BlockAllocator) -> None:
    """Give the request's blocks back. The pool is not touched: stale K/V is simply never read."""
    alloc.free(req.blocks)
    req.blocks, req.slot_indices = [], []
