"""L5's engine with prefix sharing and parallel samples; the blocks' side is PrefixKvManager's.

Admission: the manager shares the request's leading full blocks found by their chained keys
  (ref count + 1) and prefill starts at the first uncached position. The block holding the last
  token is never taken from the cache, so at least one token is computed and the request gets logits.
After each forward: the manager keys the blocks that became full, so later requests can find them.
In-batch sharing: a waiting request whose next uncached block another running request is about
  to compute (same key) is held, up to max_prefix_hold steps, and admitted once that block is
  keyed: requests that arrive together compute their common prefix once (PrefixScheduler.hold).
Finish or preemption: references are dropped; keyed blocks stay cached until space is needed.
n > 1: the prompt is prefilled once; when its prefill completes, n - 1 forks share all its
  blocks (the partial last one too) and copy-on-write that block on their first write.
Counters: a request's prompt is counted once, at its first admission; K/V it computes again after a
  preemption is `tokens_recomputed`, never a prefix hit.
"""

from __future__ import annotations

import torch

from l1_contiguous.errors import one_line
from l5_eviction import Engine, Scheduler, State, WorkItem, make_engine

from .kv_manager import PrefixKvManager
from .prefix_allocator import PrefixBlockAllocator
from .request import PrefixRequest
from .sampling import check_sampling, draw_or_fail


