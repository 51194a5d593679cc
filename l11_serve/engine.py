"""L8's engine made fit to run for days behind a server.

Three small overrides, nothing about HTTP:
  * request ids come from a counter and finished requests are forgotten (`forget_finished`),
    so the engine's dicts and its per-step history stay bounded however many requests it serves;
  * `top_p` (nucleus sampling): each row of logits is cut to its smallest set of tokens whose
    probability adds up to top_p before L8's `draw`; forks inherit their parent's top_p;
  * `pool_state()`: what every block holds right now, for the live page and the tests.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

import torch

from l1_contiguous import InputError
from l5_eviction import State, make_engine
from l8_prefix import PrefixEngine, PrefixRequest, SampledWorkItem, is_greedy


@dataclass
class ServeItem(SampledWorkItem):
    top_p: float = 1.0  # 1: the whole distribution


@dataclass
class ServeRequest(PrefixRequest):
    top_p: float = 1.0


class ServeEngine(PrefixEngine):
    request_cls = ServeRequest

    def __init__(self, *args, history: int = 256, **kwargs):
        super().__init__(*args, **kwargs)
        self._ids = itertools.count()
        # L5/L8 keep one record per step for the notebooks' plots; a server keeps the last few.
        self.timeline, self.metrics_timeline = deque(maxlen=history), deque(maxlen=history)

    def _check_item(self, item) -> None:
        super()._check_item(item)
        top_p = getattr(item, "top_p", 1.0)
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise InputError(f"top_p must be a number in (0, 1], got {top_p!r}")

    def _new_request(self, item) -> ServeRequest:
        req = super()._new_request(item)
        req.request_id = req.group = next(self._ids)  # not len(self.requests): finished ones are dropped
        req.top_p = getattr(item, "top_p", 1.0)
        return req

    def _as_sample(self, req, first, k) -> None:
        super()._as_sample(req, first, k)
        req.top_p = first.top_p

    def _sample(self, reqs, logits) -> list[int]:
        if any(not is_greedy(r.temperature) and r.top_p < 1 for r in reqs):
            logits = torch.stack([nucleus(row, r.temperature, r.top_p) if not is_greedy(r.temperature) else row
                                  for r, row in zip(reqs, logits)])
        return super()._sample(reqs, logits)  # the forks' first draw reads these (cut) rows too

    def forget_finished(self) -> list[ServeRequest]:
        """Drop finished requests from `requests` (their blocks went back when they finished)."""
        done = [r for r in self.requests.values() if r.state is State.FINISHED]
        for req in done:
            del self.requests[req.request_id]
        return done

    def pool_state(self) -> list[tuple[str, int, int]]:
        """(state, ref count, owning group or -1) per block; state: free, used, shared or cached."""
        a = self.alloc
        owner = {b: r.group for r in self.scheduler.running for b in r.blocks}
        return [("shared" if a.ref_count[b] > 1 else "used" if a.ref_count[b] == 1
                 else "cached" if b in a.cached_free else "free", a.ref_count[b], owner.get(b, -1))
                for b in range(a.num_blocks)]


def nucleus(row: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """`row` with every token outside the top_p nucleus of softmax(row / T) set to -inf."""
    if top_p >= 1:
        return row
    probs = torch.softmax(row.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the tokens ranked above
    drop = order[before >= top_p]  # the first token is always kept (before = 0 < top_p)
    return row.index_fill(-1, drop, -math.inf)


def make_serve_engine(model, num_blocks: int, block_size: int = 16, **kwargs) -> ServeEngine:
    return make_engine(model, num_blocks, block_size, engine_cls=ServeEngine, **kwargs)
