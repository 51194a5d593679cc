"""L2's allocator with reference counts, a key -> block map, and cached free blocks.

Every block is in exactly one of three places:

    free            no key, no owner                   (L2's free list)
    in use          ref_count >= 1 tables hold it      (shared when >= 2)
    cached free     ref_count 0 but keyed: its K/V is still valid and can be reused by a
                    request with the same prefix, until the allocator needs the block
                    (then the least recently used one is evicted and its key forgotten)

free + in use + cached free = num_blocks, and alloc may take cached-free blocks, so num_free
counts both free kinds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from l2_paged import BlockAllocator, OutOfBlocksError


class PrefixBlockAllocator(BlockAllocator):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.ref_count = [0] * num_blocks
        self.key_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.evicted_cached = 0
        # A hook: called as on_evict(block, key) just before a cached block is reused, while its
        # K/V is still intact (L14 writes it back to a slower tier there).
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_shared(self) -> int:
        return sum(c > 1 for c in self.ref_count)

    def alloc_blocks(self, n: int) -> list[int]:
        """n fresh, unkeyed blocks with ref count 1: free ones first, then evict cached LRU."""
        # BEGIN SOLUTION
        if n > self.num_free:
            raise OutOfBlocksError(n, self.num_free)
        while len(self.free_blocks) < n:
            self._evict_lru()
        blocks = super().alloc_blocks(n)
        for b in blocks:
            self.ref_count[b] = 1
        return blocks
        # END SOLUTION

    def _evict_lru(self) -> None:
        block = next(iter(self.cached_free))
        if self.on_evict is not None:
            self.on_evict(block, self.key_of[block])
        self.forget(block)
        self.evicted_cached += 1

    def forget(self, block: int) -> None:
        """Turn a cached free block into a plain free one: its key (and K/V) is no longer found."""
        if block not in self.cached_free:  # also refuses ids outside the pool
            raise ValueError(f"block {block!r} is not cached free (in use, plain free or not in the pool); "
                             f"only a cached free block can be forgotten")
        del self.cached_free[block]
        del self.block_of[self.key_of.pop(block)]
        self._is_free[block] = True
        self.free_blocks.append(block)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; at zero a keyed block stays cached, others are free."""
        # BEGIN SOLUTION
        for i, b in enumerate(blocks):  # validate everything first: a bad call changes nothing
            self._check_id(b)
            if self.ref_count[b] - blocks[:i].count(b) <= 0:
                raise ValueError(f"block {b} has no reference left to drop (double free)")
        # Tail first, so a request's last blocks queue up for eviction before its first ones: the
        # lookup walks a chain from its start, and an evicted head would strand the tail behind it.
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if b in self.key_of:
                    self.cached_free[b] = None  # most recently used end
                else:
                    super().free([b])
        # END SOLUTION

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Blocks of the longest run of `keys`, from the first, that are cached (in use or not)."""
        hits = []
        for key in keys:
            if key not in self.block_of:
                break
            hits.append(self.block_of[key])
        return hits

    def _check_id(self, b) -> None:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
            raise ValueError(f"block id {b!r} is not in this pool (0..{self.num_blocks - 1})")

    def acquire(self, blocks: list[int]) -> None:
        """One more reference to each block (a cache hit, or a fork sharing its parent's blocks).
        Only a block in use or cached holds K/V worth sharing; a bad id changes nothing."""
        for b in blocks:
            self._check_id(b)
            if self.ref_count[b] == 0 and b not in self.cached_free:
                raise ValueError(f"block {b} is free: it holds no K/V to share (acquire a block in use or cached)")
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.cached_free[b]
            self.ref_count[b] += 1
        self.peak_used = max(self.peak_used, self.num_used)

    def register(self, block: int, key: bytes) -> None:
        """Key a full, computed block so later requests can find it. First writer wins."""
        self._check_id(block)
        if self.ref_count[block] == 0:
            raise ValueError(f"block {block} is not in use: only a block a request holds can be keyed")
        if not isinstance(key, bytes):
            raise ValueError(f"a block key is bytes (see block_key), got {type(key).__name__}")
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key] = block
            self.key_of[block] = key

    def check(self) -> None:
        """Assert the invariants (cheap enough for tests to call after every operation)."""
        in_use = {b for b in range(self.num_blocks) if self.ref_count[b] > 0}
        free, cached = set(self.free_blocks), set(self.cached_free)
        assert len(free) == len(self.free_blocks), "a block is twice in the free list"
        assert not (free & in_use or free & cached or cached & in_use), "a block is in two places"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, "a block is lost"
        assert all(b in self.key_of for b in cached), "a cached free block has no key"
        assert not free & set(self.key_of), "a free block is registered under a key"
        assert all(self.block_of[k] == b for b, k in self.key_of.items()), "key maps disagree"
        assert all(c >= 0 for c in self.ref_count), "negative reference count"
