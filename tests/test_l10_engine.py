"""L10 through the engine on random tiny models: whatever is proposed, every request ends with the
ids HF's greedy decoding gives its prompt alone, for every k, block size, sharing on and off, n > 1,
a pool that preempts, both drafters and held-out model shapes; after every step the pool's
accounting holds, no request holds a block past its accepted tokens, and no block with an
unaccepted token is keyed. Speculation is provided engine code built on the student's rules
(graded in test_l10_acceptance.py): no points here."""

from __future__ import annotations

import pytest

from helpers import budget, random_prompt
from l5_eviction import State, load_engine_model
from l8_prefix import SampledWorkItem
from l10_speculative import DraftModelDrafter, PromptLookupDrafter, make_spec_engine
from test_l8_engine import PREFIX, VOCAB, check_all_released, check_invariants, guard_writes, hf_ref, tail  # noqa: F401

pytestmark = [pytest.mark.l10, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_engine_model(tiny_model_dir)


class OracleDrafter:
    """Proposes HF's own continuation, wrong at every position p with p % wrong_every == 1: every
    number of accepted proposals, 0 to k, happens, and which happen does not depend on the batch."""

    name = "oracle"

    def __init__(self, hf_ref, max_new: int, wrong_every: int = 3):
        self.hf_ref, self.max_new, self.wrong_every = hf_ref, max_new, wrong_every

    def propose(self, reqs, ks):
        out = []
        for req, k in zip(reqs, ks):
            truth, start = self.hf_ref(req.prompt_ids, self.max_new), len(req.output_ids)
            out.append(([t if (start + i) % self.wrong_every != 1 else (t + 1) % VOCAB
                         for i, t in enumerate(truth[start:start + k])], None))
        return out

    def release(self, request_id):
        pass

    def stateful(self):
        return []


def make(model, drafter, num_blocks=64, block_size=4, **kwargs):
    engine = make_spec_engine(model, num_blocks, block_size, drafter=drafter, **kwargs)
    guard_writes(engine)  # no K/V (speculative or not) is ever written into a block another table holds
    watch_keys(engine)
    return engine


def watch_keys(engine) -> None:
    """Every block keyed must hold only accepted tokens: no proposal pending, fully under cur_len."""
    real, alloc = engine.alloc.register, engine.alloc

    def register(block, key):
        (req,) = [r for r in engine.requests.values() if block in r.blocks and r.state is State.RUNNING][:1]
        i = req.blocks.index(block)
        assert not req.draft, f"block {block} keyed while request {req.request_id} still has proposals"
        assert (i + 1) * alloc.block_size <= req.cur_len, (
            f"block {block} keyed with tokens past request {req.request_id}'s accepted end {req.cur_len}")
        return real(block, key)

    engine.alloc.register = register


def check_spec_invariants(engine) -> None:
    check_invariants(engine)  # L8's: one place per block, ref counts = tables, blocks = ceil(cur_len / bs)
    for r in engine.requests.values():
        assert not r.draft and r.draft_probs is None, f"request {r.request_id} kept proposals past its step"
        if r.state is State.RUNNING:
            assert r.cur_len <= len(r.tokens), "K/V for more tokens than the request has"
    drafter = engine.drafter
    if isinstance(drafter, DraftModelDrafter):
        bs, owned = drafter.alloc.block_size, 0
        for seq in drafter.seqs.values():
            assert len(seq.blocks) == -(-seq.cur_len // bs) or len(seq.blocks) == -(-len(seq.tokens) // bs)
            owned += len(seq.blocks)
        assert owned == drafter.alloc.num_used, "the draft's pool leaks blocks"


def run_checked(engine, items, max_steps=400) -> dict:
    for item in items:
        engine.add_request(item)
    while engine.has_unfinished():
        assert engine.now < max_steps, "workload not finished"
        engine.step()
        check_spec_invariants(engine)
    check_all_released(engine)
    return engine.requests


def assert_hf(requests, hf_ref) -> None:
    for r in requests.values():
        assert r.output_ids == hf_ref(r.prompt_ids, r.max_new_tokens), (r.request_id, r.sample_index)


PROMPTS = [PREFIX + tail(6), PREFIX + tail(3), random_prompt(9, VOCAB, seed=7)]


@pytest.mark.parametrize("k", range(1, 9))
def test_ids_equal_hf_for_every_k(model, hf_ref, k):
    engine = make(model, OracleDrafter(hf_ref, 14), k=k, adaptive_k=False, block_size=8)
    requests = run_checked(engine, [SampledWorkItem(p, 14) for p in PROMPTS])
    assert_hf(requests, hf_ref)
    s = engine.spec
    assert 0 < s.accepted < s.proposed, "both kept and rejected proposals were exercised"
    assert engine.summary()["forwards_per_token"] < 1 or k == 1


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("sharing", [True, False])
def test_block_sizes_sharing_and_samples(model, hf_ref, block_size, sharing):
    items = [SampledWorkItem(PROMPTS[0], 40, n=2), SampledWorkItem(PROMPTS[1], 40, arrival_step=1),
             SampledWorkItem(PROMPTS[2], 40, arrival_step=2)]
    engine = make(model, OracleDrafter(hf_ref, 40), block_size=block_size, prefix_sharing=sharing)
    requests = run_checked(engine, items)
    assert len(requests) == 4
    assert_hf(requests, hf_ref)
    if sharing:
        assert engine.prefix.fork_shared_tokens > 0


def test_a_shared_partial_block_is_copied_before_a_speculative_write(model, hf_ref):
    """n = 3 samples share the prompt's partial last block; each writer's first verify (k + 1 rows
    into that block) must copy it first (guard_writes asserts no write into a shared block)."""
    engine = make(model, OracleDrafter(hf_ref, 12, wrong_every=100), block_size=8, k=4)
    requests = run_checked(engine, [SampledWorkItem(PROMPTS[1], 12, n=3)])  # 25 tokens: 1 into the 4th block
    assert_hf(requests, hf_ref)
    assert engine.prefix.cow_copies == 2 and engine.spec.accepted > 0


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_a_small_pool_preempts_and_ids_still_equal_hf(model, hf_ref, preempt):
    prompts = [random_prompt(6 + 3 * i, VOCAB, seed=50 + i) for i in range(budget(8, 5))]
    engine = make(model, OracleDrafter(hf_ref, 24), num_blocks=16, preempt=preempt)
    requests = run_checked(engine, [SampledWorkItem(p, 24) for p in prompts])
    assert_hf(requests, hf_ref)
    counters = engine.preemptor.counters
    assert counters.preempted_recompute + counters.preempted_swap > 0, "the pool was meant to run out"


def test_prompt_lookup_on_a_repetitive_prompt(model, hf_ref):
    loop = random_prompt(7, VOCAB, seed=11)
    prompts = [loop * 4, loop * 2 + random_prompt(5, VOCAB, seed=12)]
    engine = make(model, PromptLookupDrafter(), k=5)
    requests = run_checked(engine, [SampledWorkItem(p, 20) for p in prompts])
    assert_hf(requests, hf_ref)
    assert engine.spec.proposed > 0


@pytest.mark.parametrize("draft_seed", [None, 1])  # None: the target drafts for itself (all kept)
def test_draft_model_drafter(model, make_model, hf_ref, draft_seed):
    draft = model if draft_seed is None else load_engine_model(make_model(seed=draft_seed))
    drafter = DraftModelDrafter(draft, num_blocks=64, block_size=4)
    engine = make(model, drafter, k=3, adaptive_k=False)
    requests = run_checked(engine, [SampledWorkItem(p, 16) for p in PROMPTS])
    assert_hf(requests, hf_ref)
    assert not drafter.seqs and drafter.alloc.num_free == drafter.alloc.num_blocks, "draft cache released"
    if draft_seed is None:  # every proposal kept, except those past max_new_tokens (never asked)
        assert engine.spec.accepted == engine.spec.proposed > 0
        assert drafter.forwards < 3 * engine.spec.forwards


@pytest.mark.parametrize("overrides", [
    dict(seed=21, num_hidden_layers=3, num_key_value_heads=1, head_dim=32),
    dict(seed=22, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16),
])
def test_held_out_model_shapes(make_model, overrides):
    model_dir = make_model(**overrides)
    from harness import hf_reference as hf

    hf_model = hf.load_hf_model(str(model_dir))
    model = load_engine_model(model_dir)
    prompts = [random_prompt(5, VOCAB, seed=31) * 3, random_prompt(13, VOCAB, seed=32)]

    def ref(prompt, n):
        return hf.hf_greedy(hf_model, list(prompt), n)

    engine = make(model, OracleDrafter(ref, 18), k=4, block_size=8)
    requests = run_checked(engine, [SampledWorkItem(p, 18) for p in prompts])
    assert_hf(requests, ref)


def test_aborting_mid_speculation_releases_everything(model, hf_ref):
    drafter = DraftModelDrafter(model, num_blocks=32, block_size=4)
    engine = make(model, drafter, k=4)
    a = engine.add_request(SampledWorkItem(PROMPTS[0], 30))
    b = engine.add_request(SampledWorkItem(PROMPTS[2], 30))
    for _ in range(4):
        engine.step()
        check_spec_invariants(engine)
    engine.abort(a.request_id)
    check_spec_invariants(engine)
    assert a.request_id not in drafter.seqs
    run_checked(engine, [])
    assert b.output_ids == hf_ref(PROMPTS[2], 30)
    assert drafter.alloc.num_free == drafter.alloc.num_blocks


# ---------------------------------------------------------------- a step stays all or nothing

INTERRUPT_POINTS = {  # name: (object of the engine, method, after its work?)
    "drafter proposed": (lambda e: e.drafter, "propose", True),
    "verify forward done": (lambda e: e.runner, "forward_logits", True),
    "acceptance": (lambda e: e, "_verify", True),
    "rewound, not yet committed": (lambda e: e, "_settle", True),
    "keying after a rewind": (lambda e: e.kv, "after_forward", False),
}


@pytest.mark.parametrize("point", INTERRUPT_POINTS)
def test_an_interrupted_speculative_step_rolls_back(model, hf_ref, monkeypatch, point):
    from test_step_atomicity import Trigger, interrupt, run_interrupted

    drafter = DraftModelDrafter(model, num_blocks=24, block_size=4)
    engine = make(model, drafter, k=4, num_blocks=14)
    for item in [SampledWorkItem(PROMPTS[0], 20, n=2), SampledWorkItem(PROMPTS[2], 20)]:
        engine.add_request(item)
    target, name, after = INTERRUPT_POINTS[point]
    trigger = Trigger(engine, at=3)
    interrupt(monkeypatch, target(engine), name, trigger, after=after)
    run_interrupted(engine, trigger, check_spec_invariants, monkeypatch)
    check_all_released(engine)
    assert_hf(engine.requests, hf_ref)
    assert drafter.alloc.num_free == drafter.alloc.num_blocks


@pytest.mark.parametrize("k", [-1, 17, 2.5, True])
def test_a_bad_k_is_refused_with_a_clear_error(model, k):
    from l1_contiguous import InputError

    with pytest.raises(InputError, match="k \\(proposals per step\\) must be an int in 0..16"):
        make_spec_engine(model, 8, 4, drafter=PromptLookupDrafter(), k=k)


def test_a_stop_id_among_the_kept_proposals_ends_the_request_there(model, hf_ref):
    """The oracle proposes HF's own ids, so the stop id arrives in the middle of a kept run."""
    reference = hf_ref(PROMPTS[2], 20)
    stop = reference[6]
    first = reference.index(stop)  # it may occur earlier than index 6
    engine = make(model, OracleDrafter(hf_ref, 20, wrong_every=100), k=8, adaptive_k=False)
    requests = run_checked(engine, [SampledWorkItem(PROMPTS[2], 20, stop_token_ids=(stop,))])
    assert requests[0].output_ids == reference[:first + 1] and requests[0].finish_reason == "stop"


def test_a_request_whose_verify_fails_ends_alone_and_the_others_go_on(model, hf_ref, monkeypatch):
    """Acceptance raising for one request (as NaN logits make multinomial raise) ends that request
    with finish_reason "error"; the greedy request verified in the same steps still equals HF."""
    import l10_speculative.engine as spec_engine

    def accept_sampled(*args):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    monkeypatch.setattr(spec_engine, "accept_sampled", accept_sampled)
    engine = make(model, OracleDrafter(hf_ref, 16), k=4, adaptive_k=False)
    requests = run_checked(engine, [SampledWorkItem(PROMPTS[2], 16),
                                    SampledWorkItem(PROMPTS[1], 16, temperature=0.8, seed=3)])
    good, bad = requests[0], requests[1]
    assert good.output_ids == hf_ref(PROMPTS[2], 16) and good.finish_reason == "length"
    assert bad.finish_reason == "error" and "verifying its proposals failed" in bad.error
    assert len(bad.output_ids) == 1  # its first token came from the prefill's plain draw


def test_a_draft_model_of_another_vocabulary_fails_only_speculation(model, make_model, hf_ref):
    """Built directly (not through DraftModelDrafter.load, which refuses it): every proposal raises
    (ids past its embedding). Each request goes on without speculation and still equals HF; the
    step is not failed and rolled back forever."""
    small = load_engine_model(make_model(seed=5, vocab_size=128))
    drafter = DraftModelDrafter(small, num_blocks=64, block_size=4)
    engine = make(model, drafter, k=3, adaptive_k=False)
    requests = run_checked(engine, [SampledWorkItem(p, 12) for p in PROMPTS])
    assert_hf(requests, hf_ref)
    assert engine.spec.drafter_failures >= 1 and engine.spec.proposed == 0
    assert all(r.k == 0 for r in requests.values() if r.spec_error)
    assert not drafter.seqs and drafter.alloc.num_free == drafter.alloc.num_blocks


def test_one_requests_drafter_failure_leaves_the_others_speculating(model, hf_ref):
    class FailsForOne(OracleDrafter):
        def propose(self, reqs, ks):
            if any(r.prompt_ids == PROMPTS[1] for r in reqs):
                raise ValueError("cannot draft for this prompt")
            return super().propose(reqs, ks)

    engine = make(model, FailsForOne(hf_ref, 14), k=4, adaptive_k=False)
    requests = run_checked(engine, [SampledWorkItem(p, 14) for p in PROMPTS])
    assert_hf(requests, hf_ref)
    failed = [r for r in requests.values() if r.spec_error]
    assert [r.prompt_ids for r in failed] == [PROMPTS[1]] and "cannot draft" in failed[0].spec_error
    assert all(r.accepted > 0 for r in requests.values() if not r.spec_error)
