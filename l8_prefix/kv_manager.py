"""L5's KV manager with a prefix cache: full blocks keyed by their chained hashes, shared by
reference count, copied before a shared block is written.

What each part of L5's contract (l5_eviction/kv_manager.py) becomes here:
  attach_computed_prefix   the longest cached run of the request's full blocks, shared (ref + 1);
                           never the block of the prompt's last token, which must be computed
  release_computed_prefix  those references dropped again (the request was not admitted)
  admitted                 counts the prompt once (a recompute is not a hit) and notes its keys
  blocks_for / allocate    + one block for a copy-on-write of a shared block about to be written
  repair_after_rollback    a cached block the failed step evicted (and may have overwritten) is
                           forgotten: its key no longer finds it
And what L8 adds to it:
  after_forward(req)       key the blocks that became full, so later requests find them
  fork(child, parent)      the child shares every block of the parent (the partial last one too)
  pending_keys(req), prefix_in_flight(req, in_flight)
                           what the scheduler needs to hold a request for a prefix in flight
  step_metadata            L4's, with the leading blocks every request of the step shares marked
                           for cascade attention (read once for all the step's rows)
"""

from __future__ import annotations

from dataclasses import dataclass

from l2_paged import release
from l4_paged_prefill import build_paged_meta, common_prefix_blocks
from l5_eviction import KvManager

from .block_hash import block_key, chain_keys
from .cow import copy_on_write, shared_write_block
from .prefix_allocator import PrefixBlockAllocator
from .request import PrefixRequest


@dataclass
class PrefixCounters:
    prefill_tokens_total: int = 0  # tokens admitted requests needed K/V for
    prefix_hit_tokens: int = 0  # ... of which were found in the cache
    fork_shared_tokens: int = 0  # prompt tokens forks got from their parent without computing
    cow_copies: int = 0
    held_for_prefix: int = 0  # request-steps spent held while another request computed their prefix
    cascade_steps: int = 0  # forwards that read a shared prefix once for all their rows (L4's cascade)
    cascade_block_reads_saved: int = 0  # per layer: the shared blocks' reads beyond the first, summed


