"""L8 through the engine on a random tiny model: hits reuse only full blocks, shared blocks are never
written, copy-on-write copies once per writer, counts return to zero, and every request, every
sample, with sharing on or off, under eviction too, ends with HF's ids."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from harness import hf_reference as hf
from harness.judge import snapshot
from helpers import blocks_for, random_prompt
from probes_l8 import poison_blocks
from l5_eviction import State, WorkItem, load_engine_model
from l8_prefix import SampledWorkItem, chain_keys, make_prefix_engine
from l8_prefix import PrefixRequest

pytestmark = [pytest.mark.l8, pytest.mark.usefixtures("one_torch_thread")]

BS = 4  # small blocks: short prompts span many of them
VOCAB = 512  # harness.tiny_models.TINY
PREFIX = random_prompt(22, VOCAB, seed=4)  # 5 full blocks of 4, and 2 tokens into the 6th


def tail(k: int) -> list[int]:
    return random_prompt(k, VOCAB, seed=100 + k)



@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_engine_model(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_ref(tiny_model_dir):
    """hf_ref(prompt, n) -> HF's greedy ids, after checking no step is a near tie for HF."""

    @functools.lru_cache(maxsize=None)
    def ref(prompt: tuple[int, ...], n: int) -> list[int]:
        model = hf.load_hf_model(str(tiny_model_dir))
        ids = hf.hf_greedy(model, list(prompt), n)
        gap = float(hf.top2_gaps(hf.greedy_step_logits(model, list(prompt), ids)).min())
        assert gap > 5e-3, f"test setup: HF's top-2 gap {gap:.2g} is a near tie; pick another prompt"
        return ids

    return lambda prompt, n: ref(tuple(prompt), n)


def make(model, num_blocks: int = 64, **kwargs):
    engine = make_prefix_engine(model, num_blocks, BS, **kwargs)
    guard_writes(engine)
    return engine


# ---------------------------------------------------------------- checks shared with test_l8_property

def guard_writes(engine) -> None:
    """Every forward first asserts that each token's K/V goes into a block only its request holds."""
    real, alloc = engine.runner.forward_logits, engine.alloc

    def forward_logits(reqs, num_new):
        views, now = snapshot((reqs, alloc))  # judged: one request for what the checks read
        for req, n in zip(views, num_new):
            for pos in range(req.cur_len, req.cur_len + n):
                i = pos // now.block_size
                assert i < len(req.blocks), f"request {req.request_id}: position {pos} has no block reserved"
                assert now.ref_count[req.blocks[i]] == 1, (
                    f"request {req.request_id} writes position {pos} into block {req.blocks[i]}, "
                    f"which {now.ref_count[req.blocks[i]]} tables hold")
        return real(reqs, num_new)

    engine.runner.forward_logits = forward_logits


def check_invariants(engine) -> None:
    """The accounting invariants of DESIGN.md, after any operation."""
    # Judged: what the checks read in one request (not the whole engine: its timeline grows a step at a time).
    alloc, requests = snapshot((engine.alloc, engine.requests))
    bs = alloc.block_size
    alloc.check()  # each block in exactly one place; no negative count; key maps agree
    holders = Counter(b for r in requests.values() for b in r.blocks)
    wrong = {b: (alloc.ref_count[b], holders[b]) for b in range(alloc.num_blocks) if alloc.ref_count[b] != holders[b]}
    assert not wrong, f"block: (ref count, tables holding it) disagree: {wrong}"
    for r in requests.values():
        if r.state is not State.RUNNING:
            assert not r.blocks, f"request {r.request_id} is {r.state.value} but holds {r.blocks}"
            continue
        assert len(set(r.blocks)) == len(r.blocks)
        assert len(r.blocks) == blocks_for(r.cur_len, bs), (r.request_id, r.cur_len, r.blocks)
        keys = chain_keys(r.tokens[:r.cur_len], bs)  # what each of its computed full blocks holds
        for i, b in enumerate(r.blocks):
            if b in alloc.key_of:
                assert i < len(keys) and alloc.key_of[b] == keys[i], (
                    f"block {b} is keyed for other tokens than request {r.request_id} holds in it")
    m = engine.metrics()
    logical = sum(len(r.blocks) for r in requests.values())
    assert m["shared_blocks_now"] == sum(c > 1 for c in alloc.ref_count)
    assert m["blocks_saved"] == logical - alloc.num_used
    assert m["prefill_tokens_computed"] == m["prefill_tokens_total"] - m["prefix_hit_tokens"] >= 0


