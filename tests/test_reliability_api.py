"""Reliability of the lesson packages' API, second round: what a careless or hostile caller does.

Each case makes one bad call (or interrupts one at the worst moment) and asserts a one-line error,
the object exactly as before, and then that a normal request still ends with HF's ids alone. Also:
one request's failure during a step ends that request only (finish_reason "error"), a request that
exactly fits the pool is accepted, and the prefix-cache counters mean what they say. Everything
tested here is provided code (add_request, abort, step, the constructors, the counters): no points.
"""

from __future__ import annotations

import time

import pytest

import l8_prefix.sampling
from helpers import random_prompt
from l1_contiguous import InputError
from l2_paged import BlockAllocator, KvPool, PagedRunner, kv_positions_needed, load_paged_model
from l3_block_kernel import BlockKvPool
from l5_eviction import Engine, State, WorkItem, load_engine_model, make_engine
from l8_prefix import PrefixBlockAllocator, PrefixEngine, SampledWorkItem, make_prefix_engine
from test_bad_input_api import GOOD, finishes_like_hf, one_line, refused
from test_l5_engine import engine_state, hf_alone, quarter_pool
from test_l5_invariants import check_invariants as l5_invariants
from test_l8_engine import check_invariants as l8_invariants

pytestmark = [pytest.mark.course, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_engine_model(tiny_model_dir)


# ---------------------------------------------------------------- at the door

def item(**changes) -> dict:
    return {"prompt_ids": [1, 2, 3], "max_new_tokens": 3, **changes}


BAD_FOR_BOTH = {  # name: a callable that makes the bad item; the L5 and the L8 engine refuse each
    "a dict, not a WorkItem": lambda cls: item(),
    "stop ids an int": lambda cls: cls(**item(stop_token_ids=5)),
    "stop ids a string": lambda cls: cls(**item(stop_token_ids="12")),
    "stop id a float": lambda cls: cls(**item(stop_token_ids=[1.5])),
    "stop id None": lambda cls: cls(**item(stop_token_ids=[None])),
    "priority too large for an int": lambda cls: cls(**item(priority=10**400)),
    "priority past 10**9": lambda cls: cls(**item(priority=10**10)),
    "priority a huge negative float": lambda cls: cls(**item(priority=-1e300)),
}
BAD_SAMPLES = {  # SampledWorkItem fields the L8 engine refuses (its pool: 64 blocks)
    "temperature too large for a float": dict(temperature=10**400),
    "temperature past 100": dict(temperature=1e6),
    "seed past 2**64 - 1": dict(seed=2**64),
    "seed + n past 2**64 - 1": dict(seed=2**64 - 1, n=2),
    "n past the pool's blocks": dict(n=65),
    "n ten million": dict(n=10**7),
    "n a bool": dict(n=True),
}


@pytest.mark.parametrize("name", list(BAD_FOR_BOTH))
@pytest.mark.parametrize("lesson", ["l5", "l8"])
def test_add_request_refuses_at_the_door(lesson, name, model, tiny_model_dir):
    engine = make_engine(model, 64, 4) if lesson == "l5" else make_prefix_engine(model, 64, 4)
    engine.add_request(GOOD)
    cls = WorkItem if lesson == "l5" else SampledWorkItem
    message = refused(engine, lambda: BAD_FOR_BOTH[name](cls), InputError)
    assert "request 1" in message
    finishes_like_hf(engine, tiny_model_dir)


@pytest.mark.parametrize("name", list(BAD_SAMPLES))
def test_l8_add_request_refuses_sampling_fields(name, model, tiny_model_dir):
    engine = make_prefix_engine(model, 64, 4)
    engine.add_request(GOOD)
    started = time.perf_counter()
    message = refused(engine, lambda: SampledWorkItem(**item(**BAD_SAMPLES[name])), InputError)
    assert time.perf_counter() - started < 1.0, "refusing must not depend on n"
    assert "request 1" in message
    finishes_like_hf(engine, tiny_model_dir)


@pytest.mark.parametrize("bad_id", [True, False, 0.0, None, [0]])
def test_abort_refuses_an_id_that_is_not_an_int(bad_id, model, tiny_model_dir):
    """abort(True) must not abort request 1 (True == 1 in Python)."""
    engine = make_engine(model, 64, 4)
    engine.add_request(GOOD)
    engine.add_request(WorkItem([4, 5, 6], 3))
    before = engine_state(engine)
    with pytest.raises(InputError, match="no request has id") as exc_info:
        engine.abort(bad_id)
    one_line(exc_info)
    assert engine_state(engine) == before and engine.requests[1].state is State.WAITING
    finishes_like_hf(engine, tiny_model_dir)


@pytest.mark.parametrize("num_blocks,block_size", [(8.0, 4), (8, 4.0), (8, "4"), (8, 0), (8, True), (None, 4)])
@pytest.mark.parametrize("make", [make_engine, make_prefix_engine], ids=["l5", "l8"])
def test_make_engine_refuses_a_block_count_or_size_that_is_not_an_int(make, num_blocks, block_size, model):
    with pytest.raises(InputError) as exc_info:
        make(model, num_blocks, block_size)
    one_line(exc_info)


@pytest.mark.parametrize("build", [
    lambda cfg: BlockAllocator(8.0, 4), lambda cfg: BlockAllocator(8, 2.5), lambda cfg: PrefixBlockAllocator(8, "4"),
    lambda cfg: KvPool(cfg, 8.0, 4, None), lambda cfg: BlockKvPool(cfg, 8, 4.0, None),
], ids=["l2 allocator float count", "l2 allocator float size", "l8 allocator str size", "l2 pool float count",
        "l3 pool float size"])
def test_allocators_and_pools_refuse_sizes_that_are_not_ints(build, model):
    with pytest.raises(ValueError) as exc_info:
        build(model.config)
    one_line(exc_info)


@pytest.mark.parametrize("engine_cls,alloc_cls", [(Engine, BlockAllocator), (PrefixEngine, PrefixBlockAllocator)],
                         ids=["l5", "l8"])
@pytest.mark.parametrize("alloc_shape", [(9, 4), (8, 2)], ids=["more blocks", "smaller blocks"])
def test_an_engine_refuses_a_pool_and_an_allocator_that_disagree(engine_cls, alloc_cls, alloc_shape, model):
    pool = BlockKvPool(model.config, 8, 4, model.dtype, model.device)
    with pytest.raises(InputError, match="the pool has 8 blocks of 4") as exc_info:
        engine_cls(model, pool, alloc_cls(*alloc_shape))
    one_line(exc_info)


def test_l2_runner_refuses_a_pool_and_an_allocator_that_disagree(tiny_model_dir):
    model = load_paged_model(tiny_model_dir)
    with pytest.raises(InputError, match="same sizes") as exc_info:
        PagedRunner(model, KvPool(model.config, 8, 4, model.dtype, model.device), BlockAllocator(16, 4))
    one_line(exc_info)


@pytest.mark.parametrize("which", ["in use", "plain free", "past the pool"])
def test_forget_refuses_a_block_that_is_not_cached_free(which):
    alloc = PrefixBlockAllocator(8, 4)
    (block,) = alloc.alloc_blocks(1)
    target = {"in use": block, "plain free": alloc.free_blocks[-1], "past the pool": 99}[which]
    before = (list(alloc.free_blocks), list(alloc.ref_count), dict(alloc.key_of))
    with pytest.raises(ValueError, match="not cached free") as exc_info:
        alloc.forget(target)
    one_line(exc_info)
    assert (list(alloc.free_blocks), list(alloc.ref_count), dict(alloc.key_of)) == before
    alloc.check()


# ---------------------------------------------------------------- sizes and bounds that are right

@pytest.mark.parametrize("make", [make_engine, make_prefix_engine], ids=["l5", "l8"])
def test_a_request_that_exactly_fits_the_pool_is_accepted(make, model, tiny_model_dir):
    """Prompt 5 + 4 new tokens write 8 positions (the last token is never fed back): 2 blocks of 4."""
    assert kv_positions_needed(5, 4) == 8
    engine = make(model, 2, 4)
    exact = WorkItem(random_prompt(5, 512, 11), 4)
    engine.add_request(exact)
    engine.run(max_steps=50)
    assert engine.requests[0].output_ids == hf_alone(tiny_model_dir, exact)
    assert engine.alloc.num_free == 2 and engine.alloc.peak_used == 2


def test_an_arrival_far_ahead_does_not_spin_through_empty_steps(model, tiny_model_dir):
    engine = make_engine(model, 64, 4)
    late = WorkItem(list(GOOD.prompt_ids), GOOD.max_new_tokens, arrival_step=10**9)
    engine.add_request(late)
    started = time.perf_counter()
    engine.run(max_steps=10**9 + 100)
    assert time.perf_counter() - started < 10
    assert engine.requests[0].output_ids == hf_alone(tiny_model_dir, GOOD)
    assert len(engine.timeline) <= GOOD.max_new_tokens + 1 and engine.timeline[0].step == 10**9


def test_run_says_at_once_when_the_next_arrival_is_past_max_steps(model):
    engine = make_engine(model, 64, 4)
    engine.add_request(WorkItem([1, 2, 3], 2, arrival_step=10**6))
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="not finished after 1000 steps"):
        engine.run(max_steps=1000)
    assert time.perf_counter() - started < 1.0


