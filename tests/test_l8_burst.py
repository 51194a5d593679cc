"""L8: requests that arrive together share their common prefix (in-batch prefix sharing).

A waiting request whose first uncached full block is being computed by a running request is held
until that block is keyed, at most `max_prefix_hold` steps; a request whose prefix nobody else is
computing is never held. Checked: the prefill tokens a burst computes, the holds in the timeline,
the bound, and the ids (sharing on = sharing off = HF) under bursts, eviction and n > 1.
"""

from __future__ import annotations

import random

import pytest

from harness import hf_reference as hf
from helpers import budget
from l5_eviction import DEFAULT_PREFILL_CHUNK, WorkItem, load_engine_model
from l8_prefix import SampledWorkItem, chain_keys, make_prefix_engine
from l8_prefix import PrefixRequest
from test_l8_engine import PREFIX, by_sample, check_all_released, check_invariants, guard_writes, run_checked, tail
from test_l8_engine import hf_ref, model  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.l8, pytest.mark.usefixtures("one_torch_thread")]


def burst(prefix: list[int], tails: list[list[int]], max_new: int, **extra) -> list[WorkItem]:
    return [SampledWorkItem(prefix + t, max_new, arrival_step=0, **extra) for t in tails]


def run_watching_holds(engine, items=(), max_steps: int = 400) -> dict:
    """Run to the end checking the invariants, and after every step that each request held this
    step really had its next block in flight, and that nobody was held past the bound."""
    for item in items:
        engine.add_request(item)
    while engine.has_unfinished():
        assert engine.now < max_steps, "the workload does not finish"
        running_before = [r for r in engine.scheduler.running]
        engine.step()
        check_invariants(engine)
        check_holds(engine, running_before)
    check_all_released(engine)
    return engine.requests


def check_holds(engine, running_before) -> None:
    """Independently of the scheduler: a held request shares its next block with a running one."""
    bs = engine.alloc.block_size
    held = engine.scheduler.held_now
    assert engine.metrics_timeline[-1]["held_for_prefix"] == len(held)
    for i in held:
        r = engine.requests[i]
        assert 1 <= r.held_steps <= engine.max_prefix_hold, (i, r.held_steps)
        keys = chain_keys(r.tokens[:-1], bs)
        # the first block it misses now is one that a request running (before or after this step's
        # admissions) has in its prompt and had not keyed when the step began
        computing = [o for o in engine.scheduler.running if o.request_id != i]
        assert any(k in o.prompt_keys for o in computing for k in keys), f"request {i} held, shares nothing"
    for r in engine.requests.values():
        assert r.held_steps <= engine.max_prefix_hold


# ---------------------------------------------------------------- the burst of the issue, embedded model

@pytest.fixture(scope="module")
def embedded(embedded_model_dir):
    return load_engine_model(embedded_model_dir), hf.load_hf_model(str(embedded_model_dir))


@pytest.mark.points(4)
def test_a_burst_computes_the_shared_prefix_once_with_the_ids_of_sharing_off_and_hf(embedded):
    """32 requests (16 in the fast loop), a 256-token common prefix, 32-token tails, all in step 0,
    no prefill cap (the hardest case: everyone fits in step 0): at most 256 + 32 n + 32 prompt
    tokens computed, where without holding each would compute the prefix. (Other budgets: the
    tiny-model test.)"""
    ours, theirs = embedded
    n = budget(32, 16)
    rng = random.Random(1)
    vocab = ours.config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(256)]
    items = burst(prefix, [[rng.randrange(vocab) for _ in range(32)] for _ in range(n)], 4)
    engine = make_prefix_engine(ours, 700, 16, prefill_chunk=None)
    on = by_sample(run_watching_holds(engine, items))
    m = engine.metrics()
    assert m["prefill_tokens_computed"] <= 256 + 32 * n + 32, m["prefill_tokens_computed"]
    assert m["prefix_hit_tokens"] == (n - 1) * 256
    assert engine.metrics_timeline[0]["held_for_prefix"] == n - 1  # step 0: the first computes, the rest wait
    assert [m["step"] for m in engine.metrics_timeline] == [r.step for r in engine.timeline]  # one per step, same step
    assert m["held_for_prefix_total"] == n - 1 and max(r.held_steps for r in engine.requests.values()) == 1
    off_engine = make_prefix_engine(ours, 700, 16, prefix_sharing=False)  # default chunk: no 9k-token forward
    off = by_sample(off_engine.run(items))
    assert off_engine.metrics()["prefill_tokens_computed"] == n * 288
    assert on == off
    for (prompt, _), ids in on.items():
        assert ids == hf.hf_greedy(theirs, list(prompt), 4)


