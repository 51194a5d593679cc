"""L10's student-written rules, each against an independent computation: the n-gram drafter against
a brute-force search, greedy acceptance against plain greedy, sampled acceptance against the
target's own distribution (a chi-square test), and rewind against the blocks a length needs."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from l2_paged import BlockAllocator, Request, blocks_needed, reserve
from l10_speculative import accept_greedy, accept_sampled, next_k, propose_ngram, rewind

pytestmark = pytest.mark.l10


# ---------------------------------------------------------------- propose_ngram (§ "Prompt lookup")

def brute_force_ngram(tokens, k, max_ngram):
    """Every candidate (n, start) listed, the largest n then the latest start chosen."""
    candidates = [(n, s) for n in range(1, max_ngram + 1) for s in range(len(tokens) - n)
                  if n < len(tokens) and tokens[s:s + n] == tokens[len(tokens) - n:] and s + n < len(tokens)]
    if not candidates:
        return []
    n, s = max(candidates)
    return tokens[s + n:s + n + k]


@pytest.mark.points(2)
def test_propose_ngram_continues_the_latest_longest_match():
    # "a b c d a b c" -> the suffix "a b c" occurred at 0, followed by "d a b"
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], k=3) == [4, 1, 2]
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], k=1) == [4]
    # two matches of the suffix "9 5": the later one (at 3) wins, it is followed by 7
    assert propose_ngram([9, 5, 6, 9, 5, 7, 9, 5], k=2, max_ngram=2) == [7, 9]
    assert propose_ngram([1, 2, 3], k=4) == []  # nothing repeats
    assert propose_ngram([5], k=4) == []
    assert propose_ngram([5, 5], k=4) == [5]  # the match may overlap the suffix's own tokens


@pytest.mark.points(2)
def test_propose_ngram_equals_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        k, max_ngram = rng.randrange(1, 9), rng.randrange(1, 5)
        assert propose_ngram(tokens, k, max_ngram) == brute_force_ngram(tokens, k, max_ngram), (tokens, k, max_ngram)


# ---------------------------------------------------------------- accept_greedy (§ "Acceptance")

@pytest.mark.points(1)
@pytest.mark.parametrize("draft, target, expected", [
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all kept, plus the bonus token
    ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # kept up to the first miss, then the target's own id
    ([5, 6, 7], [4, 6, 7, 8], [4]),  # first one wrong: a plain decode step
    ([], [3], [3]),  # no proposal: the step is a plain decode
])
def test_accept_greedy_keeps_the_matching_prefix_and_the_targets_next_id(draft, target, expected):
    assert accept_greedy(draft, target) == expected


# accept_greedy's contract against greedy decoding itself: most of its points.
@pytest.mark.points(4)
def test_accept_greedy_output_is_what_greedy_decoding_gives():
    """A deterministic 'model' (next id = f(previous id), a new random f each round): whatever is
    proposed, the kept ids are the next len(kept) ids of greedy decoding, and every proposal up to
    the first wrong one is kept. Drafts are greedy's own continuation with at most one id changed."""
    rng = random.Random(1)
    for _ in range(500):
        table = [rng.randrange(5) for _ in range(5)]  # next id after id i (fixed points included)
        last = rng.randrange(5)
        draft, t = [], last
        for _ in range(rng.randrange(0, 6)):
            t = table[t]
            draft.append(t)
        wrong = rng.randrange(len(draft) + 1)  # len(draft): no wrong proposal
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + rng.randrange(1, 5)) % 5
        sequence = [last] + draft
        target = [table[t] for t in sequence]  # the verify rows' argmax
        kept = accept_greedy(draft, target)
        expected, t = [], last
        for _ in kept:
            t = table[t]
            expected.append(t)
        assert kept == expected and len(kept) == min(wrong, len(draft)) + 1


# ---------------------------------------------------------------- accept_sampled (§ "Sampling")