# ---------------------------------------------------------------- one request's failure is its own

def test_a_request_whose_sampling_fails_ends_alone(model, tiny_model_dir, monkeypatch):
    real = l8_prefix.sampling.draw

    def draw(req, row):  # e.g. NaN logits for this request only: multinomial refuses them
        if req.temperature > 0:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(req, row)

    monkeypatch.setattr(l8_prefix.sampling, "draw", draw)
    engine = make_prefix_engine(model, 64, 4)
    engine.add_request(GOOD)
    engine.add_request(SampledWorkItem([7, 8, 9, 10], 5, temperature=0.7, n=2))
    engine.run(max_steps=100)
    good, bad = engine.requests[0], engine.requests[1]
    assert good.output_ids == hf_alone(tiny_model_dir, GOOD) and good.finish_reason == "length"
    assert bad.finish_reason == "error" and "sampling failed" in bad.error and not bad.output_ids
    assert all(r.state is State.FINISHED for r in engine.requests.values())
    l8_invariants(engine)
    assert engine.alloc.num_free == engine.alloc.num_blocks


def test_a_fork_that_fails_ends_alone_and_its_siblings_go_on(model, tiny_model_dir, monkeypatch):
    real = PrefixEngine.as_sample

    def as_sample(self, req, first, k):
        if k == 2:
            raise RuntimeError("Overflow when unpacking long")  # what manual_seed says past 2**64 - 1
        return real(self, req, first, k)

    monkeypatch.setattr(PrefixEngine, "as_sample", as_sample)
    engine = make_prefix_engine(model, 64, 4)
    engine.add_request(SampledWorkItem(list(GOOD.prompt_ids), GOOD.max_new_tokens, n=3))
    engine.run(max_steps=100)
    samples = sorted(engine.requests.values(), key=lambda r: r.sample_index or (2 if r.error else 0))
    failed = [r for r in samples if r.finish_reason == "error"]
    assert len(failed) == 1 and "seeding sample 2 failed" in failed[0].error
    ok = [r for r in samples if r.finish_reason != "error"]
    assert len(ok) == 2 and all(r.output_ids == hf_alone(tiny_model_dir, GOOD) for r in ok)
    l8_invariants(engine)
    assert engine.alloc.num_free == engine.alloc.num_blocks


