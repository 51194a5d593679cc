"""Which proposed tokens the target keeps: greedy (exact) and sampled (rejection sampling).

    proposals        d1   d2   d3   d4          (k = 4, from a drafter)
    verify rows  r0   r1   r2   r3   r4         (the target's logits at the k + 1 positions)
    greedy       g0   g1   g2   g3   g4         g_i = argmax r_i
    d1 == g0, d2 == g1, d3 != g2  ──►  keep d1 d2, then the target's own g2 (the "bonus" token)

Greedy acceptance keeps exactly the tokens plain greedy decoding would have produced, so the ids
equal HF's. Sampled acceptance keeps each proposal with probability min(1, p/q) and, at the first
rejection, draws from the leftover mass (p - q)+: the output has exactly the target's distribution.
"""

from __future__ import annotations

import torch


def accept_greedy(draft: list[int], target_ids: list[int]) -> list[int]:
    """The longest prefix of `draft` equal to the target's greedy ids, then the target's next id.

    draft: k proposed ids; target_ids: k + 1 ids, the argmax of each verify row.
    Returns between 1 and k + 1 ids, all of them the ones plain greedy decoding would produce.
    """
    # BEGIN SOLUTION
    j = 0
    while j < len(draft) and draft[j] == target_ids[j]:
        j += 1
    return draft[:j] + [target_ids[j]]
    # END SOLUTION


def accept_sampled(draft: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> list[int]:
    """Rejection sampling: the returned ids are distributed as if drawn from `target_probs` one by one.

    draft_probs [k, V]: the drafter's distribution at each proposal (None: the drafter is
    deterministic, e.g. prompt lookup, so q is 1 at the proposed id). target_probs [k + 1, V].
    Proposal i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
    replacement is drawn from max(0, p_i - q_i), renormalized; if all are kept, one more id is drawn
    from p_k.
    """
    # BEGIN SOLUTION
    out = []
    for i, d in enumerate(draft):
        q = _proposal_dist(draft_probs, i, d, target_probs.size(-1), target_probs.device)
        u = torch.rand((), generator=generator, device=target_probs.device)
        if u * q[d] <= target_probs[i, d]:  # u < p/q without dividing by a q of 0
            out.append(d)
            continue
        leftover = (target_probs[i] - q).clamp(min=0)
        out.append(_draw(leftover, generator))
        return out
    out.append(_draw(target_probs[len(draft)], generator))
    return out
    # END SOLUTION


def _proposal_dist(draft_probs, i: int, d: int, vocab: int, device) -> torch.Tensor:
    """q_i as a [V] tensor: the drafter's row, or all mass on d for a deterministic drafter."""
    if draft_probs is not None:
        return draft_probs[i]
    q = torch.zeros(vocab, device=device)
    q[d] = 1.0
    return q


def _draw(weights: torch.Tensor, generator) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))


def next_k(k: int, proposed: int, accepted: int, k_max: int) -> int:
    """Adapt a request's k from its last verify: one more after full acceptance, halved after none.

    Additive increase, multiplicative decrease (TCP's rule): a request in a repetitive passage climbs
    to k_max one step at a time, and one that keeps missing stops paying for k wasted rows quickly.
    A drafter that proposed nothing leaves k as it was.
    """
    if proposed == 0:
        return k
    if accepted == proposed:
        return min(k + 1, k_max)
    if accepted == 0:
        return max(1, k // 2)
    return k