def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.points(3)
@pytest.mark.parametrize("deterministic_drafter", [True, False])
def test_accept_sampled_gives_the_targets_distribution(deterministic_drafter):
    """Vocabulary 4, k = 2: the first two output ids must be distributed as p0 x p1 (the target's
    rows do not depend on the context here), whatever the drafter proposes. 6,000 runs; the chi-square
    bound 37.7 is the 0.1% tail of 15 degrees of freedom, so a correct rule fails 1 run in 1,000
    (the seed is fixed: it passes or fails the same way every time); proposing from q without the
    correction (accept everything) gives a statistic in the thousands."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]])
    counts = torch.zeros(4, 4)
    for _ in range(6000):
        if deterministic_drafter:
            draft, draft_probs = [0, 3], None  # e.g. prompt lookup: always the same guess
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            draft_probs = q
        out = accept_sampled(draft, draft_probs, p, gen)
        assert 1 <= len(out) <= 3 and out[:-1] == draft[:len(out) - 1]  # stops at the first rejection
        if len(out) == 1:  # the first proposal was rejected: its replacement, then a plain draw
            out = out + [int(torch.multinomial(p[1], 1, generator=gen))]
        counts[out[0], out[1]] += 1
    joint = (p[0][:, None] * p[1][None, :])
    assert chi_square(counts.flatten(), joint.flatten()) < 37.7


# Five settings (k, temperature, drafter); V = 3, so the first k + 1 ids fall in 3^(k+1) cells.
# Each run's first k + 1 ids (a run cut short by a rejection is completed with plain draws from
# the rows after it, which do not depend on the context here) must be distributed as
# p_0 x ... x p_k, the bonus id included. Chi-square at 0.025% per setting (0.125% for all five):
# critical values 29.59 / 58.70 / 131.57 for 8 / 26 / 80 degrees of freedom. A distribution
# 0.05 away in total variation has a noncentrality of at least N (2 x 0.05)^2 = 0.01 N, and with
# N = 12,500 the test rejects it with probability > 0.999 at every df (noncentral chi-square:
# 0.9992 at 80 df). The seed is fixed, so the verdict is the same on every run.
# Three of the five draw their proposals from q: with a deterministic drafter (q one-hot) the
# acceptance ratio p/q is p, so only these see a rule that forgets to divide by q.
SAMPLED_SETTINGS = [(1, 0.5, "deterministic"), (2, 1.0, "drafted"), (3, 2.0, "drafted"), (3, 1.0, "deterministic"),
                    (2, 0.7, "drafted")]
CRITICAL = {8: 29.59, 26: 58.70, 80: 131.57}
RUNS = 12_500


def _rows(k: int, temperature: float, seed: int) -> torch.Tensor:
    logits = torch.randn(k + 1, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.softmax(logits / temperature, dim=-1)


@pytest.mark.points(3)
@pytest.mark.parametrize("k,temperature,drafter", SAMPLED_SETTINGS)
def test_accept_sampled_gives_the_exact_joint_distribution_bonus_included(k, temperature, drafter):
    p = _rows(k, temperature, seed=10 + k).float()
    q = _rows(k - 1, 1.0, seed=20 + k).float()
    gen = torch.Generator().manual_seed(k)
    counts = torch.zeros(3 ** (k + 1))
    for _ in range(RUNS):
        if drafter == "deterministic":
            draft, draft_probs = [int(torch.randint(3, (), generator=gen)) for _ in range(k)], None
        else:
            draft, draft_probs = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)], q
        out = accept_sampled(draft, draft_probs, p, gen)
        assert 1 <= len(out) <= k + 1 and out[:-1] == draft[:len(out) - 1]  # stops at the first rejection
        while len(out) < k + 1:
            out.append(int(torch.multinomial(p[len(out)], 1, generator=gen)))
        cell = 0
        for token in out:
            cell = cell * 3 + token
        counts[cell] += 1
    joint = p[0]
    for row in p[1:]:
        joint = (joint[:, None] * row[None, :]).flatten()
    statistic = chi_square(counts, joint)
    assert statistic < CRITICAL[3 ** (k + 1) - 1], f"chi-square {statistic:.1f} over {3 ** (k + 1)} cells"


@pytest.mark.points(1)
def test_accept_sampled_keeps_a_proposal_the_target_is_sure_of():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert accept_sampled([1, 2], None, p, torch.Generator().manual_seed(0)) == [1, 2, 0]
    assert accept_sampled([0, 2], None, p, torch.Generator().manual_seed(0)) == [1]  # p(0) = 0: rejected


# ---------------------------------------------------------------- rewind (§ "Rewind")

@pytest.mark.points(2)
@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_rewind_keeps_exactly_the_blocks_of_the_new_length(block_size):
    for start, new_len in itertools.product(range(1, 20), range(0, 20)):
        if new_len > start:
            continue
        alloc = BlockAllocator(32, block_size)
        req = Request([1] * start)
        reserve(req, alloc, start)
        req.cur_len = start
        blocks_before = list(req.blocks)
        rewind(req, alloc, new_len)
        keep = blocks_needed(new_len, block_size)
        assert req.cur_len == new_len
        assert req.blocks == blocks_before[:keep]
        assert req.slot_indices == [b * block_size + i for b in req.blocks for i in range(block_size)]
        assert alloc.num_free == alloc.num_blocks - keep, "the blocks past the new end go back to the pool"


@pytest.mark.points(1)
def test_rewind_refuses_to_move_forward_and_changes_nothing_then():
    alloc = BlockAllocator(4, 4)
    req = Request([1] * 6)
    reserve(req, alloc, 6)
    req.cur_len = 6
    with pytest.raises(ValueError, match="only moves back"):
        rewind(req, alloc, 7)
    assert req.cur_len == 6 and len(req.blocks) == 2 and alloc.num_free == 2
    rewind(req, alloc, 4)  # to a block boundary: the second block goes back
    assert req.cur_len == 4 and len(req.blocks) == 1 and alloc.num_free == 3


# ---------------------------------------------------------------- provided: the adaptive k rule

@pytest.mark.parametrize("k, proposed, accepted, expected", [
    (4, 4, 4, 5), (8, 8, 8, 8), (4, 4, 2, 4), (4, 4, 0, 2), (1, 1, 0, 1), (3, 0, 0, 3)])
def test_next_k_grows_on_full_acceptance_and_halves_on_none(k, proposed, accepted, expected):
    assert next_k(k, proposed, accepted, k_max=8) == expected