# ---------------------------------------------------------------- all or nothing under Ctrl-C

def test_add_request_of_n_samples_interrupted_queues_none(model, tiny_model_dir, monkeypatch):
    """Sharing off: n requests are made; a Ctrl-C while making the third leaves none queued."""
    engine = make_prefix_engine(model, 64, 4, prefix_sharing=False)
    engine.add_request(GOOD)
    real = PrefixEngine.as_sample

    def as_sample(self, req, first, k):
        if k == 2:
            raise KeyboardInterrupt
        return real(self, req, first, k)

    monkeypatch.setattr(PrefixEngine, "as_sample", as_sample)
    before = engine_state(engine)
    with pytest.raises(KeyboardInterrupt):
        engine.add_request(SampledWorkItem([4, 5, 6], 3, n=3))
    assert engine_state(engine) == before
    monkeypatch.undo()
    finishes_like_hf(engine, tiny_model_dir)


@pytest.mark.parametrize("make", [make_engine, make_prefix_engine], ids=["l5", "l8"])
def test_abort_interrupted_inside_its_free_changes_nothing(make, model, tiny_model_dir, monkeypatch):
    engine = make(model, 64, 4)
    engine.add_request(GOOD)
    engine.add_request(WorkItem([4, 5, 6, 7, 8, 9], 6))
    engine.step()
    victim = engine.requests[1]
    assert victim.state is State.RUNNING and victim.blocks
    real = engine.alloc.free

    def free_then_interrupt(blocks):  # half done: the first block is freed, then Ctrl-C
        real(blocks[:1])
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.alloc, "free", free_then_interrupt)
    before, blocks = engine_state(engine), list(victim.blocks)
    with pytest.raises(KeyboardInterrupt):
        engine.abort(1)
    assert engine_state(engine) == before
    assert victim.state is State.RUNNING and victim.blocks == blocks
    monkeypatch.undo()
    engine.abort(1)
    assert victim.finish_reason == "aborted" and not victim.blocks
    finishes_like_hf(engine, tiny_model_dir)