def check_all_released(engine) -> None:
    alloc = engine.alloc
    assert all(c == 0 for c in alloc.ref_count)
    assert alloc.num_free == alloc.num_blocks == len(alloc.free_blocks) + len(alloc.cached_free)
    assert engine.metrics()["shared_blocks_now"] == 0
    alloc.check()


def run_checked(engine, items=(), max_steps: int = 300) -> dict:
    for item in items:
        engine.add_request(item)
    limit = engine.now + max_steps
    while engine.has_unfinished():
        assert engine.now < limit, f"not finished after {max_steps} steps: a request is never admitted?"
        engine.step()
        check_invariants(engine)
    check_all_released(engine)
    return engine.requests


def by_sample(requests) -> dict:
    """(prompt, sample index) -> ids: request ids differ with sharing on and off, this does not."""
    return {(tuple(r.prompt_ids), r.sample_index): r.output_ids for r in requests.values()}


def record_plans(engine) -> list[list]:
    plans, real = [], engine.scheduler.schedule

    def schedule(now):
        plan = real(now)
        plans.append([(req, n) for req, n in plan])
        return plan

    engine.scheduler.schedule = schedule
    return plans


# ---------------------------------------------------------------- what a hit reuses

# PrefixKvManager.attach_computed_prefix's contract (§2.3) called directly on a warm cache: most of its points.
@pytest.mark.points(9)
def test_attach_cached_prefix_takes_the_longest_cached_run_but_never_the_last_tokens_block(model):
    engine = make(model)
    prompt = PREFIX + tail(6)  # 28 tokens: 7 full blocks, all cached once it has run
    run_checked(engine, [WorkItem(prompt, 2)])
    alloc, keys = engine.alloc, chain_keys(prompt, BS)
    cached = alloc.lookup(keys)
    assert len(cached) == 7
    other = prompt[:9] + [(prompt[9] + 1) % VOCAB] + prompt[10:]  # differs in block 2
    cases = [(prompt, 6), (prompt[:26], 6), (prompt[:24], 5), (prompt[:5], 1), (prompt[:4], 0),
             (other, 2), ([(prompt[0] + 1) % VOCAB] + prompt[1:], 0)]
    for rid, (tokens, hits) in enumerate(cases, start=100):
        req = PrefixRequest(list(tokens), 3, request_id=rid)
        refs = [alloc.ref_count[b] for b in cached]
        assert engine.kv.attach_computed_prefix(req) == req.cur_len == hits * BS, (len(tokens), hits)
        assert req.blocks == cached[:hits] and req.block_keys == keys[:hits]
        assert req.slot_indices == [b * BS + i for b in cached[:hits] for i in range(BS)]
        assert [alloc.ref_count[b] for b in cached] == [r + (i < hits) for i, r in enumerate(refs)]
        alloc.free(req.blocks)
    alloc.check()


@pytest.mark.points(3)
def test_a_prefix_that_ends_mid_block_reuses_only_its_full_blocks(model, hf_ref):
    prompt_a, prompt_b = PREFIX + tail(6), PREFIX + tail(3)  # 28 and 25 tokens; 22 in common
    assert prompt_a[22] != prompt_b[22]
    engine = make(model)
    a = engine.add_request(WorkItem(prompt_a, 4))
    run_checked(engine)
    a_blocks = engine.alloc.lookup(chain_keys(prompt_a, BS))
    assert len(a_blocks) == 7 and set(a_blocks) <= set(engine.alloc.cached_free)  # A ended; its blocks stay
    b = engine.add_request(WorkItem(prompt_b, 6))
    engine.step()
    # 22 shared tokens = 5 full blocks (20 tokens) + 2 tokens of a block that goes on differently
    assert engine.prefix.prefix_hit_tokens == 20
    assert b.blocks[:5] == a_blocks[:5] and not set(b.blocks[5:]) & set(a_blocks)
    assert engine.alloc.ref_count[a_blocks[5]] == 0 and a_blocks[5] in engine.alloc.cached_free
    m = engine.metrics()
    assert (m["prefill_tokens_total"], m["prefill_tokens_computed"]) == (28 + 25, 28 + 5)
    run_checked(engine)
    assert a.output_ids == hf_ref(prompt_a, 4) and b.output_ids == hf_ref(prompt_b, 6)
    # The hit is B reading A's blocks, not a count: the same run with noise in those 5 blocks
    # before B arrives changes B's ids (an engine that recomputed them would still give HF's).
    engine = make(model)
    engine.add_request(WorkItem(prompt_a, 4))
    run_checked(engine)
    poison_blocks(engine, engine.alloc.lookup(chain_keys(prompt_b, BS)))
    b = engine.add_request(WorkItem(prompt_b, 6))
    run_checked(engine)
    assert b.output_ids != hf_ref(prompt_b, 6), "noise in the 5 blocks B says it hit changed nothing: B recomputed them"


