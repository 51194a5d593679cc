"""L8's engine made fit to run for days behind a server.

Small overrides, nothing about HTTP:
  * request ids come from a counter and finished requests are forgotten (`forget_finished`),
    so the engine's dicts and its per-step history stay bounded however many requests it serves;
  * `top_p` (nucleus sampling), `top_k` and `min_p`: each sampled row of logits is cut, in vLLM's
    order (min_p, then top_k, then top_p over what is left), before L8's `draw`; forks inherit
    their parent's settings;
  * per-token logprobs, and prompt logprobs (`echo`, for scoring): a request that wants the
    log-probability of every prompt token needs the logits of every prompt position, so it takes
    no prefix-cache hit (a hit skips exactly those positions) and its prefill returns all rows;
  * `pool_state()`: what every block holds right now, for the live page and the tests.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import torch

from l1_contiguous import InputError
from l5_eviction import State, StepRunner, make_engine
from l8_prefix import PrefixEngine, PrefixKvManager, PrefixRequest, SampledWorkItem, is_greedy


@dataclass
class ServeItem(SampledWorkItem):
    top_p: float = 1.0  # 1: the whole distribution
    top_k: int = 0  # 0: off; k: the k most likely tokens only
    min_p: float = 0.0  # 0: off; p: tokens at least p times as likely as the most likely one only
    ignore_eos: bool = False  # go on past the model's EOS (it stays in the ids), as vLLM's option
    min_tokens: int = 0  # EOS and stop ids cannot be picked before this many new tokens
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every id already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time an id was generated
    repetition_penalty: float = 1.0  # vLLM's (CTRL's): ids of prompt or output, logit / r if > 0 else * r
    logprobs: int | None = None  # None: off; k: each new token's log-probability and the k most likely
    prompt_logprobs: int | None = None  # None: off; k: the same for every prompt token after the first


PER_REQUEST = ("top_p", "top_k", "min_p", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "logprobs", "prompt_logprobs")
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default limit; OpenAI's chat allows 20)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model (float32 log-softmax of its raw
    logits: before penalties, temperature and top_p, as vLLM reports by default) and the `k` most
    likely ids with theirs."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class ServeRequest(PrefixRequest):
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output id, when asked
    prompt_logprobs: int | None = None
    # One per prompt position when asked; position 0 stays None (nothing comes before it).
    prompt_token_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs is not None


class ServeKvManager(PrefixKvManager):
    """A request that scores its prompt computes every prompt position: no hit, no waiting for one."""

    def attach_computed_prefix(self, req) -> int:
        return 0 if req.scores_prompt else super().attach_computed_prefix(req)

    def prefix_in_flight(self, req, in_flight) -> bool:
        return False if req.scores_prompt else super().prefix_in_flight(req, in_flight)


class ServeRunner(StepRunner):
    """L5's runner that also returns every row of a prefill chunk whose request scores its prompt
    (`forward_logits` still returns one row per request: the others go to the request)."""

    def _scores_chunk(self, req) -> bool:  # some position of this chunk predicts a prompt token
        return req.scores_prompt and req.cur_len < len(req.prompt_ids) - 1

    def logits_rows(self, reqs, meta) -> torch.Tensor:
        starts, ends = meta.cu_seqlens_q[:-1].tolist(), meta.cu_seqlens_q[1:].tolist()
        rows = [i for req, start, end in zip(reqs, starts, ends)
                for i in (range(start, end) if self._scores_chunk(req) else (end - 1,))]
        return torch.tensor(rows, dtype=torch.int64, device=meta.cu_seqlens_q.device)

    def forward_logits(self, reqs, num_new) -> torch.Tensor:
        scoring = [self._scores_chunk(r) for r in reqs]
        starts = [r.cur_len for r in reqs]
        logits = super().forward_logits(reqs, num_new)
        if not any(scoring):
            return logits
        last, at = [], 0
        for req, start, n, scores in zip(reqs, starts, num_new, scoring):
            rows = logits[at:at + n] if scores else logits[at:at + 1]
            at += len(rows)
            if scores:  # row j sits at position start + j and predicts the token after it
                for j, row in enumerate(rows[:len(req.prompt_ids) - 1 - start]):
                    position = start + j + 1
                    req.prompt_token_logprobs[position] = token_logprob(row, req.prompt_ids[position],
                                                                        req.prompt_logprobs)
            last.append(rows[-1])
        return torch.stack(last)


class ServeEngine(PrefixEngine):
    request_cls = ServeRequest
    kv_manager_cls = ServeKvManager
    runner_cls = ServeRunner

    def __init__(self, *args, history: int = 256, **kwargs):
        super().__init__(*args, **kwargs)
        self._ids = itertools.count()
        # L5/L8 keep one record per step for the notebooks' plots; a server keeps the last few.
        self.timeline, self.metrics_timeline = deque(maxlen=history), deque(maxlen=history)
        self._raw_rows: dict[int, torch.Tensor] = {}  # this step's logits rows, for logprobs

    @property
    def max_model_len(self) -> int:
        """The most positions one request can reach (prompt + new tokens): the model's context, or
        what the whole pool holds if that is less (vLLM would refuse to start; this course's pools
        are small on purpose). A request's last token is never written: hence the + 1."""
        a = self.alloc
        return min(self.model.config.max_position_embeddings, a.num_blocks * a.block_size + 1)

    def check_item(self, item) -> None:
        super().check_item(item)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(item, name, None)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise InputError(f"{name} must be an int from 0 to {MAX_LOGPROBS} (alternatives per token), got {k!r}")
        top_p = getattr(item, "top_p", 1.0)
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise InputError(f"top_p must be a number in (0, 1], got {top_p!r}")
        top_k, min_p = getattr(item, "top_k", 0), getattr(item, "min_p", 0.0)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InputError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
        if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
            raise InputError(f"min_p must be a number in [0, 1], got {min_p!r}")
        if not isinstance(getattr(item, "ignore_eos", False), bool):
            raise InputError(f"ignore_eos must be true or false, got {item.ignore_eos!r}")
        low = getattr(item, "min_tokens", 0)
        if isinstance(low, bool) or not isinstance(low, int) or not 0 <= low <= item.max_new_tokens:
            raise InputError(f"min_tokens must be an int from 0 to max_tokens ({item.max_new_tokens}), got {low!r}")
        for name, lo, hi in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("repetition_penalty", 0, 2)):
            value = getattr(item, name, getattr(ServeRequest, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi \
                    or (name == "repetition_penalty" and value == 0):
                raise InputError(f"{name} must be a number in {'(0' if lo == 0 else f'[{lo}'}, {hi}], got {value!r}")

    def new_request(self, item) -> ServeRequest:
        req = super().new_request(item)
        req.request_id = req.group = next(self._ids)  # not len(self.requests): finished ones are dropped
        for name in PER_REQUEST:
            setattr(req, name, getattr(item, name, getattr(ServeRequest, name)))
        if req.scores_prompt:
            req.prompt_token_logprobs = [None] * len(req.prompt_ids)
        return req

    def as_sample(self, req, first, k) -> None:
        super().as_sample(req, first, k)
        for name in PER_REQUEST:
            setattr(req, name, getattr(first, name))
        # A fork (sharing on) is born after its parent's prefill: the scores are there to copy.
        # Without sharing each sample prefills, and scores, its own copy of the prompt.
        req.prompt_token_logprobs = list(first.prompt_token_logprobs)

    def maybe_finish(self, req) -> None:
        if req.ignore_eos and req.output_ids[-1] in self.eos_ids and req.output_ids[-1] not in req.stop_token_ids:
            if len(req.output_ids) >= req.max_new_tokens:
                self.finish(req, "length")
            return
        super().maybe_finish(req)

    def sample(self, reqs, logits) -> list[int]:
        # The raw rows of the requests that want logprobs (a fork's first token reads its parent's).
        self._raw_rows = {r.request_id: row for r, row in zip(reqs, logits) if r.logprobs is not None}
        if any(_adjusts(r) for r in reqs):
            logits = torch.stack([self._adjusted(r, row) if _adjusts(r) else row for r, row in zip(reqs, logits)])
        if any(_truncates(r) for r in reqs):  # greedy rows are left whole: their argmax is in every cut
            logits = torch.stack([truncated(row, r.temperature, r.top_k, r.min_p, r.top_p) if _truncates(r) else row
                                  for r, row in zip(reqs, logits)])
        return super().sample(reqs, logits)  # the forks' first draw reads these (cut) rows too

    def commit(self, plan, tokens) -> None:
        super().commit(plan, tokens)
        if not self._raw_rows:  # nobody asked for logprobs this step
            return
        for req in self.requests.values():
            if req.logprobs is not None and len(req.token_logprobs) < len(req.output_ids):
                row = self._raw_rows.get(req.request_id, self._raw_rows.get(req.group))
                req.token_logprobs.append(token_logprob(row, req.output_ids[len(req.token_logprobs)], req.logprobs))

    def _adjusted(self, req, row: torch.Tensor) -> torch.Tensor:
        """The row after the request's penalties and its min_tokens mask (a copy)."""
        row = row.float().clone()
        if req.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.prompt_ids) | set(req.output_ids)), dtype=torch.long, device=row.device)
            picked = row[seen]
            row[seen] = torch.where(picked > 0, picked / req.repetition_penalty, picked * req.repetition_penalty)
        if req.output_ids and (req.presence_penalty or req.frequency_penalty):
            ids, counts = torch.tensor(req.output_ids, device=row.device).unique(return_counts=True)
            row[ids] -= req.presence_penalty + req.frequency_penalty * counts.to(row.dtype)
        if len(req.output_ids) < req.min_tokens:
            banned = (set() if req.ignore_eos else set(self.eos_ids)) | set(req.stop_token_ids)
            if banned:
                row[torch.tensor(sorted(banned), device=row.device)] = float("-inf")
        return row

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