def _preempting_workload(n: int = 6) -> list[WorkItem]:
    return [WorkItem(random_prompt(6 + 3 * i, 512, 40 + i), 8) for i in range(n)]


@pytest.mark.parametrize("make,invariants", [(make_engine, l5_invariants), (make_prefix_engine, l8_invariants)],
                         ids=["l5", "l8"])
def test_a_second_interrupt_during_the_rollback_is_finished_by_the_next_step(make, invariants, model,
                                                                              tiny_model_dir, monkeypatch):
    """Ctrl-C right after the forward of a step that preempted someone; a second Ctrl-C while the
    rollback puts the victim back. The next step must finish that rollback first: nobody is lost."""
    items = _preempting_workload()
    engine = make(model, quarter_pool(items), 4)
    for w in items:
        engine.add_request(w)
    real_forward, real_drop = engine.runner.forward_logits, engine.preemptor.drop_for_recompute
    fired, victims = {"forward": False, "rollback": False}, []

    def forward_logits(reqs, num_new):  # after the forward: the victim's old blocks may be overwritten
        preempted_now = list(engine.preemptor._events)  # victims of this step
        logits = real_forward(reqs, num_new)
        if not fired["forward"] and preempted_now:
            fired["forward"] = True
            victims.extend(preempted_now)
            raise KeyboardInterrupt
        return logits

    def drop_for_recompute(req):
        if fired["forward"] and not fired["rollback"]:
            fired["rollback"] = True
            raise KeyboardInterrupt  # the second Ctrl-C, inside the rollback
        return real_drop(req)

    monkeypatch.setattr(engine.runner, "forward_logits", forward_logits)
    monkeypatch.setattr(engine.preemptor, "drop_for_recompute", drop_for_recompute)
    while not fired["rollback"]:
        assert engine.has_unfinished(), "the workload was meant to preempt"
        try:
            engine.step()
        except KeyboardInterrupt:
            pass
    engine._finish_rollback()  # what the next step (or add_request, abort) does first
    for i in victims:  # preempted for recompute: the blocks they held may hold others' K/V now
        victim = engine.requests[i]
        assert victim.state is State.WAITING and victim.cur_len == 0 and not victim.blocks, i
        assert victim in engine.scheduler.waiting
    invariants(engine)
    engine.step()
    invariants(engine)
    engine.run(max_steps=500)
    for req, w in zip(engine.requests.values(), items):
        assert req.output_ids == hf_alone(tiny_model_dir, w), req.request_id
    assert engine.alloc.num_free == engine.alloc.num_blocks


# ---------------------------------------------------------------- counters that mean what they say

def test_recomputed_tokens_are_not_prefix_hits(model):
    """Six prompts that share nothing, in a pool that forces recompute: a hit would be a request
    finding its own blocks again, which is recompute (tokens_recomputed), not sharing."""
    items = _preempting_workload()
    engine = make_prefix_engine(model, quarter_pool(items), 4)
    engine.run(items, max_steps=500)
    summary = engine.summary()
    assert summary["preempted_recompute"] > 0 and summary["tokens_recomputed"] > 0
    assert summary["prefix_hit_tokens"] == 0 and summary["hit_rate"] == 0.0
    assert summary["prefill_tokens_total"] == sum(len(w.prompt_ids) for w in items)


def test_prefill_tokens_needed_is_the_same_with_sharing_on_and_off(model):
    """The equality the L8 smoke script and lesson state: prefill_tokens_total + fork_shared_tokens
    is every prompt token of every sample, whatever sharing and preemption did."""
    prompt = random_prompt(10, 512, 3)
    items = [SampledWorkItem(prompt + random_prompt(4 + i, 512, 60 + i), 8, n=1 + i % 3) for i in range(5)]
    expected = sum(len(w.prompt_ids) * w.n for w in items)
    needed, preempted = {}, {}
    for sharing in (True, False):
        engine = make_prefix_engine(model, 12, 4, prefix_sharing=sharing)
        engine.run(items, max_steps=1000)
        s = engine.summary()
        needed[sharing] = s["prefill_tokens_total"] + s["fork_shared_tokens"]
        preempted[sharing] = s["preempted_recompute"]
        assert s["prefix_hit_tokens"] <= s["prefill_tokens_total"]
    assert preempted[False] > 0, "the pool was meant to force preemptions"
    assert needed[True] == needed[False] == expected
