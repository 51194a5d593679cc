"""Continuous batching: each step decides who runs and with how many tokens, making room by
preempting when the pool is full.

One step's plan, in order:
  1. running requests, most deserving first (policy key, largest first): a decode needs one more
     slot, a chunked prefill its next chunk. No free block? Preempt the least deserving running
     request not yet served this step; if there is none, the request preempts itself.
  2. swapped requests come back (oldest preemption first) while blocks stay above the watermark.
  3. waiting requests (preempted ones at the front) are admitted while blocks stay above the
     watermark, so a newcomer is not preempted on its very next step.
Prefill tokens per step are capped by `prefill_chunk` (the engine's default: DEFAULT_PREFILL_CHUNK),
so a long prompt, or a burst of arrivals, cannot stall decodes in one giant forward.
"""

from __future__ import annotations

from collections import deque

from l1_contiguous import InputError
from l2_paged import BlockAllocator, blocks_needed, kv_positions_needed, reserve

from .lifecycle import EngineRequest, State
from .preempt import Preemptor


class RequestTooLargeError(InputError):
    """A request that could not fit even in an empty pool: rejected, never retried."""


class Scheduler:
    def __init__(self, alloc: BlockAllocator, policy, preemptor: Preemptor,
                 prefill_chunk: int | None = None, watermark_blocks: int = 1):
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be None (no chunking) or at least 1, got {prefill_chunk}")
        if watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be at least 0, got {watermark_blocks}")
        self.alloc, self.policy, self.preemptor = alloc, policy, preemptor
        self.prefill_chunk = prefill_chunk
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.swapped: deque[EngineRequest] = deque()

    def add(self, req: EngineRequest) -> None:
        self.check(req)
        req.state = State.WAITING
        self.waiting.append(req)

    def check(self, req: EngineRequest) -> None:
        """Reject, at once, a request that could never run."""
        if not req.prompt_ids or req.max_new_tokens < 1:  # either would never be scheduled correctly
            raise InputError(f"request {req.request_id} has {len(req.prompt_ids)} prompt tokens and "
                             f"max_new_tokens={req.max_new_tokens}; it needs at least 1 of each")
        need = self._peak_blocks(req)
        if need > self.alloc.num_blocks:
            raise RequestTooLargeError(
                f"request {req.request_id} needs {need} blocks (prompt {len(req.prompt_ids)} + "
                f"{req.max_new_tokens} new tokens) but the pool has {self.alloc.num_blocks}; "
                f"shorten it or give the pool more blocks")

    def _peak_blocks(self, req: EngineRequest) -> int:
        """The most blocks `req` holds at once over its life (L13: summed over its layer groups)."""
        return blocks_needed(kv_positions_needed(len(req.prompt_ids), req.max_new_tokens), self.alloc.block_size)

    def schedule(self, now: int) -> list[tuple[EngineRequest, int]]:
        """The plan for step `now`: (request, tokens to compute). Blocks are reserved for all."""
        budget = [self.prefill_chunk or float("inf")]  # a list so helpers can spend it
        plan = self._schedule_running(now, budget)
        self._resume_swapped()
        plan += self._admit_waiting(budget)
        for req, _ in plan:
            req.last_scheduled_step = now
        return plan

    def _schedule_running(self, now: int, budget: list) -> list[tuple[EngineRequest, int]]:
        queue = sorted(self.running, key=lambda r: self.policy(r, now), reverse=True)
        plan = []
        while queue:
            req = queue.pop(0)
            n = self._tokens_this_step(req, budget)
            if n and self._make_room(req, n, queue, now):
                plan.append((req, n))
                self._spend(budget, req, n)
        return plan

    def _make_room(self, req: EngineRequest, n: int, queue: list, now: int) -> bool:
        """Reserve blocks for `n` more tokens of `req`, preempting from `queue` if needed."""
        # BEGIN SOLUTION
        while self._blocks_for(req, n) > self.alloc.num_free:
            if not queue:
                self._preempt(req)
                return False
            victim = min(queue, key=lambda r: self.policy(r, now))
            queue.remove(victim)
            self._preempt(victim)
        self._reserve(req, n)
        return True
        # END SOLUTION

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self.preemptor.preempt(req)
        if req.state is State.SWAPPED:
            self.swapped.append(req)
        else:
            self.waiting.appendleft(req)  # recompute: first in line to come back

    def _resume_swapped(self) -> None:
        while self.swapped and self._fits(self.preemptor.blocks_to_swap_in(self.swapped[0])):
            req = self.swapped.popleft()
            self.preemptor.swap_in(req)
            self.running.append(req)  # computes again from the next step

    def _admit_waiting(self, budget: list) -> list[tuple[EngineRequest, int]]:
        plan, held = [], []
        while self.waiting:
            req = self.waiting.popleft()
            if self._tokens_this_step(req, budget) and self._hold(req):
                held.append(req)  # stays in its place in the queue; those behind it may go
                continue
            n = self._try_admit(req, budget)
            if not n:
                self.waiting.appendleft(req)
                break  # first come, first served: nobody overtakes the head of the queue
            req.state = State.RUNNING
            self.running.append(req)
            plan.append((req, n))
            self._spend(budget, req, n)
        self.waiting.extendleft(reversed(held))
        return plan

    def _hold(self, req: EngineRequest) -> bool:
        """Keep a waiting request out of this step although it would fit? Never in L5 (L8: while
        another request is computing the prefix it could share)."""
        return False

    def _try_admit(self, req: EngineRequest, budget: list) -> int:
        """Reserve blocks for the first tokens of a waiting request; 0 (holding nothing) if they don't fit."""
        n = self._tokens_this_step(req, budget)
        if not n or not self._fits(self._blocks_for(req, n)):
            return 0
        self._reserve(req, n)
        return n

    def _blocks_for(self, req: EngineRequest, n: int) -> int:
        """Free blocks needed to compute `n` more tokens of `req`."""
        return blocks_needed(req.cur_len + n, self.alloc.block_size) - len(req.blocks)

    def _reserve(self, req: EngineRequest, n: int) -> None:
        reserve(req, self.alloc, req.cur_len + n)

    def _fits(self, num_blocks: int) -> bool:
        # The watermark protects running requests; with none running, the whole pool may be used.
        reserve_left = self.watermark_blocks if self.running else 0
        return self.alloc.num_free - num_blocks >= reserve_left

    def _tokens_this_step(self, req: EngineRequest, budget: list) -> int:
        pending = req.num_pending
        return 1 if pending == 1 else int(min(pending, budget[0]))

    @staticmethod
    def _spend(budget: list, req: EngineRequest, n: int) -> None:
        # Called before the forward, so num_pending still says what these n tokens are: a prompt
        # chunk (pending > 1, charged even when n == 1) or a decode (pending == 1, never charged).
        if req.num_pending > 1:
            budget[0] -= n

    def remove(self, req: EngineRequest) -> None:
        """Take a finished or aborted request out of whichever queue holds it."""
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