class PrefixKvManager(KvManager):
    # A cascade pays a second pass and a merge: worth it only when enough rows share enough keys
    # (vLLM's rule of thumb is of the same kind). An engine may lower them (the tests, the smoke),
    # or turn the cascade off.
    cascade = True
    cascade_min_requests = 8
    cascade_min_prefix_tokens = 256

    def __init__(self, alloc: PrefixBlockAllocator, pool, sharing: bool = True):
        super().__init__(alloc, pool)
        self.sharing = sharing  # off: L5's behaviour (no keys, no hits; n samples are n requests)
        self.counters = PrefixCounters()
        self.in_flight: set[bytes] | None = None  # keys running requests compute, built once a schedule

    # ------------------------------------------------------------------ admission

    def attach_computed_prefix(self, req: PrefixRequest) -> int:
        """Share the longest cached run of the request's full blocks; returns tokens reused."""
        if not self.sharing:
            return 0
        # BEGIN SOLUTION
        bs = self.block_size
        keys = chain_keys(req.tokens[:-1], bs)  # never the last token's block: it must be computed
        hits = self.alloc.lookup(keys)
        self.alloc.acquire(hits)
        req.blocks = list(hits)
        req.slot_indices = [b * bs + i for b in hits for i in range(bs)]
        req.block_keys = keys[:len(hits)]
        req.cur_len = len(hits) * bs
        return req.cur_len
        # END SOLUTION

    def release_computed_prefix(self, req: PrefixRequest) -> None:
        release(req, self.alloc)
        req.cur_len, req.block_keys = 0, []

    def admitted(self, req: PrefixRequest) -> None:
        if req.num_preemptions == 0:  # counted once; a recompute is not a hit (see tokens_recomputed)
            self.counters.prefill_tokens_total += len(req.tokens)
            self.counters.prefix_hit_tokens += req.cur_len
        if self.sharing:
            req.prompt_keys = chain_keys(req.tokens[:-1], self.block_size)
            if self.in_flight is not None:
                self.in_flight.update(self.pending_keys(req))

    def blocks_for(self, req: PrefixRequest, n: int) -> int:
        cow = shared_write_block(req, self.alloc) is not None
        return super().blocks_for(req, n) + cow

    def allocate(self, req: PrefixRequest, n: int) -> None:
        self.counters.cow_copies += copy_on_write(req, self.alloc, self.pool)
        super().allocate(req, n)

    # ------------------------------------------------------------------ holding for a prefix in flight

    def new_schedule(self) -> None:
        self.in_flight = None

    def pending_keys(self, req: PrefixRequest) -> list[bytes]:
        """Keys of the prompt blocks `req` will compute but has not keyed yet (none once prefilled)."""
        return req.prompt_keys[len(req.block_keys):]

    def keys_in_flight(self, running: list[PrefixRequest]) -> set[bytes]:
        """Keys the running requests are computing; built once per schedule, then kept up to date."""
        if self.in_flight is None:
            self.in_flight = {key for r in running for key in self.pending_keys(r)}
        return self.in_flight

    def prefix_in_flight(self, req: PrefixRequest, in_flight: set[bytes]) -> bool:
        """Is the first of `req`'s full blocks missing from the cache one that a running request is
        computing (its key in `in_flight`)? Then waiting a step turns that block into a hit."""
        # BEGIN SOLUTION
        keys = chain_keys(req.tokens[:-1], self.block_size)  # the blocks it could ever hit
        cached = len(self.alloc.lookup(keys))
        return cached < len(keys) and keys[cached] in in_flight
        # END SOLUTION

    # ------------------------------------------------------------------ after each forward

    def after_forward(self, req: PrefixRequest) -> None:
        """Key each block of `req` that became full, so later requests can find it."""
        if not self.sharing:
            return
        bs = self.block_size
        while len(req.block_keys) < req.cur_len // bs:
            i = len(req.block_keys)
            key = block_key(req.block_keys[-1] if req.block_keys else None, req.tokens[i * bs:(i + 1) * bs])
            self.register_block(req, i, key)
            req.block_keys.append(key)

    def register_block(self, req: PrefixRequest, i: int, key: bytes) -> None:
        """Key the i-th block of `req` (L13: in every group that still holds it)."""
        self.alloc.register(req.blocks[i], key)

    def fork(self, child: PrefixRequest, parent: PrefixRequest) -> None:
        """`child` holds every block of `parent` (one more reference each) and its progress."""
        self.alloc.acquire(parent.blocks)
        child.blocks, child.slot_indices = list(parent.blocks), list(parent.slot_indices)
        child.block_keys, child.cur_len = list(parent.block_keys), parent.cur_len
        self.counters.fork_shared_tokens += child.cur_len

    # ------------------------------------------------------------------ one forward

    def step_metadata(self, reqs: list[PrefixRequest], num_new: list[int], device, backend: str):
        common = 0
        if self.cascade and self.sharing and len(reqs) >= self.cascade_min_requests:
            common = common_prefix_blocks([r.blocks for r in reqs], [r.cur_len + n for r, n in zip(reqs, num_new)],
                                          num_new, self.block_size)
            if common * self.block_size < self.cascade_min_prefix_tokens:
                common = 0
        if common:
            self.counters.cascade_steps += 1
            self.counters.cascade_block_reads_saved += common * (len(reqs) - 1)
        return build_paged_meta(reqs, num_new, device, backend, num_common_blocks=common)

    # ------------------------------------------------------------------ rollback

    def stateful(self) -> list:
        return [*super().stateful(), self.counters]

    def failure_marks(self) -> dict[int, bytes]:
        return dict(self.alloc.key_of)  # the keys when the step failed, before any rollback

    def repair_after_rollback(self, keys_at_failure: dict[int, bytes]) -> None:
        for block, key in list(self.alloc.key_of.items()):
            if keys_at_failure.get(block) != key and self.alloc.ref_count[block] == 0:
                self.alloc.forget(block)