def _adjusts(req) -> bool:
    return (req.repetition_penalty != 1.0 or req.presence_penalty != 0 or req.frequency_penalty != 0
            or len(req.output_ids) < req.min_tokens)


def _truncates(req) -> bool:
    return not is_greedy(req.temperature) and (req.top_p < 1 or req.top_k > 0 or req.min_p > 0)


def truncated(row: torch.Tensor, temperature: float, top_k: int = 0, min_p: float = 0.0,
              top_p: float = 1.0) -> torch.Tensor:
    """`row` with every token the sampling settings exclude set to -inf, in vLLM's order: min_p on
    softmax(row / T) (a token stays if its probability is at least min_p times the largest),
    then top_k (the k largest logits stay, ties at the k-th included), then top_p over the
    tokens left (their probabilities renormalized)."""
    if min_p > 0:
        probs = torch.softmax(row.float() / temperature, dim=-1)
        row = row.masked_fill(probs < min_p * probs.max(), -math.inf)
    if 0 < top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, -math.inf)
    return nucleus(row, temperature, top_p)


def token_logprob(row: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """`token`'s log-probability in the raw logits `row`, and the k most likely ids with theirs."""
    logprobs = torch.log_softmax(row.float(), dim=-1)
    top = torch.topk(logprobs, k, sorted=True) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if k else ()
    return TokenLogprob(float(logprobs[token]), pairs)


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
