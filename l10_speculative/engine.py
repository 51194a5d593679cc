"""L8's engine with speculative decoding: propose k tokens, verify them in the step's one forward,
keep the accepted ones, rewind the rest.

    schedule   decoding requests get proposals from the drafter (request.draft); a request with
               k proposals is planned for k + 1 tokens: its last token and the proposals
    forward    L5's mixed step, unchanged: the k + 1 rows go the prefill path (a causal mask over
               the request's cached history), next to other requests' decodes and prompt chunks
    sample     a verifying request's k + 1 rows are all returned (`VerifyRunner.logits_rows`);
               acceptance picks the kept proposals and the target's own next token
    commit     output += kept proposals; rewind cur_len to the accepted end, blocks past it freed;
               then L8's commit: only blocks whose tokens are all accepted get keyed

While proposals are in `draft`, `tokens` includes them: to the scheduler and the forward they are
just tokens without K/V. A step is still all or nothing (L5): the draft is part of the request's
state, so a rolled-back step forgets it, and a preempted request drops its draft first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from l1_contiguous import InputError
from l1_contiguous.errors import one_line
from l5_eviction import State, StepRunner, make_engine
from l8_prefix import PrefixEngine, PrefixRequest, PrefixScheduler, is_greedy

from .acceptance import accept_greedy, accept_sampled, next_k
from .rewind import rewind


@dataclass
class SpecRequest(PrefixRequest):
    draft: list[int] = field(default_factory=list)  # proposals being verified this step
    draft_probs: torch.Tensor | None = None  # [len(draft), V] the drafter's distributions, or None
    k: int = 0  # proposals to ask for next step (adapted from its acceptance)
    proposed: int = 0
    accepted: int = 0
    spec_error: str | None = None  # why speculation stopped for it (its drafter failed), or None

    @property
    def tokens(self) -> list[int]:
        """Prompt, generated tokens, then (during a verify step) the proposals."""
        return self.prompt_ids + self.output_ids + self.draft

    @property
    def in_prefill(self) -> bool:
        return not self.draft and self.num_pending > 1  # verify rows are decode work, not prompt


@dataclass
class SpecCounters:
    verify_steps: int = 0  # request-steps that verified at least one proposal
    proposed: int = 0
    accepted: int = 0
    forwards: int = 0  # target forwards (steps with work)
    token_steps: int = 0  # request-steps that produced tokens: generated / token_steps = tokens per step
    drafter_failures: int = 0  # requests whose drafter raised: they go on without speculation


class SpecScheduler(PrefixScheduler):
    def __init__(self, *args, propose, **kwargs):
        super().__init__(*args, **kwargs)
        self.propose = propose  # the engine's: fills request.draft for decoding requests

    def schedule(self, now: int):
        self.propose([r for r in self.running if r.num_pending == 1])
        return super().schedule(now)

    def tokens_this_step(self, req: SpecRequest, budget: list) -> int:
        if not req.draft:
            return super().tokens_this_step(req, budget)
        # Speculation never preempts anyone: keep only the proposals whose blocks are free now.
        kv = self.kv
        spare = kv.num_free - kv.blocks_for(req, 1)
        while req.draft and kv.blocks_for(req, 1 + len(req.draft)) - kv.blocks_for(req, 1) > max(0, spare):
            req.draft.pop()
        return 1 + len(req.draft)

    def preempt(self, req: SpecRequest) -> None:
        req.draft, req.draft_probs = [], None  # recompute would otherwise prefill the guesses
        super().preempt(req)


class VerifyRunner(StepRunner):
    """L5's runner that returns every row of a verifying request, not only its last."""

    def logits_rows(self, reqs, meta) -> torch.Tensor:
        last = (meta.cu_seqlens_q[1:] - 1).tolist()
        rows = [i for req, end in zip(reqs, last) for i in range(end - len(req.draft), end + 1)]
        return torch.tensor(rows, dtype=torch.int64, device=meta.cu_seqlens_q.device)


