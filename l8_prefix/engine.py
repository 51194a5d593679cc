"""L5's engine with prefix sharing and parallel samples.

Admission: the request's leading full blocks are looked up by their chained keys; hits are
  shared (ref count + 1) and prefill starts at the first uncached position. The block holding
  the last token is never taken from the cache, so at least one token is computed and the
  request gets logits.
After each forward: blocks that became full are keyed, so later requests can find them.
In-batch sharing: a waiting request whose next uncached block another running request is about
  to compute (same key) is held, up to max_prefix_hold steps, and admitted once that block is
  keyed: requests that arrive together compute their common prefix once.
Finish or preemption: references are dropped; keyed blocks stay cached until space is needed.
n > 1: the prompt is prefilled once; when its prefill completes, n - 1 forks share all its
  blocks (the partial last one too) and copy-on-write that block on their first write.
Counters: a request's prompt is counted once, at its first admission; K/V it computes again after a
  preemption is `tokens_recomputed`, never a prefix hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from l1_contiguous import InputError
from l1_contiguous.errors import one_line, short_repr
from l2_paged import release
from l5_eviction import Engine, EngineRequest, Scheduler, State, WorkItem, make_engine

from .block_hash import block_key, chain_keys
from .cow import copy_on_write, shared_write_block
from .prefix_allocator import PrefixBlockAllocator


MAX_TEMPERATURE = 100.0  # above this, softmax(logits / T) is all but uniform: sampling noise, not text
# Below this a temperature is greedy (vLLM's rule too): softmax(logits / T) is one-hot there anyway,
# and a T such as 1e-39 would overflow logits / T to inf and the softmax to NaN.
GREEDY_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW
SEED_LIMIT = 2**64  # torch.Generator seeds are unsigned 64-bit; sample k uses seed + k


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
    prompt_keys: list[bytes] = field(default_factory=list)  # keys of the full blocks it computes or hit
    held_steps: int = 0  # steps it was held waiting for a prefix another request computes


@dataclass
class PrefixCounters:
    prefill_tokens_total: int = 0  # tokens admitted requests needed K/V for
    prefix_hit_tokens: int = 0  # ... of which were found in the cache
    fork_shared_tokens: int = 0  # prompt tokens forks got from their parent without computing
    cow_copies: int = 0
    held_for_prefix: int = 0  # request-steps spent held while another request computed their prefix


class PrefixScheduler(Scheduler):
    def __init__(self, *args, pool, sharing: bool, counters: PrefixCounters, max_prefix_hold: int = 8):
        super().__init__(*args)
        self.pool, self.sharing, self.counters = pool, sharing, counters
        self.max_prefix_hold = max_prefix_hold
        self.held_now: list[int] = []  # request ids held during the last schedule()
        self._in_flight: set[bytes] | None = None  # keys being computed, built once per schedule()

    def schedule(self, now: int):
        self.held_now, self._in_flight = [], None
        return super().schedule(now)

    def _try_admit(self, req: PrefixRequest, budget: list) -> int:
        hits = self._attach_cached_prefix(req) if self.sharing and not req.blocks else 0
        n = super()._try_admit(req, budget)
        if not n and hits:  # it does not fit: hand the cached blocks back, try again next step
            self._drop_cached_prefix(req)
        elif n:
            if req.num_preemptions == 0:  # counted once; a recompute is not a hit (see tokens_recomputed)
                self.counters.prefill_tokens_total += len(req.tokens)
                self.counters.prefix_hit_tokens += req.cur_len
            if self.sharing:
                req.prompt_keys = chain_keys(req.tokens[:-1], self.alloc.block_size)
                if self._in_flight is not None:
                    self._in_flight.update(pending_keys(req))
        return n

    def _drop_cached_prefix(self, req: PrefixRequest) -> None:
        release(req, self.alloc)
        req.cur_len, req.block_keys = 0, []

    def _hold(self, req: PrefixRequest) -> bool:
        """Hold `req` this step when the next block it could share is being computed by another."""
        if not self.sharing or req.held_steps >= self.max_prefix_hold:
            return False  # the bound: after max_prefix_hold steps it computes what it must itself
        if self._in_flight is None:
            self._in_flight = {key for r in self.running for key in pending_keys(r)}
        if not self._in_flight or not self._prefix_in_flight(req, self._in_flight):
            return False
        req.held_steps += 1
        self.held_now.append(req.request_id)
        self.counters.held_for_prefix += 1
        return True

    def _prefix_in_flight(self, req: PrefixRequest, in_flight: set[bytes]) -> bool:
        """Is the first of `req`'s full blocks missing from the cache one that a running request is
        computing (its key in `in_flight`)? Then waiting a step turns that block into a hit."""
        # BEGIN SOLUTION
        keys = chain_keys(req.tokens[:-1], self.alloc.block_size)  # the blocks it could ever hit
        cached = len(self.alloc.lookup(keys))
        return cached < len(keys) and keys[cached] in in_flight
        # END SOLUTION

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


def pending_keys(req: PrefixRequest) -> list[bytes]:
    """Keys of the prompt blocks `req` will compute but has not keyed yet (none once prefilled)."""
    return req.prompt_keys[len(req.block_keys):]


class PrefixEngine(Engine):
    request_cls = PrefixRequest
    allocator_cls = PrefixBlockAllocator
    scheduler_cls = PrefixScheduler

    def __init__(self, model, pool, alloc: PrefixBlockAllocator, prefix_sharing: bool = True,
                 max_prefix_hold: int = 8, **kwargs):
        if max_prefix_hold < 0:
            raise ValueError(f"max_prefix_hold must be at least 0 (0: never hold), got {max_prefix_hold}")
        self.sharing, self.prefix, self.max_prefix_hold = prefix_sharing, PrefixCounters(), max_prefix_hold
        self._prefill_logits: dict[int, torch.Tensor] = {}
        super().__init__(model, pool, alloc, **kwargs)
        self.metrics_timeline: list[dict] = []

    def _make_scheduler(self, policy, prefill_chunk, watermark_blocks) -> Scheduler:
        return self.scheduler_cls(self.alloc, policy, self.preemptor, prefill_chunk, watermark_blocks,
                                  pool=self.pool, sharing=self.sharing, counters=self.prefix,
                                  max_prefix_hold=self.max_prefix_hold)

    # ------------------------------------------------------------------ requests and samples

    def _add(self, item: WorkItem) -> PrefixRequest:
        """n > 1 with sharing: one request now, n - 1 forks after its prefill; without: n requests."""
        n = getattr(item, "n", 1)
        first = super()._add(item)
        if self.sharing:
            first.forks = list(range(1, n))
        else:
            for k in range(1, n):
                self._as_sample(super()._add(item), first, k)
        return first

    def _check_item(self, item: WorkItem) -> None:
        super()._check_item(item)
        who = f"request {len(self.requests)}"
        n, temperature, seed = getattr(item, "n", 1), getattr(item, "temperature", 0.0), getattr(item, "seed", 0)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.alloc.num_blocks:
            raise InputError(f"{who}: n (samples) must be an int from 1 to the pool's {self.alloc.num_blocks} "
                             f"blocks (each sample writes into a block of its own), got {short_repr(n)}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not 0 <= temperature <= MAX_TEMPERATURE:  # NaN fails this too
            raise InputError(f"{who}: temperature must be a number from 0 (greedy) to {MAX_TEMPERATURE:g}, "
                             f"got {short_repr(temperature)}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_LIMIT - n:
            raise InputError(f"{who}: seed must be an int from 0 to 2**64 - n (sample k draws with seed + k), "
                             f"got {short_repr(seed)}")

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
        return [self._draw_or_fail(req, row) if req.num_pending == 0 else -1 for req, row in zip(reqs, logits)]

    @staticmethod
    def _draw_or_fail(req: PrefixRequest, logits_row: torch.Tensor) -> int:
        """`draw`, or -1 with `req.error` set if this request's sampling fails (e.g. NaN logits):
        the engine then finishes it alone with finish_reason "error" (see Engine._commit)."""
        try:
            return draw(req, logits_row)
        except Exception as exc:
            req.error = f"sampling failed: {one_line(exc)}"
            return -1

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
            child.temperature = parent.temperature
            self.alloc.acquire(parent.blocks)
            child.blocks, child.slot_indices = list(parent.blocks), list(parent.slot_indices)
            child.block_keys, child.cur_len = list(parent.block_keys), parent.cur_len
            child.state = State.RUNNING
            self.requests[child.request_id] = child
            self.scheduler.running.append(child)
            self.prefix.fork_shared_tokens += child.cur_len
            self._first_token_of_fork(child, parent, k, logits_row)
        parent.forks = []

    def _first_token_of_fork(self, child: PrefixRequest, parent: PrefixRequest, k: int, logits_row) -> None:
        """Seed sample k and draw its first token; if either fails, only this sample ends ("error")."""
        try:
            self._as_sample(child, parent, k)
        except Exception as exc:
            child.error = f"seeding sample {k} failed: {one_line(exc)}"
        else:
            token = self._draw_or_fail(child, logits_row)
        if child.error is not None:
            self._finish(child, "error")
        else:
            child.output_ids.append(token)
            self._maybe_finish(child)

    # ------------------------------------------------------------------ rollback (see Engine.step)

    def _stateful(self) -> list:
        return [*super()._stateful(), self.prefix]

    def _failure_marks(self) -> dict[int, bytes]:
        return dict(self.alloc.key_of)  # the keys when the step failed, before any rollback

    def _roll_back(self, saved: list, victims: list, keys_at_failure: dict[int, bytes]) -> None:
        """L5's rollback; then a cached block the step evicted (and may have overwritten) is forgotten."""
        super()._roll_back(saved, victims)
        for block, key in list(self.alloc.key_of.items()):
            if keys_at_failure.get(block) != key and self.alloc.ref_count[block] == 0:
                self.alloc.forget(block)

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
            "held_for_prefix": len(self.scheduler.held_now), "held_for_prefix_total": c.held_for_prefix,
        }

    def summary(self) -> dict:
        return {**super().summary(), **self.metrics()}


def draw(req: PrefixRequest, logits_row: torch.Tensor) -> int:
    """Greedy at temperature 0 (below GREEDY_BELOW), else one draw from softmax(logits / T) with the
    request's generator."""
    if is_greedy(req.temperature):
        return int(logits_row.argmax())
    probs = torch.softmax(logits_row.float() / req.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=req.generator))


def make_prefix_engine(model, num_blocks: int, block_size: int = 16, **kwargs) -> PrefixEngine:
    return make_engine(model, num_blocks, block_size, engine_cls=PrefixEngine, **kwargs)

