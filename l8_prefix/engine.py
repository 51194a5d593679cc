"""L5's engine with prefix sharing and parallel samples.

Admission: the request's leading full blocks are looked up by their chained keys; hits are
  shared (ref count + 1) and prefill starts at the first uncached position. The block holding
  the last token is never taken from the cache, so at least one token is computed and the
  request gets logits.
After each forward: blocks that became full are keyed, so later requests can find them.
Finish or preemption: references are dropped; keyed blocks stay cached until space is needed.
n > 1: the prompt is prefilled once; when its prefill completes, n - 1 forks share all its
  blocks (the partial last one too) and copy-on-write that block on their first write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from l2_paged import release
from l5_eviction import Engine, EngineRequest, Scheduler, State, WorkItem, make_engine

from .block_hash import block_key, chain_keys
from .cow import copy_on_write, shared_write_block
from .prefix_allocator import PrefixBlockAllocator


@dataclass
class SampledWorkItem(WorkItem):
    n: int = 1  # parallel samples of this prompt
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # sample k draws from a generator seeded with seed + k


@dataclass
class PrefixRequest(EngineRequest):
    block_keys: list[bytes] = field(default_factory=list)  # keys of its leading full blocks
    temperature: float = 0.0
    generator: torch.Generator | None = None
    forks: list[int] = field(default_factory=list)  # sample indices to fork after the prefill
    group: int = 0  # request id of the first sample of its prompt
    sample_index: int = 0


@dataclass
class PrefixCounters:
    prefill_tokens_total: int = 0  # tokens admitted requests needed K/V for
    prefix_hit_tokens: int = 0  # ... of which were found in the cache
    fork_shared_tokens: int = 0  # prompt tokens forks got from their parent without computing
    cow_copies: int = 0


class PrefixScheduler(Scheduler):
    def __init__(self, *args, pool, sharing: bool, counters: PrefixCounters):
        super().__init__(*args)
        self.pool, self.sharing, self.counters = pool, sharing, counters

    def _try_admit(self, req: PrefixRequest, budget: list) -> int:
        hits = self._attach_cached_prefix(req) if self.sharing and not req.blocks else 0
        n = super()._try_admit(req, budget)
        if not n and hits:  # it does not fit: hand the cached blocks back, try again next step
            release(req, self.alloc)
            req.cur_len, req.block_keys = 0, []
        elif n:
            self.counters.prefill_tokens_total += len(req.tokens)
            self.counters.prefix_hit_tokens += req.cur_len
        return n

    def _attach_cached_prefix(self, req: PrefixRequest) -> int:
        """Share the longest cached run of the request's full blocks; returns tokens reused."""
        # BEGIN SOLUTION
        bs = self.alloc.block_size
        keys = chain_keys(req.tokens[:-1], bs)  # never the last token's block: it must be computed
        hits = self.alloc.lookup(keys)
        self.alloc.acquire(hits)
        req.blocks = list(hits)
        req.slot_indices = [b * bs + i for b in hits for i in range(bs)]
        req.block_keys = keys[:len(hits)]
        req.cur_len = len(hits) * bs
        return req.cur_len
        # END SOLUTION

    def _blocks_for(self, req: PrefixRequest, n: int) -> int:
        cow = shared_write_block(req, self.alloc) is not None
        return super()._blocks_for(req, n) + cow

    def _reserve(self, req: PrefixRequest, n: int) -> None:
        self.counters.cow_copies += copy_on_write(req, self.alloc, self.pool)
        super()._reserve(req, n)