class SpecEngine(PrefixEngine):
    request_cls = SpecRequest
    scheduler_cls = SpecScheduler
    runner_cls = VerifyRunner

    def __init__(self, model, pool, alloc, drafter=None, k: int = 4, adaptive_k: bool = True, **kwargs):
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 16:
            raise InputError(f"k (proposals per step) must be an int in 0..16 (0: no speculation), got {k!r}")
        self.drafter = drafter if k else None
        self.k_max, self.adaptive_k = k, adaptive_k
        self.spec = SpecCounters()
        self._verified: dict[int, list[int]] = {}  # request id -> ids its verify produced
        super().__init__(model, pool, alloc, **kwargs)

    def make_scheduler(self, policy, prefill_chunk, watermark_blocks):
        return self.scheduler_cls(self.kv, policy, self.preemptor, prefill_chunk, watermark_blocks,
                                  max_prefix_hold=self.max_prefix_hold, propose=self._propose)

    def new_request(self, item) -> SpecRequest:
        req = super().new_request(item)
        req.k = self.k_max
        return req

    # ------------------------------------------------------------------ propose

    def _propose(self, reqs: list[SpecRequest]) -> None:
        """Ask the drafter for each decoding request's proposals (capped so no token is wasted)."""
        if self.drafter is None:
            return
        ks = [min(r.k, r.max_new_tokens - len(r.output_ids) - 1) for r in reqs]
        asking = [(r, k) for r, k in zip(reqs, ks) if k > 0]
        if not asking:
            return
        try:
            proposals = self.drafter.propose(*map(list, zip(*asking)))
        except Exception:  # find who: ask again one request at a time
            proposals = [self._propose_alone(req, k) for req, k in asking]
        for (req, _), (ids, probs) in zip(asking, proposals):
            req.draft, req.draft_probs = list(ids), probs

    def _propose_alone(self, req: SpecRequest, k: int):
        """One request's proposals; if its drafter fails, that request goes on without speculation
        (k = 0: plain decoding, still exact) instead of failing every step of the batch."""
        try:
            return self.drafter.propose([req], [k])[0]
        except Exception as exc:
            req.k = 0
            req.spec_error = f"the drafter failed, decoding on without speculation: {one_line(exc)}"
            self.spec.drafter_failures += 1
            self.drafter.release(req.request_id)
            return [], None

    # ------------------------------------------------------------------ verify

    def run_plan(self, plan):
        if plan:
            self.spec.forwards += 1
        return super().run_plan(plan)

    def sample(self, reqs, logits) -> list[int]:
        """Rows come per request: k + 1 for a verifying one (its tokens are settled here), else 1."""
        sizes = [1 + len(r.draft) for r in reqs]
        rows = torch.split(logits, sizes)
        plain = [i for i, r in enumerate(reqs) if not r.draft]
        drawn = dict(zip(plain, super().sample([reqs[i] for i in plain], [rows[i][0] for i in plain])))
        out = []
        for i, req in enumerate(reqs):
            if req.draft:
                self._verified[req.request_id] = self._verify_or_fail(req, rows[i])
                drawn[i] = self._verified[req.request_id][-1]
            out.append(drawn[i])
        return out

    def _verify_or_fail(self, req: SpecRequest, rows: torch.Tensor) -> list[int]:
        """`_verify`, or [-1] with `req.error` set if it fails for this request (e.g. NaN logits):
        like a failed draw in L8, the request alone finishes with finish_reason "error"."""
        try:
            return self._verify(req, rows)
        except Exception as exc:
            req.error = f"verifying its proposals failed: {one_line(exc)}"
            return [-1]

    def _verify(self, req: SpecRequest, rows: torch.Tensor) -> list[int]:
        """The ids this step produces for `req`: kept proposals, then the target's own next id."""
        if is_greedy(req.temperature):
            return accept_greedy(req.draft, rows.argmax(-1).tolist())
        probs = torch.softmax(rows.float() / req.temperature, dim=-1)
        draft_probs = None if req.draft_probs is None else req.draft_probs[:len(req.draft)]
        return accept_sampled(req.draft, draft_probs, probs, req.generator)

    # ------------------------------------------------------------------ commit and rewind

    def commit(self, plan, tokens) -> None:
        for req, _ in plan:
            if req.draft and req.error is not None:  # L5's commit finishes it; its draft has no K/V to keep
                self._verified.pop(req.request_id)
                req.draft, req.draft_probs = [], None
            elif req.draft:
                tokens[req.request_id] = self._settle(req, self._verified.pop(req.request_id))
            self.spec.token_steps += req.num_pending == 0
        super().commit(plan, tokens)  # L8 keys the blocks that are now full of accepted tokens
        for req, _ in plan:
            if req.state is State.FINISHED and self.drafter is not None:
                self.drafter.release(req.request_id)

    def _settle(self, req: SpecRequest, new_ids: list[int]) -> int:
        """Append all but the last of `new_ids` (cut at a stop), rewind, and return the last one,
        which L5's commit appends (and finishes on) like any sampled token."""
        proposed, kept = len(req.draft), len(new_ids) - 1
        new_ids = self._cut_at_finish(req, new_ids)
        req.output_ids += new_ids[:-1]
        req.draft, req.draft_probs = [], None
        self.rewind_kv(req, len(req.tokens))  # K/V of every kept token stays; the rest goes
        req.proposed, req.accepted = req.proposed + proposed, req.accepted + len(new_ids) - 1
        self.spec.verify_steps += 1
        self.spec.proposed += proposed
        self.spec.accepted += len(new_ids) - 1
        if self.adaptive_k:
            req.k = next_k(req.k, proposed, kept, self.k_max)
        return new_ids[-1]

    def rewind_kv(self, req: SpecRequest, new_len: int) -> None:
        """A hook: K/V past `new_len` dropped, blocks past it freed (L13: in every group of layers)."""
        rewind(req, self.alloc, new_len)

    def _cut_at_finish(self, req: SpecRequest, new_ids: list[int]) -> list[int]:
        """new_ids up to the first that would finish the request (stop id, eos or length)."""
        room = req.max_new_tokens - len(req.output_ids)
        for i, token in enumerate(new_ids[:room]):
            if token in self.eos_ids or token in req.stop_token_ids:
                return new_ids[:i + 1]
        return new_ids[:room]

    def abort(self, request_id: int) -> None:
        super().abort(request_id)
        if self.drafter is not None:
            self.drafter.release(request_id)

    # ------------------------------------------------------------------ rollback and counters

    def stateful(self) -> list:
        drafter = self.drafter.stateful() if self.drafter is not None else []
        return [*super().stateful(), self.spec, *drafter]

    def summary(self) -> dict:
        s = self.spec
        generated = sum(len(r.output_ids) for r in self.requests.values())
        return {**super().summary(), **asdict(s),
                "acceptance_rate": s.accepted / s.proposed if s.proposed else 0.0,
                "generated_tokens": generated,
                # Target forwards each token waited for: 1.0 for plain decoding, whatever the batch.
                "forwards_per_token": s.token_steps / generated if generated else 0.0,
                "draft_forwards": getattr(self.drafter, "forwards", 0)}


def make_spec_engine(model, num_blocks: int, block_size: int = 16, **kwargs) -> SpecEngine:
    return make_engine(model, num_blocks, block_size, engine_cls=SpecEngine, **kwargs)