# ---------------------------------------------------------------- the rules, on the tiny random model

P = PREFIX + tail(2)  # 24 tokens: 6 full blocks of 4
TAILS = [tail(k) for k in (3, 5, 9, 11)]  # HF top-2 gaps above 5e-3 (hf_ref checks)


def make(model, num_blocks: int = 64, **kwargs):
    engine = make_prefix_engine(model, num_blocks, 4, **kwargs)
    guard_writes(engine)
    return engine


@pytest.mark.points(3)
@pytest.mark.parametrize("prefill_chunk", [None, 4096, DEFAULT_PREFILL_CHUNK])
def test_requests_arriving_together_compute_their_common_blocks_once(model, hf_ref, prefill_chunk):
    items = burst(P, TAILS, 5)
    engine = make(model, prefill_chunk=prefill_chunk)
    on = by_sample(run_watching_holds(engine, items))
    m = engine.metrics()
    # the first computes everything; the others only the tokens after the 6 shared blocks
    assert m["prefill_tokens_computed"] == len(P) + sum(len(t) for t in TAILS)
    assert engine.metrics_timeline[0]["held_for_prefix"] == 3
    off = by_sample(make(model, prefill_chunk=prefill_chunk, prefix_sharing=False).run(items))
    assert on == off
    for (prompt, _), ids in on.items():
        assert ids == hf_ref(prompt, 5)


# PrefixKvManager.prefix_in_flight's contract (§2.10) called directly: most of its points.
@pytest.mark.points(4)
def test_prefix_in_flight_asks_only_about_the_first_block_that_is_not_cached(model):
    engine = make(model)
    prompt = P + tail(6)
    run_checked(engine, [WorkItem(prompt[:13], 2)])  # caches the prompt's first 3 blocks
    keys, alloc = chain_keys(prompt[:-1], 4), engine.alloc
    assert len(alloc.lookup(keys)) == 3 and len(keys) > 5
    last_block = chain_keys(prompt[:16], 4)[3]  # holds the last token of prompt[:16]: never a hit
    cases = [(prompt, {keys[3]}, True), (prompt, {keys[3], keys[5]}, True), (prompt, {keys[4], keys[5]}, False),
             (prompt, {keys[0], keys[1]}, False), (prompt, set(), False), (prompt[:13], {keys[3]}, False),
             (prompt[:16], {last_block}, False), (prompt[:3], {keys[0]}, False)]
    for rid, (tokens, in_flight, expected) in enumerate(cases, start=100):
        refs = list(alloc.ref_count)
        req = PrefixRequest(list(tokens), 3, request_id=rid)
        assert engine.kv.prefix_in_flight(req, set(in_flight)) is expected, (len(tokens), rid)
        assert list(alloc.ref_count) == refs and req.blocks == [] and req.cur_len == 0


@pytest.mark.points(2)
def test_a_request_whose_prefix_nobody_computes_is_never_held(model, hf_ref):
    """Two groups and two loners in one burst: only the second member of each group waits."""
    other = tail(11) + tail(1)  # another 12-token prefix
    items = [WorkItem(P + TAILS[0], 5), WorkItem(tail(6), 5), WorkItem(other + tail(3), 5),
             WorkItem(P + TAILS[1], 5), WorkItem(tail(9) + tail(5), 5), WorkItem(other + tail(5), 5)]
    engine = make(model)
    for item in items:
        engine.add_request(item)
    engine.step()
    assert engine.scheduler.held_now == [3, 5]
    assert [r.request_id for r in engine.scheduler.running] == [0, 1, 2, 4]  # the loners were not held
    run_watching_holds(engine)
    assert engine.prefix.held_for_prefix == 2
    assert engine.prefix.prefix_hit_tokens == len(P) // 4 * 4 + len(other) // 4 * 4
    for r in engine.requests.values():
        assert r.output_ids == hf_ref(r.prompt_ids, 5)