@pytest.mark.points(3)
@pytest.mark.parametrize("length,hit,computed", [(24, 20, 4), (26, 24, 2)])
def test_a_fully_cached_prompt_still_computes_its_last_token(model, hf_ref, length, hit, computed):
    """24 = 6 blocks exactly: the block holding the last token cannot be taken, so 4 tokens are computed."""
    prompt = (PREFIX + tail(4))[:length]
    engine = make(model)
    first = run_checked(engine, [WorkItem(prompt, 3)])[0]
    assert len(engine.alloc.lookup(chain_keys(prompt, BS))) == length // BS  # the whole prompt is cached
    calls, real = [], engine.runner.forward_logits
    engine.runner.forward_logits = lambda reqs, num_new: (calls.append([(r.request_id, n) for r, n in zip(reqs, num_new)]),
                                                          real(reqs, num_new))[1]
    again = engine.add_request(WorkItem(prompt, 3))
    engine.step()
    assert engine.prefix.prefix_hit_tokens == hit
    assert calls == [[(again.request_id, computed)]]  # a forward of its own, so it gets logits
    assert again.output_ids == hf_ref(prompt, 3)[:1]
    run_checked(engine)
    assert again.output_ids == first.output_ids == hf_ref(prompt, 3)


# ---------------------------------------------------------------- shared blocks are read, never written

@pytest.mark.points(3)
def test_shared_blocks_are_never_written(model, hf_ref):
    items = [WorkItem(PREFIX + tail(5), 8, arrival_step=0), WorkItem(PREFIX + tail(7), 8, arrival_step=1),
             SampledWorkItem(PREFIX + tail(1), 8, arrival_step=2, n=3)]
    engine = make(model)
    for item in items:
        engine.add_request(item)
    for _ in range(3):
        engine.step()
    alloc, pool = engine.alloc, engine.pool
    shared = {b: alloc.ref_count[b] for b in range(alloc.num_blocks) if alloc.ref_count[b] > 1}
    # 5 prefix blocks held by A, B and the three samples; the samples' partial block by the samples
    assert sorted(shared.values()) == [3, 5, 5, 5, 5, 5]
    filled = {}  # block -> slots holding K/V now (all of a full block, the written part of a partial one)
    for r in engine.requests.values():
        for i, b in enumerate(r.blocks):
            if b in shared:
                filled[b] = max(filled.get(b, 0), min(BS, r.cur_len - i * BS))
    before = {b: [(k[b, :n].clone(), v[b, :n].clone()) for k, v in zip(pool.k_blocks, pool.v_blocks)]
              for b, n in filled.items()}
    requests = run_checked(engine)  # every sharer decodes 7 more tokens; the guard checks each write
    for b, n in filled.items():
        for layer, (k, v) in enumerate(zip(pool.k_blocks, pool.v_blocks)):
            assert k[b, :n].equal(before[b][layer][0]) and v[b, :n].equal(before[b][layer][1]), (b, layer)
    assert alloc.evicted_cached == 0 and engine.prefix.cow_copies == 2
    for r in requests.values():
        assert r.output_ids == hf_ref(r.prompt_ids, 8), r.request_id


# ---------------------------------------------------------------- parallel samples and copy-on-write

