"""L10 with temperature > 0: speculation must not change the distribution of what is sampled.

On a random model with a vocabulary of 8, 1,500 samples of one prompt (n = 1500, temperature 1)
are drawn with speculation; the second and third generated ids (the first comes from the prefill,
the next ones go through proposals and rejection sampling) must follow the distributions computed
exactly from HF's logits (a sum over the 8 or 64 paths before them). Chi-square, 7 degrees of
freedom, bound 24.3 = the 0.1% tail: a correct engine fails about 1 run in 1,000 (the seeds are
fixed, so it passes or fails the same way every time); keeping every proposal fails by far."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from harness import hf_reference as hf
from l5_eviction import load_engine_model
from l8_prefix import SampledWorkItem
from l10_speculative import DraftModelDrafter, PromptLookupDrafter, make_spec_engine

pytestmark = [pytest.mark.l10, pytest.mark.usefixtures("one_torch_thread")]

SMALL_VOCAB = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: prompt lookup always has something to propose
SAMPLES = 1500
BOUND = 24.3


@pytest.fixture(scope="module")
def small_vocab_dir(make_model):
    return make_model(seed=3, vocab_size=SMALL_VOCAB, init_std=0.06)


def next_probs(hf_model, ids):
    return torch.softmax(hf.hf_logits(hf_model, ids)[-1].double(), -1)


def exact_marginals(model_dir):
    """P(2nd id) and P(3rd id), summed over the paths before them."""
    hf_model = hf.load_hf_model(str(model_dir))
    p1 = next_probs(hf_model, PROMPT)
    second, third = torch.zeros(SMALL_VOCAB, dtype=torch.float64), torch.zeros(SMALL_VOCAB, dtype=torch.float64)
    for a in range(SMALL_VOCAB):
        p2 = next_probs(hf_model, PROMPT + [a])
        second += p1[a] * p2
        for b in range(SMALL_VOCAB):
            third += p1[a] * p2[b] * next_probs(hf_model, PROMPT + [a, b])
    return second, third


def chi_square(ids, probs) -> float:
    counts = Counter(ids)
    expected = probs * len(ids)
    return float(sum((counts.get(i, 0) - expected[i]) ** 2 / expected[i] for i in range(SMALL_VOCAB)))


@pytest.mark.parametrize("drafter_kind", ["prompt-lookup", "draft-model"])
def test_speculative_sampling_keeps_the_distribution(small_vocab_dir, make_model, drafter_kind):
    model = load_engine_model(small_vocab_dir)
    if drafter_kind == "prompt-lookup":
        drafter = PromptLookupDrafter()
    else:  # another random model of the same vocabulary: its q differs from the target's p
        draft = load_engine_model(make_model(seed=4, vocab_size=SMALL_VOCAB, init_std=0.06))
        drafter = DraftModelDrafter(draft, num_blocks=SAMPLES + 8, block_size=16)
    engine = make_spec_engine(model, SAMPLES + 8, 16, drafter=drafter, k=3, adaptive_k=False)
    engine.run([SampledWorkItem(PROMPT, 4, n=SAMPLES, temperature=1.0, seed=7)])
    outputs = [r.output_ids for r in engine.requests.values()]
    assert len(outputs) == SAMPLES and engine.spec.proposed > SAMPLES, "speculation ran"
    assert 0 < engine.spec.accepted < engine.spec.proposed
    second, third = exact_marginals(small_vocab_dir)
    assert chi_square([o[1] for o in outputs], second) < BOUND
    assert chi_square([o[2] for o in outputs], third) < BOUND