NESTED = P + tail(15)  # 39 tokens; request k of a chain takes its first 4 (k + 2) and a tail


def nested_chain(count: int) -> list[WorkItem]:
    """Request k shares k + 2 blocks with request k + 1: each can only be computed after the last."""
    return [WorkItem(NESTED[:4 * (k + 2)] + tail(9), 8) for k in range(count)]


@pytest.mark.points(2)
def test_no_request_is_held_more_than_max_prefix_hold_steps(model, hf_ref):
    """In a chain of nested prefixes arriving together, request k waits for k - 1 blocks to be
    keyed one after the other: it would be held k steps. max_prefix_hold caps that; past the
    cap a request computes what is not cached yet itself, and the ids do not change."""
    computed = {}
    for max_hold in (0, 2, 8):
        engine = make(model, max_prefix_hold=max_hold)
        requests = run_watching_holds(engine, nested_chain(6))
        held = [r.held_steps for r in requests.values()]
        assert held == [min(k, max_hold) for k in range(6)], (max_hold, held)
        assert engine.prefix.held_for_prefix == sum(held)
        assert sum(m["held_for_prefix"] for m in engine.metrics_timeline) == sum(held)
        computed[max_hold] = engine.metrics()["prefill_tokens_computed"]
        for r in requests.values():
            assert r.output_ids == hf_ref(r.prompt_ids, 8), (max_hold, r.request_id)
    assert computed[0] > computed[2] > computed[8]


@pytest.mark.points(3)
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_bursts_under_eviction_with_samples_give_the_ids_of_sharing_off_and_hf(model, hf_ref, preempt):
    """Two bursts into a pool too small for them, one request sampled n = 3 (greedy)."""
    items = [*burst(P, TAILS[:2], 8), SampledWorkItem(P + tail(1), 8, n=3),
             *[SampledWorkItem(P + t, 8, arrival_step=3) for t in TAILS[2:]],
             SampledWorkItem(PREFIX + tail(5), 8, arrival_step=3)]
    outputs = {}
    for sharing in (True, False):
        engine = make(model, num_blocks=16, preempt=preempt, prefix_sharing=sharing)
        outputs[sharing] = by_sample(run_watching_holds(engine, items))
        c = engine.preemptor.counters
        assert c.preempted_recompute + c.preempted_swap > 0, f"sharing {sharing}: the pool was big enough"
        if sharing:
            assert engine.prefix.held_for_prefix > 0 and engine.prefix.prefix_hit_tokens > 0
    assert outputs[True] == outputs[False] and len(outputs[True]) == 8
    for (prompt, _), ids in outputs[True].items():
        assert ids == hf_ref(prompt, 8)


def test_pending_keys_are_the_prompt_blocks_not_keyed_yet(model):
    engine = make(model, prefill_chunk=8)
    req = engine.add_request(WorkItem(P + TAILS[0], 2))
    engine.step()  # 8 of 27 tokens: 2 blocks keyed, 4 more full prompt blocks to go
    assert engine.kv.pending_keys(req) == chain_keys(req.tokens[:-1], 4)[2:] and len(engine.kv.pending_keys(req)) == 4
    while req.num_pending > 1:
        engine.step()
    assert engine.kv.pending_keys(req) == []


def test_l8_smoke_with_arrivals_together_holds_and_matches_hf(capsys):
    from helpers import run_script_json

    reports = {}
    for mode in ("on", "off"):
        status, report, _ = run_script_json("l8_smoke", ["--arrivals", "together", "--prefix-sharing", mode], capsys)
        assert status == 0 and report["match"] is True and report["arrivals"] == "together"
        assert report["prefill_chunk"] == DEFAULT_PREFILL_CHUNK
        reports[mode] = report
    on, off = reports["on"], reports["off"]
    assert on["held_for_prefix_per_step"][0] == on["held_for_prefix_total"] == 4
    assert off["held_for_prefix_total"] == 0
    assert on["prefill_tokens_needed"] == off["prefill_tokens_computed"]
    assert on["prefill_tokens_computed"] == (on["prefill_tokens_needed"] - on["prefix_hit_tokens"]
                                             - on["fork_shared_tokens"])
    assert [r["ids"] for r in on["requests"]] == [r["ids"] for r in off["requests"]]