@pytest.mark.points(3)
@pytest.mark.parametrize("k,copies", [(1, 2), (2, 0)])
def test_copy_on_write_copies_once_per_writer_and_the_last_writes_in_place(model, hf_ref, k, copies):
    prompt = PREFIX + tail(k)  # 23 tokens: 5 full blocks + 3 tokens in a 6th; 24: exactly 6 full blocks
    engine = make(model)
    parent = engine.add_request(SampledWorkItem(prompt, 6, n=3))
    engine.step()  # one prefill; the two forks share every block of it, the partial one too
    samples = list(engine.requests.values())
    table = list(parent.blocks)
    assert len(samples) == 3 and all(r.blocks == table for r in samples)
    assert all(engine.alloc.ref_count[b] == 3 for b in table) and engine.prefix.cow_copies == 0
    assert engine.prefix.prefix_hit_tokens == 0 and engine.prefix.fork_shared_tokens == 2 * len(prompt)
    plans = record_plans(engine)
    engine.step()  # each sample writes position len(prompt)
    order = [r for r, _ in plans[-1]]
    assert engine.prefix.cow_copies == copies
    assert all(r.blocks[:5] == table[:5] for r in samples) and all(engine.alloc.ref_count[b] == 3 for b in table[:5])
    if copies:
        partial = table[5]
        assert order[-1].blocks[5] == partial and engine.alloc.ref_count[partial] == 1  # the last writes in place
        copied = [r.blocks[5] for r in order[:-1]]
        assert len(set(copied)) == 2 and not set(copied) & set(table)
    else:
        assert all(r.blocks[:6] == table for r in samples)
        assert len({r.blocks[6] for r in samples}) == 3  # each opened its own next block: nothing to copy
    run_checked(engine)
    assert engine.prefix.cow_copies == copies  # later writes go into private blocks
    for r in samples:
        assert r.output_ids == hf_ref(prompt, 6), r.sample_index


# ---------------------------------------------------------------- counts and cached-free blocks

@pytest.mark.points(2)
def test_ref_counts_match_the_tables_every_step_and_return_to_zero(model, hf_ref):
    items = [WorkItem(PREFIX + tail(3), 6, arrival_step=0), SampledWorkItem(PREFIX + tail(5), 6, arrival_step=1, n=2),
             WorkItem(PREFIX + tail(9), 3, arrival_step=1), SampledWorkItem(PREFIX + tail(1), 7, arrival_step=3, n=3),
             WorkItem(PREFIX, 5, arrival_step=4)]
    engine = make(model, num_blocks=48)
    peak_saved = 0
    for item in items:
        engine.add_request(item)
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine)
        peak_saved = max(peak_saved, engine.metrics()["blocks_saved"])
    check_all_released(engine)
    assert peak_saved >= 10 and engine.alloc.cached_free  # shared while running, cached after
    m = engine.metrics()
    assert m["prefix_hit_tokens"] > 0 and 0 < m["hit_rate"] < 1 and m["memory_utilization"] == 0
    for r in engine.requests.values():
        assert r.output_ids == hf_ref(r.prompt_ids, r.max_new_tokens), r.request_id


@pytest.mark.points(2)
def test_the_oldest_finished_requests_blocks_are_evicted_first_tail_first(model, hf_ref):
    """A, then B finish (3 cached blocks each, pool of 8); C needs 4 blocks: 2 free, then A's last two."""
    pa, pb, pc = (random_prompt(12, VOCAB, seed) for seed in (5, 6, 7))
    engine = make(model, num_blocks=8)
    run_checked(engine, [WorkItem(pa, 1)])
    run_checked(engine, [WorkItem(pb, 1)])
    a_blocks, b_blocks = (engine.alloc.lookup(chain_keys(p, BS)) for p in (pa, pb))
    assert len(a_blocks) == len(b_blocks) == 3 and len(engine.alloc.free_blocks) == 2
    run_checked(engine, [WorkItem(pc, 2)])  # 12 prompt tokens + 1 decoded: 4 blocks
    assert engine.alloc.evicted_cached == 2
    assert engine.alloc.lookup(chain_keys(pa, BS)) == a_blocks[:1]  # A's first block survives
    assert engine.alloc.lookup(chain_keys(pb, BS)) == b_blocks  # B, used later, untouched
    hits = engine.prefix.prefix_hit_tokens
    again = run_checked(engine, [WorkItem(pa, 1)])[3]
    assert engine.prefix.prefix_hit_tokens - hits == 4 and again.output_ids == hf_ref(pa, 1)


# ---------------------------------------------------------------- same ids with sharing on and off

