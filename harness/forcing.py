"""Teacher forcing: run a lesson's engine again with every request made to follow a given path of
token ids (HF's greedy ids), and record the logits our model computed at every generated position.

Why: in bfloat16 two correct implementations can pick different tokens where HF's top two logits
nearly tie; after that the two sequences differ and comparing ids says nothing more. Fed HF's ids,
our engine is back on HF's sequence and its logits can be compared with HF's at every position,
so a bug after the first near-tie cannot hide behind it (the rule is in `harness/compare.py`).

How: while `forcing(paths)` is active, every `PagedRunner.forward_logits` (L2's runner, and so
every later runner and engine, which all compute logits through it) records the rows it returns
and hands its caller, in their place, rows whose argmax (and softmax) is the forced id. Nothing else in the
lesson changes: the same scheduler, pool, preemptions, prefix hits, forks and rewinds run, on the
forced sequence. L1, which has no runner, is forced by `force_contiguous`.

    forward_logits rows for request r (prompt length P, cur_len c before the step, n new tokens):
        positions c .. c+n-1; the last `rows_r` of them return a row; the row at position p
        predicts sequence index p + 1, i.e. generated index g = p + 1 - P.
        g in 0..len(path)-1: recorded, then replaced by a one-hot row at path[g].
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch


class ForcedPaths:
    """The paths to force (prompt ids -> generated ids) and what our model computed along them."""

    def __init__(self, paths: dict[tuple[int, ...], list[int]]):
        self.paths = {tuple(k): list(v) for k, v in paths.items()}
        # prompt -> generated index -> every row computed there (recomputes and samples add rows)
        self.rows: dict[tuple[int, ...], dict[int, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))

    def record_and_force(self, prompt: tuple[int, ...], tokens: list[int], first_position: int,
                         rows: torch.Tensor) -> torch.Tensor:
        """rows: [k, vocab], the logits at positions first_position .. first_position + k - 1 of
        `tokens` (the request's sequence as fed, L10's proposals included). A row is on the path
        when every generated id it saw is the path's; the others (after a proposal the path does
        not take) are left alone: nothing reads them."""
        path = self.paths.get(prompt)
        if path is None:
            return rows
        out = rows.clone()
        for i in range(rows.shape[0]):
            g = first_position + i + 1 - len(prompt)
            if 0 <= g < len(path) and list(tokens[len(prompt):len(prompt) + g]) == path[:g]:
                self.rows[prompt][g].append(rows[i].float().cpu())
                out[i] = -1e4  # finite (NaN checks pass), and softmax of it is exactly one-hot
                out[i, path[g]] = 0
        return out

    def logits(self, prompt_ids: list[int]) -> list[list[torch.Tensor]]:
        """For each generated index of the prompt's path, every row our model computed there."""
        recorded = self.rows[tuple(prompt_ids)]
        return [recorded.get(g, []) for g in range(len(self.paths[tuple(prompt_ids)]))]


def _rows_per_request(reqs, total_rows: int) -> list[int]:
    """One row per request, except L10's verifying requests: one per proposal, plus one."""
    if total_rows == len(reqs):
        return [1] * len(reqs)
    sizes = [1 + len(getattr(r, "draft", None) or ()) for r in reqs]
    if sum(sizes) != total_rows:
        raise RuntimeError(f"teacher forcing: {total_rows} logit rows for {len(reqs)} requests, "
                           f"expected {sum(sizes)}")
    return sizes


@contextlib.contextmanager
def forcing(paths: ForcedPaths):
    """Within the block, every runner's logits follow `paths` (see the module docstring)."""
    from l2_paged.runner import PagedRunner

    original = PagedRunner.forward_logits

    def forced_forward_logits(self, reqs, num_new):
        before = [r.cur_len for r in reqs]
        logits = original(self, reqs, num_new)
        sizes = _rows_per_request(reqs, logits.shape[0])
        pieces, start = [], 0
        for req, c, n, k in zip(reqs, before, num_new, sizes):
            first = c + n - k
            pieces.append(paths.record_and_force(tuple(req.prompt_ids), req.tokens, first, logits[start:start + k]))
            start += k
        return torch.cat(pieces) if pieces else logits

    PagedRunner.forward_logits = forced_forward_logits
    try:
        yield paths
    finally:
        PagedRunner.forward_logits = original


@torch.inference_mode()
def force_contiguous(model, prompt_ids: list[int], path: list[int]) -> list[torch.Tensor]:
    """L1: prefill the prompt into a contiguous cache, then feed `path` one id at a time, as
    `greedy_generate` does; the logits row that chose each generated index, [vocab] each."""
    from l1_contiguous.cache import ContiguousKvCache
    from l1_contiguous.generate import forward_step

    cache = ContiguousKvCache(model.config, len(prompt_ids) + len(path), model.dtype, model.device)
    rows = [forward_step(model, cache, prompt_ids, last_only=True)[0].float().cpu()]
    for token in path[:-1]:
        rows.append(forward_step(model, cache, [token])[0].float().cpu())
    return rows
