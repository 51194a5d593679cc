"""One global free list of block ids, shared by every request."""

from __future__ import annotations

from l1_contiguous import InputError


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks. Later lessons catch this to preempt or evict instead of failing."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"asked for {requested} KV blocks but only {free} are free; "
                         f"give the pool more blocks (--num-blocks / --kv-memory) or run fewer requests")
        self.requested, self.free = requested, free


def check_pool_shape(num_blocks, block_size) -> None:
    """InputError (a ValueError) unless both are ints >= 1: a float, a bool or a string is refused."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be an int >= 1, got {value!r}")


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 and takes them back.

    Every id is either in `free_blocks` or owned by someone: free + used = num_blocks, always.
    A bad call (too many blocks, a double free, an unknown id) raises and changes nothing.
    """

    def __init__(self, num_blocks: int, block_size: int):
        check_pool_shape(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        # Popped from the end; reversed so a fresh allocator hands out 0, 1, 2, ... (easier to read).
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks  # O(1) double-free check
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def alloc_blocks(self, n: int) -> list[int]:
        # BEGIN SOLUTION
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self.free_blocks):
            raise OutOfBlocksError(n, len(self.free_blocks))  # checked before anything changes
        blocks = [self.free_blocks.pop() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks
        # END SOLUTION

    def free(self, blocks: list[int]) -> None:
        # BEGIN SOLUTION
        seen = set()
        for b in blocks:  # validate all first, so a bad id frees nothing
            if not (isinstance(b, int) and not isinstance(b, bool) and 0 <= b < self.num_blocks):
                raise ValueError(f"block id {b!r} is not in this pool (0..{self.num_blocks - 1})")
            if self._is_free[b] or b in seen:
                raise ValueError(f"block {b} is already free (double free)")
            seen.add(b)
        for b in blocks:
            self._is_free[b] = True
            self.free_blocks.append(b)
        # END SOLUTION
