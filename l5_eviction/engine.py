"""The engine: a workload of requests arriving over time, run step by step to completion.

    step():  arrivals ─► scheduler.schedule() ─► one forward: decodes, then prefill chunks
             ─► commit: advance cur_len, append tokens, finish and free ─► timeline record
    A step is atomic: whatever interrupts it (an error in a layer, Ctrl-C while sampling, a failed
    swap or copy), it is rolled back to the state before it and the exception re-raised, so the
    next step simply runs it again. See `step` for the one exception: a victim preempted by the
    interrupted step may have had its blocks overwritten, so it comes back preempted for recompute.
    A rollback that is itself interrupted (a second Ctrl-C) is finished by the next call.
    `add_request` and `abort` are all or nothing too. A failure that belongs to one request (its
    sampling) finishes that request with finish_reason "error" and the others go on.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict

from l1_contiguous import InputError
from l1_contiguous.errors import short_repr
from l2_paged import BlockAllocator
from l3_block_kernel import BlockKvPool

from .kv_manager import KvManager
from .lifecycle import EngineRequest, State
from .mixed import StepRunner
from .policies import make_policy
from .preempt import Preemptor
from .rollback import PendingRollback, restore, snapshot
from .scheduler import DEFAULT_PREFILL_CHUNK, Scheduler
from .workload import STALL_STEPS, EngineStalledError, StepRecord, WorkItem, check_work_item, is_int


class Engine:
    """Besides its public calls (add_request, adopt_running, abort, step, run, summary), the hooks
    a later lesson overrides, each documented where it is defined: make_kv_manager, make_scheduler,
    new_request, check_item, enqueue, run_plan, sample, commit, maybe_finish, finish, stateful,
    record. Everything about blocks is the KV manager's (`self.kv`)."""

    request_cls = EngineRequest
    allocator_cls = BlockAllocator  # what make_engine builds for it (L8: a prefix-caching one)
    pool_cls = BlockKvPool  # ... and its pool (L13: one shared by groups of layers)
    kv_manager_cls = KvManager
    scheduler_cls = Scheduler
    runner_cls = StepRunner
    preemptor_cls = Preemptor

    def __init__(self, model, pool: BlockKvPool, alloc: BlockAllocator, policy: str = "lru",
                 preempt: str = "recompute", prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                 watermark_blocks: int = 1, backend: str | None = None):
        self.model, self.pool, self.alloc = model, pool, alloc
        self.kv = self.make_kv_manager()
        self.runner = self.runner_cls(model, self.kv, backend=backend)
        self.preemptor = self.preemptor_cls(pool, alloc, preempt)
        self.scheduler = self.make_scheduler(make_policy(policy, alloc.num_blocks), prefill_chunk,
                                              watermark_blocks)
        self.eos_ids = set(model.config.eos_token_ids)
        self.requests: dict[int, EngineRequest] = {}
        self.future: list[EngineRequest] = []  # added with an arrival step still ahead
        self.timeline: list[StepRecord] = []
        self.now = 0
        self._pending_rollback: PendingRollback | None = None  # a rollback a second interrupt cut short

    def make_kv_manager(self) -> KvManager:
        """A hook: the manager of this engine's blocks (L8, L13 and L14 pass it their options)."""
        return self.kv_manager_cls(self.alloc, self.pool)

    def make_scheduler(self, policy, prefill_chunk, watermark_blocks) -> Scheduler:
        """A hook: the scheduler (L8 and L10 build theirs with their own options)."""
        return self.scheduler_cls(self.kv, policy, self.preemptor, prefill_chunk, watermark_blocks)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, item: WorkItem) -> EngineRequest:
        """Queue one request; InputError (nothing queued) when the item cannot run on this model.
        All or nothing: whatever interrupts it, nothing of the request stays queued."""
        self._finish_rollback()
        self.check_item(item)
        with self._all_or_nothing([self, self.scheduler]):
            return self.enqueue(item)

    def adopt_running(self, item: WorkItem, blocks: list[int], first_token: int) -> EngineRequest:
        """A request whose prompt's K/V another engine computed (L14's prefill rank) into `blocks`
        (this pool's ids, in order, one reference each held for it) joins the running requests as
        if a step had computed its prompt and sampled `first_token` (it may finish at once).
        InputError, nothing changed, for an item `add_request` would refuse, blocks that do not
        hold the prompt (the manager's `adopt_blocks`), or a token outside the vocabulary."""
        self._finish_rollback()
        self.check_item(item)
        if not is_int(first_token) or not 0 <= first_token < self.model.config.vocab_size:
            raise InputError(f"first token {short_repr(first_token)} is not an id of this model's vocabulary")
        req = self.new_request(item)
        self.scheduler.check(req)  # one that could never run here (its decode outgrows the pool) is refused now
        with self._all_or_nothing():
            self.kv.adopt_blocks(req, blocks)
            req.cur_len, req.state = len(req.prompt_ids), State.RUNNING
            self.requests[req.request_id] = req
            self.scheduler.running.append(req)
            self.commit([(req, 0)], {req.request_id: first_token})  # as after the step that computed it
            return req

    def enqueue(self, item: WorkItem) -> EngineRequest:
        """A hook: queue a checked item (L8: its n samples); returns its (first) request."""
        req = self.new_request(item)
        if req.arrival_step <= self.now:
            self.scheduler.add(req)
        else:
            self.scheduler.check(req)  # a too-large request is rejected now, not when it arrives
            self.future.append(req)
        self.requests[req.request_id] = req
        return req

    def new_request(self, item: WorkItem) -> EngineRequest:
        """A hook: the request object for `item` (later lessons fill their own fields)."""
        return self.request_cls(list(item.prompt_ids), item.max_new_tokens, request_id=len(self.requests),
                                priority=item.priority, arrival_step=max(item.arrival_step, self.now),
                                stop_token_ids=tuple(item.stop_token_ids))

    def check_item(self, item: WorkItem) -> None:
        """A hook: every id, type and length checked at the door, so a bad request never reaches a
        step; InputError naming the request otherwise (L8 and L11 check their own fields too)."""
        check_work_item(item, self.model.config, f"request {len(self.requests)}")

    def abort(self, request_id: int) -> None:
        """Finish a request now (finish_reason "aborted"), freeing what it holds; all or nothing."""
        self._finish_rollback()
        if not is_int(request_id) or request_id not in self.requests:
            raise InputError(f"abort: no request has id {short_repr(request_id)} (ids are 0..{len(self.requests) - 1})")
        req = self.requests[request_id]
        if req.state is State.FINISHED:
            return
        with self._all_or_nothing([self, self.scheduler, *self.kv.stateful(), self.preemptor,
                                   self.preemptor.counters, req]):
            if req in self.future:
                self.future.remove(req)
            self.finish(req, "aborted")

    # ------------------------------------------------------------------ one step

    def step(self) -> StepRecord:
        """One step, all or nothing: on any exception (KeyboardInterrupt too) the engine, scheduler,
        allocator and requests go back to their state before the step, and the exception goes on.

        The pool itself is not saved: the step writes K/V only past each request's cur_len or into
        blocks it was handed, so what was cached stays valid, except the blocks of a request the
        step preempted (they may have been handed on and overwritten): that request is preempted
        for recompute after the rollback (its outputs are kept; only K/V is computed again).
        """
        self._finish_rollback()
        with self._all_or_nothing():
            self._arrivals()
            plan = self.scheduler.schedule(self.now)
            tokens = self.run_plan(plan)
            self.commit(plan, tokens)
            record = self.record(plan)
            self.now += 1
            return record

    def run_plan(self, plan) -> dict[int, int]:
        """One forward for the whole plan (see mixed.py); request id -> sampled token."""
        if not plan:
            return {}
        reqs, num_new = [r for r, _ in plan], [n for _, n in plan]
        logits = self.runner.forward_logits(reqs, num_new)
        return dict(zip((r.request_id for r in reqs), self.sample(reqs, logits)))

    def sample(self, reqs: list[EngineRequest], logits) -> list[int]:
        """Greedy. (L8 adds temperature sampling with a generator per request.)"""
        return logits.argmax(-1).tolist()

    # ------------------------------------------------------------------ rollback

    def stateful(self) -> list:
        """A hook: every object a step may change (the pool aside; see `step`). A lesson that
        adds state a step changes (counters, a drafter, a connector) extends this list."""
        live = [r for r in self.requests.values() if r.state is not State.FINISHED]
        return [self, self.scheduler, *self.kv.stateful(), self.preemptor, self.preemptor.counters, *live]

    @contextmanager
    def _all_or_nothing(self, objects: list | None = None):
        """Run the block; on any exception put `objects` (default: `stateful()`) back as they were.
        The rollback is noted first: if a second interrupt cuts it short, the next call finishes it."""
        saved = snapshot(self.stateful() if objects is None else objects)
        try:
            yield
        except BaseException:
            # Taken before anything is restored, so that a repeated rollback still knows them.
            victims = [obj for obj, state in saved
                       if isinstance(obj, EngineRequest) and obj.num_preemptions != state["num_preemptions"]]
            self._pending_rollback = PendingRollback(saved, victims, self.kv.failure_marks())
            self._finish_rollback()
            raise

    def _finish_rollback(self) -> None:
        """Complete a rollback, if one is pending. Safe to repeat: it restores from copies."""
        pending = self._pending_rollback
        if pending is not None:
            self._roll_back(pending.saved, pending.victims, pending.marks)
            self._pending_rollback = None

    def _roll_back(self, saved: list, victims: list[EngineRequest], marks) -> None:
        """Restore `saved`; the manager forgets what the failed step may have overwritten (`marks`:
        its state at the failure); then each victim the step preempted is preempted for recompute."""
        restore(saved)
        self.kv.repair_after_rollback(marks)
        for req in victims:  # back to before the step, then preempted without its (maybe reused) blocks
            if req in self.scheduler.running:
                self.scheduler.running.remove(req)
                self.preemptor.drop_for_recompute(req)
                self.scheduler.waiting.appendleft(req)

    def commit(self, plan, tokens: dict[int, int]) -> None:
        """A hook: after the forward, append each real token and finish whoever is done."""
        for req, _ in plan:
            if req.error is not None:  # its own failure this step (a lesson's `sample` set it): it alone stops
                self.finish(req, "error")
            elif req.num_pending == 0:  # the whole history is cached: the token is real
                req.output_ids.append(tokens[req.request_id])
                self.maybe_finish(req)

    def maybe_finish(self, req: EngineRequest) -> None:
        """A hook: finish `req` if its last token ends it (eos, a stop id, max_new_tokens)."""
        token = req.output_ids[-1]
        reason = ("eos" if token in self.eos_ids else "stop" if token in req.stop_token_ids
                  else "length" if len(req.output_ids) >= req.max_new_tokens else None)
        if reason:
            self.finish(req, reason)

    def finish(self, req: EngineRequest, reason: str) -> None:
        """A hook: take `req` out of the queues and free what it holds (L14 may keep its blocks)."""
        self.scheduler.remove(req)
        self.preemptor.discard(req)  # frees its blocks now
        req.state, req.finish_reason = State.FINISHED, reason

    def _arrivals(self) -> None:
        for req in [r for r in self.future if r.arrival_step <= self.now]:
            self.future.remove(req)
            self.scheduler.add(req)

    # ------------------------------------------------------------------ running a workload

    def has_unfinished(self) -> bool:
        return any(r.state is not State.FINISHED for r in self.requests.values())

    def run(self, workload: list[WorkItem] = (), max_steps: int = 100_000) -> dict[int, EngineRequest]:
        """Add `workload`, then step until every request is finished: by step number `max_steps`
        (an arrival past it is reported at once), and with some token computed at least every
        STALL_STEPS steps (EngineStalledError otherwise)."""
        for item in workload:
            self.add_request(item)
        idle = 0
        while self.has_unfinished():
            self.skip_idle_steps()
            if self.now >= max_steps:
                raise RuntimeError(f"workload not finished after {max_steps} steps")
            record = self.step()
            idle = idle + 1 if record.prefill_tokens + record.decode_tokens == 0 else 0
            if idle >= STALL_STEPS:
                raise EngineStalledError(self._stall_report())
        return self.requests

    def _stall_report(self) -> str:
        s, a = self.scheduler, self.alloc
        return (f"no token computed in {STALL_STEPS} steps with requests unfinished: {len(s.running)} running, "
                f"{len(s.waiting)} waiting, {len(s.swapped)} swapped; {a.num_free} of {a.num_blocks} blocks "
                f"free (blocks that never come back to the pool: a leak? requests never admitted?)")

    def skip_idle_steps(self) -> None:
        """With nothing queued and only later arrivals left, jump to the next arrival: an idle
        engine waits, it does not spin through empty steps (none is recorded in the timeline).
        `run` calls it before each step; so should a loop that calls `step` itself."""
        s = self.scheduler
        if self.future and not (s.waiting or s.running or s.swapped):
            self.now = max(self.now, min(r.arrival_step for r in self.future))

    # ------------------------------------------------------------------ counters

    def record(self, plan) -> StepRecord:
        """A hook: the step's timeline entry (L8 also snapshots its sharing counters)."""
        s = self.scheduler
        record = StepRecord(
            step=self.now, blocks_used=self.alloc.num_used, blocks_free=self.alloc.num_free,
            running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped),
            prefill_tokens=sum(n for _, n in plan if n > 1), decode_tokens=sum(1 for _, n in plan if n == 1),
            preempted=self.preemptor.take_events())
        self.timeline.append(record)
        return record

    def summary(self) -> dict:
        """Totals for reports and JSON."""
        return {**asdict(self.preemptor.counters),
                "blocks_total": self.alloc.num_blocks, "blocks_peak_used": self.alloc.peak_used,
                "blocks_free_at_end": self.alloc.num_free, "steps": self.now,
                "swapped_copies_left": sum(r.swapped is not None for r in self.requests.values())}