class PrefixEngine(Engine):
    request_cls = PrefixRequest
    allocator_cls = PrefixBlockAllocator

    def __init__(self, model, pool, alloc: PrefixBlockAllocator, prefix_sharing: bool = True, **kwargs):
        self.sharing, self.prefix = prefix_sharing, PrefixCounters()
        self._prefill_logits: dict[int, torch.Tensor] = {}
        super().__init__(model, pool, alloc, **kwargs)
        self.metrics_timeline: list[dict] = []

    def _make_scheduler(self, policy, prefill_chunk, watermark_blocks) -> Scheduler:
        return PrefixScheduler(self.alloc, policy, self.preemptor, prefill_chunk, watermark_blocks,
                               pool=self.pool, sharing=self.sharing, counters=self.prefix)

    # ------------------------------------------------------------------ requests and samples

    def add_request(self, item: WorkItem) -> PrefixRequest:
        """n > 1 with sharing: one request now, n - 1 forks after its prefill; without: n requests."""
        n = getattr(item, "n", 1)
        first = super().add_request(item)
        if self.sharing:
            first.forks = list(range(1, n))
        else:
            for k in range(1, n):
                self._as_sample(super().add_request(item), first, k)
        return first

    def _new_request(self, item: WorkItem) -> PrefixRequest:
        req = super()._new_request(item)
        req.temperature = getattr(item, "temperature", 0.0)
        req.group = req.request_id
        req.generator = self._generator(getattr(item, "seed", 0))
        return req

    def _as_sample(self, req: PrefixRequest, first: PrefixRequest, k: int) -> None:
        req.group, req.sample_index = first.group, k
        req.generator = self._generator(first.generator.initial_seed() + k)

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.model.device).manual_seed(seed)

    def _sample(self, reqs, logits) -> list[int]:
        for req, row in zip(reqs, logits):
            if req.forks and req.num_pending == 0:
                self._prefill_logits[req.request_id] = row  # the forks draw their first token from it
        # Draw only where the token is real (nothing pending): a draw for a mid-prompt chunk would be
        # thrown away but still advance the generator, and sharing changes how many chunks a prompt takes.
        return [draw(req, row) if req.num_pending == 0 else -1 for req, row in zip(reqs, logits)]

    # ------------------------------------------------------------------ after each forward

    def step(self):
        self._prefill_logits.clear()
        return super().step()

    def _commit(self, plan, tokens) -> None:
        for req, _ in plan:
            if self.sharing:
                self._register_full_blocks(req)
            if req.request_id in self._prefill_logits:
                self._fork(req, self._prefill_logits[req.request_id])
        super()._commit(plan, tokens)

    def _register_full_blocks(self, req: PrefixRequest) -> None:
        bs = self.alloc.block_size
        while len(req.block_keys) < req.cur_len // bs:
            i = len(req.block_keys)
            key = block_key(req.block_keys[-1] if req.block_keys else None, req.tokens[i * bs:(i + 1) * bs])
            self.alloc.register(req.blocks[i], key)
            req.block_keys.append(key)

    def _fork(self, parent: PrefixRequest, logits_row: torch.Tensor) -> None:
        """The parent's samples 1..n-1: same blocks (shared), their own first token."""
        for k in parent.forks:
            child = self._new_request(WorkItem(parent.prompt_ids, parent.max_new_tokens, self.now,
                                               parent.priority, parent.stop_token_ids))
            self._as_sample(child, parent, k)
            child.temperature = parent.temperature
            self.alloc.acquire(parent.blocks)
            child.blocks, child.slot_indices = list(parent.blocks), list(parent.slot_indices)
            child.block_keys, child.cur_len = list(parent.block_keys), parent.cur_len
            child.state = State.RUNNING
            self.requests[child.request_id] = child
            self.scheduler.running.append(child)
            self.prefix.fork_shared_tokens += child.cur_len
            child.output_ids.append(draw(child, logits_row))
            self._maybe_finish(child)
        parent.forks = []

    # ------------------------------------------------------------------ counters

    def _record(self, plan):
        record = super()._record(plan)
        self.metrics_timeline.append(self.metrics())
        return record

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
        }

    def summary(self) -> dict:
        return {**super().summary(), **self.metrics()}


def draw(req: PrefixRequest, logits_row: torch.Tensor) -> int:
    """Greedy at temperature 0, else one draw from softmax(logits / T) with the request's generator."""
    if req.temperature <= 0:
        return int(logits_row.argmax())
    probs = torch.softmax(logits_row.float() / req.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=req.generator))


def make_prefix_engine(model, num_blocks: int, block_size: int = 16, **kwargs) -> PrefixEngine:
    return make_engine(model, num_blocks, block_size, engine_cls=PrefixEngine, **kwargs)

