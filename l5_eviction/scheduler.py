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
Every question about blocks (how many, take them, reuse computed ones) goes to the KV manager
(kv_manager.py): the scheduler decides who runs, the manager what that costs in blocks.
"""

from __future__ import annotations

from collections import deque

from l1_contiguous import InputError

from .kv_manager import KvManager
from .lifecycle import EngineRequest, State
from .preempt import Preemptor

# Prompt tokens one step may compute (all prefills together; decodes are not charged). Without a
# cap, 32 requests of 288 tokens arriving together are one 9,216-token forward: every decode waits
# for it, and its attention mask is 9,216 x 9,216. 256 bounds a step's prefill rows (and its mask)
# whatever arrives, and is a multiple of every block size the course uses.
DEFAULT_PREFILL_CHUNK = 256


class RequestTooLargeError(InputError):
    """A request that could not fit even in an empty pool: rejected, never retried."""


class Scheduler:
    def __init__(self, kv: KvManager, policy, preemptor: Preemptor,
                 prefill_chunk: int | None = None, watermark_blocks: int = 1):
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be None (no chunking) or at least 1, got {prefill_chunk}")
        if watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be at least 0, got {watermark_blocks}")
        self.kv, self.policy, self.preemptor = kv, policy, preemptor
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
        need = self.kv.peak_blocks(req, self.prefill_chunk)
        if need > self.kv.num_blocks:
            raise RequestTooLargeError(
                f"request {req.request_id} needs {need} blocks (prompt {len(req.prompt_ids)} + "
                f"{req.max_new_tokens} new tokens) but the pool has {self.kv.num_blocks}; "
                f"shorten it or give the pool more blocks")

    def schedule(self, now: int) -> list[tuple[EngineRequest, int]]:
        """The plan for step `now`: (request, tokens to compute). Blocks are reserved for all."""
        budget = [self.prefill_chunk or float("inf")]  # a list so helpers can spend it
        self.kv.new_schedule()
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
            n = self.tokens_this_step(req, budget)
            if n and self._make_room(req, n, queue, now):
                plan.append((req, n))
                spend(budget, req, n)
        return plan

    def _make_room(self, req: EngineRequest, n: int, queue: list, now: int) -> bool:
        """Reserve blocks for `n` more tokens of `req`, preempting from `queue` if needed."""
        # BEGIN SOLUTION
        while self.kv.blocks_for(req, n) > self.kv.num_free:
            if not queue:
                self.preempt(req)
                return False
            victim = min(queue, key=lambda r: self.policy(r, now))
            queue.remove(victim)
            self.preempt(victim)
        self.kv.allocate(req, n)
        return True
        # END SOLUTION

    def preempt(self, req: EngineRequest) -> None:
        """A hook: take `req`'s blocks away (the preemptor's mode) and queue it to come back
        (L10 drops its proposals first)."""
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
            if self.tokens_this_step(req, budget) and self.hold(req):
                held.append(req)  # stays in its place in the queue; those behind it may go
                continue
            n = self._try_admit(req, budget)
            if not n:
                self.waiting.appendleft(req)
                break  # first come, first served: nobody overtakes the head of the queue
            req.state = State.RUNNING
            self.running.append(req)
            plan.append((req, n))
            spend(budget, req, n)
        self.waiting.extendleft(reversed(held))
        return plan

    def hold(self, req: EngineRequest) -> bool:
        """A hook: keep a waiting request out of this step although it would fit? Never in L5
        (L8: while another request is computing the prefix it could share)."""
        return False

    def _try_admit(self, req: EngineRequest, budget: list) -> int:
        """Blocks for the first tokens of a waiting request, after whatever computed prefix the
        manager can give it; 0 (holding nothing) if they don't fit."""
        reused = self.kv.attach_computed_prefix(req) if not req.blocks else 0
        n = self.tokens_this_step(req, budget)
        if not n or not self._fits(self.kv.blocks_for(req, n)):
            if reused:
                self.kv.release_computed_prefix(req)  # try again next step, from nothing
            return 0
        self.kv.allocate(req, n)
        self.kv.admitted(req)
        return n

    def _fits(self, num_blocks: int) -> bool:
        # The watermark protects running requests; with none running, the whole pool may be used.
        reserve_left = self.watermark_blocks if self.running else 0
        return self.kv.num_free - num_blocks >= reserve_left

    def tokens_this_step(self, req: EngineRequest, budget: list) -> int:
        """A hook: tokens of `req` to compute this step (L10: a decode with its proposals)."""
        pending = req.num_pending
        return 1 if pending == 1 else int(min(pending, budget[0]))

    def remove(self, req: EngineRequest) -> None:
        """Take a finished or aborted request out of whichever queue holds it."""
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)


def spend(budget: list, req: EngineRequest, n: int) -> None:
    """Charge `n` tokens of `req` to the step's prefill budget if they are prompt (`in_prefill`):
    decodes, and L10's verify rows, are never charged. Called before the forward, so the request
    still says what these n tokens are (a prompt chunk is charged even when n == 1)."""
    if req.in_prefill:
        budget[0] -= n
