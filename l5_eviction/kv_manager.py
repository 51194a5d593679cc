"""The KV-cache manager: the scheduler's, the runner's and the engine's one door to blocks.

    scheduler ──peak_blocks, blocks_for, allocate, attach_computed_prefix,
                release_computed_prefix, admitted, new_schedule──────────┐
    runner ─────allocate_step, step_metadata─────────────────────────────┼─► KvManager ─► allocator, pool
    engine ─────adopt_blocks, stateful, failure_marks, repair_after_rollback┘

In a step nothing else counts, takes or keys blocks but the preemptor, which only takes a victim's
blocks away and gives them back (preempt.py); L10's rewind and L14's transfer hand blocks back
and forth through their own lessons' functions. L5's manager gives each request its own
blocks, one table in token order. A later lesson that changes how K/V is kept plugs in a subclass
and leaves the scheduler and the engine as they are: L8 shares a cached prefix (keys, reference
counts, copy-on-write), L13 keeps one table per group of layers and frees what falls behind a
window, L14 asks a connector for the blocks the pool lost.

The contract every manager keeps (the lesson text gives the reasons):
  peak_blocks(req, step_tokens)
                             the most blocks `req` holds at once over its whole life; the scheduler
                             refuses a request whose peak exceeds the pool
  blocks_for(req, n)         free blocks needed before `n` more tokens of `req` can be computed
                             (new blocks, and any copy a shared block needs before it is written)
  allocate(req, n)           take them: afterwards positions up to cur_len + n have slots. All or
                             nothing: OutOfBlocksError leaves `req` and the pool as they were
  allocate_step(reqs, ns)    `allocate` for a whole step, all or nothing across its requests
  attach_computed_prefix(req) -> tokens
                             give a waiting request (holding nothing) K/V it need not compute and
                             set its cur_len past them; L5: none, 0
  release_computed_prefix(req)
                             undo `attach_computed_prefix` for a request that was not admitted
  adopt_blocks(req, blocks)  `req`'s prompt K/V is in `blocks` already, one reference each held for
                             it (another engine computed it: L14's decode rank); InputError if
                             they do not hold the prompt
  admitted(req)              `req` was admitted with its blocks (L8 counts its hits here)
  new_schedule()             a step's plan begins (L8 forgets the keys it saw in flight)
  step_metadata(reqs, ns, device, backend) -> (input_ids [T], meta)
                             what one forward reads: positions, slots, block tables; every meta
                             has positions, cu_seqlens_q and max_query_len (the runner reads them)
  stateful()                 the objects a step may change (rolled back with it)
  failure_marks()            what a rollback must know about the state at a failure
  repair_after_rollback(marks)
                             after a rollback: forget whatever the failed step may have overwritten
"""

from __future__ import annotations

from l1_contiguous import InputError
from l2_paged import BlockAllocator, OutOfBlocksError, blocks_needed, kv_positions_needed, reserve

from .lifecycle import EngineRequest
from .mixed import build_step_meta


class KvManager:
    def __init__(self, alloc: BlockAllocator, pool):
        self.alloc, self.pool = alloc, pool

    @property
    def block_size(self) -> int:
        return self.alloc.block_size

    @property
    def num_blocks(self) -> int:
        return self.alloc.num_blocks

    @property
    def num_free(self) -> int:
        return self.alloc.num_free

    # ------------------------------------------------------------------ sizing and taking blocks

    def peak_blocks(self, req: EngineRequest, step_tokens: int | None = None) -> int:
        """The most blocks `req` holds at once; `step_tokens` (the most new tokens of one step)
        matters only where blocks are freed as a request runs (L13's windows)."""
        return blocks_needed(kv_positions_needed(len(req.prompt_ids), req.max_new_tokens), self.block_size)

    def blocks_for(self, req: EngineRequest, n: int) -> int:
        return max(0, blocks_needed(req.cur_len + n, self.block_size) - len(req.blocks))

    def allocate(self, req: EngineRequest, n: int) -> None:
        reserve(req, self.alloc, req.cur_len + n)

    def allocate_step(self, reqs: list[EngineRequest], num_new: list[int]) -> None:
        missing = sum(self.blocks_for(r, n) for r, n in zip(reqs, num_new))
        if missing > self.num_free:
            raise OutOfBlocksError(missing, self.num_free)
        for req, n in zip(reqs, num_new):
            self.allocate(req, n)

    # ------------------------------------------------------------------ K/V computed elsewhere

    def attach_computed_prefix(self, req: EngineRequest) -> int:
        return 0

    def release_computed_prefix(self, req: EngineRequest) -> None:
        pass

    def adopt_blocks(self, req: EngineRequest, blocks: list[int]) -> None:
        n, bs = len(req.prompt_ids), self.block_size
        if len(blocks) != blocks_needed(n, bs):
            raise InputError(f"a prompt of {n} tokens sits in {blocks_needed(n, bs)} blocks of {bs}, not {len(blocks)}")
        req.blocks, req.slot_indices = list(blocks), [b * bs + i for b in blocks for i in range(bs)]

    def admitted(self, req: EngineRequest) -> None:
        pass

    def new_schedule(self) -> None:
        pass

    # ------------------------------------------------------------------ one forward

    def step_metadata(self, reqs: list[EngineRequest], num_new: list[int], device, backend: str):
        return build_step_meta(reqs, num_new, device, backend)

    # ------------------------------------------------------------------ rollback (see Engine.step)

    def stateful(self) -> list:
        return [self, self.alloc]

    def failure_marks(self):
        return None

    def repair_after_rollback(self, marks) -> None:
        pass