class PrefixScheduler(Scheduler):
    def __init__(self, *args, max_prefix_hold: int = 8, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_prefix_hold = max_prefix_hold
        self.held_now: list[int] = []  # request ids held during the last schedule()

    def schedule(self, now: int):
        self.held_now = []
        return super().schedule(now)

    def hold(self, req: PrefixRequest) -> bool:
        """Hold `req` this step when the next block it could share is being computed by another."""
        if not self.kv.sharing or req.held_steps >= self.max_prefix_hold:
            return False  # the bound: after max_prefix_hold steps it computes what it must itself
        in_flight = self.kv.keys_in_flight(self.running)
        if not in_flight or not self.kv.prefix_in_flight(req, in_flight):
            return False
        req.held_steps += 1
        self.held_now.append(req.request_id)
        self.kv.counters.held_for_prefix += 1
        return True


class PrefixEngine(Engine):
    request_cls = PrefixRequest
    allocator_cls = PrefixBlockAllocator
    kv_manager_cls = PrefixKvManager
    scheduler_cls = PrefixScheduler

    def __init__(self, model, pool, alloc: PrefixBlockAllocator, prefix_sharing: bool = True,
                 max_prefix_hold: int = 8, **kwargs):
        if max_prefix_hold < 0:
            raise ValueError(f"max_prefix_hold must be at least 0 (0: never hold), got {max_prefix_hold}")
        self.sharing, self.max_prefix_hold = prefix_sharing, max_prefix_hold
        self._prefill_logits: dict[int, torch.Tensor] = {}  # this step's row of each parent to fork
        super().__init__(model, pool, alloc, **kwargs)
        self.prefix = self.kv.counters
        self.metrics_timeline: list[dict] = []

    def make_kv_manager(self) -> PrefixKvManager:
        return self.kv_manager_cls(self.alloc, self.pool, sharing=self.sharing)

    def make_scheduler(self, policy, prefill_chunk, watermark_blocks) -> Scheduler:
        return self.scheduler_cls(self.kv, policy, self.preemptor, prefill_chunk, watermark_blocks,
                                  max_prefix_hold=self.max_prefix_hold)

    # ------------------------------------------------------------------ requests and samples

    def enqueue(self, item: WorkItem) -> PrefixRequest:
        """n > 1 with sharing: one request now, n - 1 forks after its prefill; without: n requests."""
        n = getattr(item, "n", 1)
        first = super().enqueue(item)
        if self.sharing:
            first.forks = list(range(1, n))
        else:
            for k in range(1, n):
                self.as_sample(super().enqueue(item), first, k)
        return first

    def check_item(self, item: WorkItem) -> None:
        super().check_item(item)
        check_sampling(item, f"request {len(self.requests)}", self.alloc.num_blocks)

    def new_request(self, item: WorkItem) -> PrefixRequest:
        req = super().new_request(item)
        req.temperature = getattr(item, "temperature", 0.0)
        req.group = req.request_id
        req.generator = self._generator(getattr(item, "seed", 0))
        return req

    def as_sample(self, req: PrefixRequest, first: PrefixRequest, k: int) -> None:
        """A hook: make `req` sample k of `first`'s prompt (L11 copies its settings too)."""
        req.group, req.sample_index = first.group, k
        req.generator = self._generator(first.generator.initial_seed() + k)

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.model.device).manual_seed(seed)

    def sample(self, reqs, logits) -> list[int]:
        for req, row in zip(reqs, logits):
            if req.forks and req.num_pending == 0:
                self._prefill_logits[req.request_id] = row  # the forks draw their first token from it
        # Draw only where the token is real (nothing pending): a draw for a mid-prompt chunk would be
        # thrown away but still advance the generator, and sharing changes how many chunks a prompt takes.
        return [draw_or_fail(req, row) if req.num_pending == 0 else -1 for req, row in zip(reqs, logits)]

    # ------------------------------------------------------------------ after each forward

    def step(self):
        self._prefill_logits.clear()
        return super().step()

    def record(self, plan):
        record = super().record(plan)
        self.metrics_timeline.append(self.metrics())
        return record

    def commit(self, plan, tokens) -> None:
        for req, _ in plan:
            self.kv.after_forward(req)  # before any fork or finish: keys the blocks now full
            if req.request_id in self._prefill_logits:
                self.fork(req, self._prefill_logits[req.request_id])
        super().commit(plan, tokens)

    def fork(self, parent: PrefixRequest, logits_row: torch.Tensor) -> None:
        """The parent's samples 1..n-1: same blocks (shared), their own first token."""
        for k in parent.forks:
            child = self.new_request(WorkItem(parent.prompt_ids, parent.max_new_tokens, self.now,
                                              parent.priority, parent.stop_token_ids))
            child.temperature = parent.temperature
            self.kv.fork(child, parent)
            child.state = State.RUNNING
            self.requests[child.request_id] = child
            self.scheduler.running.append(child)
            self._first_token_of_fork(child, parent, k, logits_row)
        parent.forks = []

    def _first_token_of_fork(self, child: PrefixRequest, parent: PrefixRequest, k: int, logits_row) -> None:
        """Seed sample k and draw its first token; if either fails, only this sample ends ("error")."""
        try:
            self.as_sample(child, parent, k)
        except Exception as exc:
            child.error = f"seeding sample {k} failed: {one_line(exc)}"
        else:
            token = draw_or_fail(child, logits_row)
        if child.error is not None:
            self.finish(child, "error")
        else:
            child.output_ids.append(token)
            self.maybe_finish(child)

    # ------------------------------------------------------------------ counters

    def metrics(self) -> dict:
        """A snapshot of the sharing counters (the notebook plots these over steps)."""
        a, c = self.alloc, self.prefix
        logical = sum(len(r.blocks) for r in self.requests.values() if r.state is State.RUNNING)
        return {
            "step": self.now, "memory_utilization": a.num_used / a.num_blocks,
            "sharing_ratio": logical / a.num_used if a.num_used else 1.0,
            "blocks_saved": logical - a.num_used if a.num_used else 0,
            "shared_blocks_now": a.num_shared, "cached_free_blocks": len(a.cached_free),
            "cached_blocks_evicted": a.evicted_cached, "prefix_hit_tokens": c.prefix_hit_tokens,
            "hit_rate": c.prefix_hit_tokens / c.prefill_tokens_total if c.prefill_tokens_total else 0.0,
            "prefill_tokens_total": c.prefill_tokens_total,
            "prefill_tokens_computed": c.prefill_tokens_total - c.prefix_hit_tokens,
            "fork_shared_tokens": c.fork_shared_tokens, "cow_copies": c.cow_copies,
            "held_for_prefix": len(self.scheduler.held_now), "held_for_prefix_total": c.held_for_prefix,
            "cascade_steps": c.cascade_steps, "cascade_block_reads_saved": c.cascade_block_reads_saved,
        }

    def summary(self) -> dict:
        return {**super().summary(), **self.metrics()}


def make_prefix_engine(model, num_blocks: int, block_size: int = 16, **kwargs) -> PrefixEngine:
    return make_engine(model, num_blocks, block_size, engine_cls=PrefixEngine, **kwargs)