WORKLOAD = [WorkItem(PREFIX + tail(3), 8, arrival_step=0), WorkItem(PREFIX + tail(5), 8, arrival_step=0),
            WorkItem(PREFIX + tail(6), 8, arrival_step=1), WorkItem(PREFIX + tail(9), 8, arrival_step=1),
            SampledWorkItem(PREFIX + tail(1), 8, arrival_step=2, n=3), WorkItem(PREFIX + tail(11), 8, arrival_step=2)]


@pytest.mark.points(4)
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_ids_equal_with_sharing_on_and_off_under_eviction_and_equal_hf(model, hf_ref, preempt):
    outputs = {}
    for sharing in (True, False):
        engine = make(model, num_blocks=14, preempt=preempt, prefix_sharing=sharing)
        outputs[sharing] = by_sample(run_checked(engine, WORKLOAD))
        c = engine.preemptor.counters
        assert c.preempted_recompute + c.preempted_swap > 0, f"sharing {sharing}: the pool was big enough"
        assert (c.preempted_swap > 0) == (preempt == "swap")
    assert outputs[True] == outputs[False] and len(outputs[True]) == 8
    for (prompt, _), ids in outputs[True].items():
        assert ids == hf_ref(prompt, 8)


@pytest.mark.points(3)
@pytest.mark.parametrize("prefill_chunk", [None, 8])
def test_sampled_outputs_equal_the_same_samples_with_sharing_off(model, prefill_chunk):
    items = [SampledWorkItem(PREFIX + tail(5), 8, arrival_step=0, temperature=1.0, seed=7, n=3),
             SampledWorkItem(PREFIX + tail(9), 8, arrival_step=1, temperature=0.7, seed=100, n=2),
             SampledWorkItem(PREFIX + tail(2), 8, arrival_step=1, temperature=1.5, seed=3)]
    outputs = {}
    for sharing in (True, False):
        engine = make(model, prefill_chunk=prefill_chunk, prefix_sharing=sharing)
        outputs[sharing] = by_sample(run_checked(engine, items))
    assert outputs[True] == outputs[False]
    first = [ids for (p, _), ids in outputs[True].items() if list(p) == PREFIX + tail(5)]
    assert len(first) == 3 and len({tuple(ids) for ids in first}) == 3  # really three different samples


# ---------------------------------------------------------------- preemption with shared blocks

@pytest.mark.points(3)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempting_a_request_that_shares_blocks_only_drops_its_references(model, hf_ref, mode):
    engine = make(model, preempt=mode)
    a = engine.add_request(WorkItem(PREFIX + tail(5), 8))
    b = engine.add_request(WorkItem(PREFIX + tail(7), 8, arrival_step=1))  # 29 tokens
    engine.step()
    engine.step()  # B admitted on A's 5 prefix blocks
    shared, a_table = b.blocks[:5], list(a.blocks)
    assert shared == a.blocks[:5] and all(engine.alloc.ref_count[x] == 2 for x in shared)
    hits = engine.prefix.prefix_hit_tokens
    engine.scheduler.preempt(b)
    assert not b.blocks and a.blocks == a_table
    assert all(engine.alloc.ref_count[x] == 1 for x in shared)  # A still holds them: not freed, not cached
    assert not set(shared) & (set(engine.alloc.free_blocks) | set(engine.alloc.cached_free))
    check_invariants(engine)
    real_forward, b_returns = engine.runner.forward_logits, []

    def forward_logits(reqs, num_new):  # where B starts computing again, and how many tokens
        if b in reqs and not b_returns:
            b_returns.append((b.cur_len, num_new[reqs.index(b)]))
        return real_forward(reqs, num_new)

    engine.runner.forward_logits = forward_logits
    run_checked(engine)
    assert a.output_ids == hf_ref(a.prompt_ids, 8) and b.output_ids == hf_ref(b.prompt_ids, 8)
    if mode == "recompute":
        # B comes back with 30 tokens (prompt + 1): its first 28 are in 7 cached full blocks, 5 of
        # them A's and 2 its own, kept as cached-free when it was preempted; it computes 2.
        assert b_returns == [(28, 2)]
        # Its prompt was counted at its first admission; finding it again is recompute, not a hit.
        assert engine.prefix.prefix_hit_tokens == hits
    else:
        assert engine.preemptor.counters.bytes_swapped_in == engine.preemptor.counters.bytes_swapped_out > 0
