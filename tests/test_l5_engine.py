"""L5: the engine under memory pressure gives every request the ids HF gives it alone.

A workload of 8 requests arriving over 4 steps runs on a pool about a quarter of what it needs
together, so running requests are preempted (recompute or swap) and brought back, under each
policy. Then, on hand-built scenarios driven through the scheduler: who is evicted under each
policy, what the score policy's weights change, what the watermark keeps back, and which
requests are rejected before they start. Finally finish reasons and the counters.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from harness import hf_reference as hf
from helpers import hf_ids, random_prompt
from l1_contiguous import InputError, Qwen3Config
from l2_paged import BlockAllocator, blocks_needed, bytes_per_block, reserve
from l3_block_kernel import BlockKvPool
from l5_eviction import (MODES, POLICIES, EngineRequest, KvManager, Preemptor, RequestTooLargeError, Scheduler, ScorePolicy,
                         State, WorkItem, load_engine_model, lru_key, make_engine, make_policy, priority_key)

pytestmark = [pytest.mark.l5, pytest.mark.usefixtures("one_torch_thread")]


BLOCK_SIZE = 4
HUGE_POOL = 1000


# ---------------------------------------------------------------- the workload and its oracle


def make_workload() -> list[WorkItem]:
    """8 requests: prompts of 3..30 tokens, 6..16 new tokens, two arriving per step, priorities 0..2.

    Seeds 100..107 were picked so that HF's top-2 logit gaps stay above 1e-3 along every greedy
    path (checked by `test_workload_has_no_near_ties`): a flip there would be rounding, not a bug.
    """
    items = []
    for i in range(8):
        rng = random.Random(100 + i)
        prompt = random_prompt(rng.randint(3, 30), 512, 100 + i)
        items.append(WorkItem(prompt, rng.randint(6, 16), arrival_step=i // 2, priority=i % 3))
    return items


WORKLOAD = make_workload()


def demand_blocks(items) -> list[int]:
    return [blocks_needed(len(w.prompt_ids) + w.max_new_tokens, BLOCK_SIZE) for w in items]


def quarter_pool(items) -> int:
    """A quarter of the blocks the requests need together, but room for the largest one."""
    need = demand_blocks(items)
    return max(sum(need) // 4, max(need) + 1)


@functools.lru_cache(maxsize=None)
def _hf_ids_cached(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    return tuple(hf_ids(model_dir, list(prompt), max_new_tokens))


def hf_alone(model_dir, item: WorkItem) -> list[int]:
    """HF greedy on this prompt alone (cached: several tests ask for the same requests)."""
    return list(_hf_ids_cached(str(model_dir), tuple(item.prompt_ids), item.max_new_tokens))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_engine_model(tiny_model_dir)


@pytest.fixture(scope="module")
def run_workload(model):
    """run_workload(mode, policy, num_blocks, prefill_chunk) -> finished engine (cached)."""
    cache = {}

    def run(mode="recompute", policy="lru", num_blocks=None, prefill_chunk=None):
        key = (mode, policy, num_blocks, prefill_chunk)
        if key not in cache:
            engine = make_engine(model, num_blocks or quarter_pool(WORKLOAD), BLOCK_SIZE, policy=policy,
                                 preempt=mode, prefill_chunk=prefill_chunk)
            engine.run(WORKLOAD)
            cache[key] = engine
        return cache[key]

    return run


def outputs(engine) -> list[list[int]]:
    return [r.output_ids for r in engine.requests.values()]


# ---------------------------------------------------------------- identical outputs under eviction


def test_workload_has_no_near_ties(tiny_model_dir):
    m = hf.load_hf_model(str(tiny_model_dir))
    for item in WORKLOAD:
        ids = hf_alone(tiny_model_dir, item)
        assert len(ids) == item.max_new_tokens  # the random model has no EOS: every run is full length
        assert float(hf.top2_gaps(hf.greedy_step_logits(m, item.prompt_ids, ids)).min()) > 1e-3


@pytest.mark.points(2)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_same_ids_as_hf_alone_under_eviction(mode, policy, tiny_model_dir, run_workload):
    engine = run_workload(mode, policy)
    s = engine.summary()
    assert engine.alloc.num_blocks < sum(demand_blocks(WORKLOAD)) / 3  # the pool is far too small
    preempted = s["preempted_swap"] if mode == "swap" else s["preempted_recompute"]
    assert preempted > 0, "the pool was meant to force preemptions"
    assert s["preempted_recompute" if mode == "swap" else "preempted_swap"] == 0
    for item, got in zip(WORKLOAD, outputs(engine)):
        assert got == hf_alone(tiny_model_dir, item)
    assert outputs(engine) == outputs(run_workload(mode, policy, num_blocks=HUGE_POOL))
    assert s["blocks_free_at_end"] == s["blocks_total"] and s["swapped_copies_left"] == 0
    assert all(r.state is State.FINISHED and r.finish_reason == "length" for r in engine.requests.values())


@pytest.mark.points(1)
def test_huge_pool_never_preempts(run_workload):
    s = run_workload(num_blocks=HUGE_POOL).summary()
    assert s["preempted_recompute"] == s["preempted_swap"] == 0
    assert s["blocks_peak_used"] <= sum(demand_blocks(WORKLOAD))


# ---------------------------------------------------------------- chunked prefill


@pytest.mark.points(2)
@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_gives_the_same_ids(mode, run_workload):
    chunked = run_workload(mode, "lru", prefill_chunk=5)
    assert outputs(chunked) == outputs(run_workload(mode, "lru"))
    assert max(r.prefill_tokens for r in chunked.timeline) <= 5
    assert chunked.summary()["preempted_" + mode] > 0


@pytest.mark.points(2)
def test_a_long_prompt_is_prefilled_in_chunks(model, tiny_model_dir):
    """23 prompt tokens with chunks of 5: four full chunks, then 3, then decode steps."""
    item = WorkItem(random_prompt(23, 512, 7), 5)
    engine = make_engine(model, HUGE_POOL, BLOCK_SIZE, prefill_chunk=5)
    engine.run([item])
    assert [r.prefill_tokens for r in engine.timeline] == [5, 5, 5, 5, 3, 0, 0, 0, 0]
    assert [r.decode_tokens for r in engine.timeline] == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert engine.requests[0].output_ids == hf_alone(tiny_model_dir, item)


@pytest.mark.points(2)
def test_prefill_budget_counts_every_prompt_token(model, monkeypatch):
    """The cap holds for the prompt tokens actually computed in a step, one-token chunks included.

    Prompts of 4 with chunks of 5: the first request takes 4, leaving a budget of 1. The next
    request may take that 1 token, and then the budget is spent: nobody else starts this step.
    """
    engine = make_engine(model, HUGE_POOL, BLOCK_SIZE, prefill_chunk=5)
    computed = []  # per forward: prompt tokens computed (tokens of requests not decoding)
    real = engine.runner.forward_logits

    def counting(reqs, num_new):
        computed.append(sum(n for r, n in zip(reqs, num_new) if r.num_pending > 1))
        return real(reqs, num_new)

    monkeypatch.setattr(engine.runner, "forward_logits", counting)
    for i in range(6):
        engine.add_request(WorkItem(random_prompt(4, 512, 50 + i), 3))
    engine.step()
    assert sum(computed) == 5
    assert [r.cur_len for r in engine.requests.values()] == [4, 1, 0, 0, 0, 0]
    engine.run()
    assert all(r.finish_reason == "length" for r in engine.requests.values())


# ---------------------------------------------------------------- victims, through the scheduler


TINY_CFG = Qwen3Config(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4, rope_theta=1e4,
                       rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False)


def decoding_request(rid, prompt_len, num_out, max_new=10, **fields) -> EngineRequest:
    """A running request in its decode phase: every token but the newest has K/V (cur_len)."""
    req = EngineRequest(list(range(prompt_len)), max_new, request_id=rid, **fields)
    req.output_ids = [1] * num_out
    req.cur_len = len(req.tokens) - 1
    req.state = State.RUNNING
    return req


def hand_built(policy, reqs: list[EngineRequest], mode="recompute", watermark=1):
    """A scheduler whose pool is exactly full with `reqs`' blocks (each covers its cur_len)."""
    total = sum(blocks_needed(r.cur_len, BLOCK_SIZE) for r in reqs)
    alloc = BlockAllocator(total, BLOCK_SIZE)
    pool = BlockKvPool(TINY_CFG, total, BLOCK_SIZE, torch.float32)
    for r in reqs:
        reserve(r, alloc, r.cur_len)
    sched = Scheduler(KvManager(alloc, pool), policy, Preemptor(pool, alloc, mode), watermark_blocks=watermark)
    sched.running = list(reqs)
    assert alloc.num_free == 0
    return sched


def only_victim(sched, now) -> tuple[EngineRequest, list]:
    plan = sched.schedule(now)
    events = sched.preemptor.take_events()
    assert len(events) == 1, f"expected exactly one preemption, got {events}"
    return events[0], plan


# X is at a block boundary (cur_len 8 = 2 full blocks of 4) and needs a third block; every other
# request has room left in its last block. The pool has no free block, so X must take one.


# swap_out's and swap_in's own contract (the workload tests above cover their path as a whole).
@pytest.mark.points(3)
def test_swap_out_copies_only_the_blocks_holding_kv_and_swap_in_restores_them():
    """L5 §2.6: `trim` before the copy. A victim at cur_len 5 holding 3 blocks of 4 (the third reserved
    for tokens it never computed) sends 2 blocks to the host, in table order, and frees all 3."""
    alloc = BlockAllocator(6, BLOCK_SIZE)
    pool = BlockKvPool(TINY_CFG, 6, BLOCK_SIZE, torch.float32)
    for layer in range(TINY_CFG.num_hidden_layers):  # every block filled with its own id, K and -V
        for block in range(6):
            pool.k_blocks[layer][block] = block
            pool.v_blocks[layer][block] = -block
    alloc.alloc_blocks(1)  # block 0 taken, so the victim's ids are not 0, 1, 2
    victim = decoding_request(0, 5, 1)
    reserve(victim, alloc, 12)
    held = list(victim.blocks)
    preemptor = Preemptor(pool, alloc, "swap")
    preemptor.swap_out(victim)
    assert victim.state is State.SWAPPED and victim.blocks == [] and victim.cur_len == 5
    moved = 2 * bytes_per_block(TINY_CFG, BLOCK_SIZE, torch.float32)
    c = preemptor.counters
    assert (c.preempted_swap, c.bytes_swapped_out, c.bytes_swapped_in, c.tokens_recomputed) == (1, moved, 0, 0)
    assert alloc.num_free == 5, "all three blocks go back, the one reserved past cur_len included"
    for layer in range(TINY_CFG.num_hidden_layers):
        k, v = victim.swapped.k[layer], victim.swapped.v[layer]
        assert k.shape[0] == v.shape[0] == 2, "only ceil(cur_len / block_size) blocks travel: trim first"
        assert k[:, 0, 0, 0].tolist() == held[:2] and (-v[:, 0, 0, 0]).tolist() == held[:2]
    assert victim.swapped.nbytes == 2 * bytes_per_block(TINY_CFG, BLOCK_SIZE, torch.float32)
    for layer in range(TINY_CFG.num_hidden_layers):  # the freed blocks are reused and overwritten
        pool.k_blocks[layer].fill_(99.0)
        pool.v_blocks[layer].fill_(99.0)
    preemptor.swap_in(victim)
    assert victim.state is State.RUNNING and victim.swapped is None and len(victim.blocks) == 2
    assert (c.preempted_swap, c.bytes_swapped_out, c.bytes_swapped_in) == (1, moved, moved)
    for layer in range(TINY_CFG.num_hidden_layers):
        for new, old in zip(victim.blocks, held):
            assert bool((pool.k_blocks[layer][new] == old).all()) and bool((pool.v_blocks[layer][new] == -old).all())


# drop_for_recompute's own contract (L5 §2.6), checked on the request, the allocator and the counters.
@pytest.mark.points(3)
def test_drop_for_recompute_returns_every_block_and_sends_the_request_back_to_waiting():
    alloc = BlockAllocator(6, BLOCK_SIZE)
    pool = BlockKvPool(TINY_CFG, 6, BLOCK_SIZE, torch.float32)
    victim = decoding_request(0, 6, 2)  # cur_len 7 in blocks of 4: 2 blocks, and a third reserved
    reserve(victim, alloc, 12)
    preemptor = Preemptor(pool, alloc, "recompute")
    preemptor.drop_for_recompute(victim)
    assert victim.state is State.WAITING and victim.blocks == [] and victim.slot_indices == []
    assert victim.cur_len == 0 and victim.output_ids == [1, 1] and victim.num_preemptions == 0
    assert alloc.num_free == 6 and victim.swapped is None
    c = preemptor.counters
    assert (c.preempted_recompute, c.tokens_recomputed, c.preempted_swap, c.bytes_swapped_out) == (1, 7, 0, 0)


@pytest.mark.points(2)
@pytest.mark.parametrize("mode", MODES)
def test_lru_evicts_the_least_recently_scheduled(mode):
    reqs = [
        decoding_request(0, 8, 1, last_scheduled_step=9, arrival_step=5),  # X
        decoding_request(1, 6, 1, last_scheduled_step=8, arrival_step=0),
        decoding_request(2, 6, 2, last_scheduled_step=5, arrival_step=1),
        decoding_request(3, 6, 2, last_scheduled_step=5, arrival_step=3, priority=9),  # oldest turn, latest
        decoding_request(4, 14, 1, last_scheduled_step=6, arrival_step=2),
    ]
    sched = hand_built(lru_key, reqs, mode)
    victim_id, plan = only_victim(sched, now=10)
    assert victim_id == 3  # steps 5 and 5 tie; the later arrival (3 > 1) goes; priority is ignored
    victim = reqs[3]
    assert victim.blocks == [] and victim not in sched.running
    assert [r.request_id for r, _ in plan] == [0, 1, 4, 2]  # served most recently scheduled first
    assert len(reqs[0].blocks) == 3 and sched.kv.num_free == 1  # X got its block; 1 of 2 left over
    if mode == "swap":
        assert victim.state is State.SWAPPED and list(sched.swapped) == [victim]
        bpb = bytes_per_block(TINY_CFG, BLOCK_SIZE, torch.float32)
        assert victim.swapped.nbytes == 2 * bpb == sched.preemptor.counters.bytes_swapped_out
        assert victim.cur_len == 7  # its K/V is kept, on the host
    else:
        assert victim.state is State.WAITING and sched.waiting[0] is victim and victim.cur_len == 0
        assert sched.preemptor.counters.tokens_recomputed == 7


@pytest.mark.points(2)
def test_priority_evicts_the_lowest_priority_then_the_latest_arrival():
    reqs = [
        decoding_request(0, 8, 1, priority=9, arrival_step=6),  # X
        decoding_request(1, 6, 1, priority=2, arrival_step=0),
        decoding_request(2, 6, 2, priority=0, arrival_step=1),
        decoding_request(3, 6, 2, priority=0, arrival_step=4, last_scheduled_step=9),  # just ran: no matter
        decoding_request(4, 14, 1, priority=1, arrival_step=2),
    ]
    victim_id, _ = only_victim(hand_built(priority_key, reqs), now=10)
    assert victim_id == 3


def score_scenario():
    """X (priority 10) needs a block; A, B, C differ in progress, memory and age (now = 10).

        request  progress (out/max)  blocks (of 13)  arrival  age = (10 - arrival) / 11
        A        9/10 = 0.9          6               0        0.91
        B        1/10 = 0.1          2               2        0.73
        C        5/10 = 0.5          3               8        0.18
    """
    return [
        decoding_request(0, 8, 1, priority=10),  # X: 2 blocks
        decoding_request(1, 14, 9, arrival_step=0),  # A: cur_len 22, 6 blocks
        decoding_request(2, 6, 1, arrival_step=2),  # B: cur_len 6, 2 blocks
        decoding_request(3, 6, 5, arrival_step=8),  # C: cur_len 10, 3 blocks
    ]


@pytest.mark.points(3)
@pytest.mark.parametrize("weights,expected", [
    (dict(w_progress=1.0, w_age=0.0, w_memory=0.0), 2),  # least progress: B (0.1)
    (dict(w_progress=0.0, w_age=0.0, w_memory=1.0), 1),  # most memory: A (-6/13)
    (dict(w_progress=0.0, w_age=1.0, w_memory=0.0), 3),  # youngest: C (0.18)
    (dict(), 2),  # defaults 0.5 / 0.25 / 0.25: A 0.562, B 0.193, C 0.238 -> B
], ids=["progress", "memory", "age", "defaults"])
def test_score_policy_weights_change_the_victim(weights, expected):
    reqs = score_scenario()
    policy = ScorePolicy(num_blocks=13, w_priority=1.0, **weights)
    victim_id, _ = only_victim(hand_built(policy, reqs), now=10)
    assert victim_id == expected


def test_make_policy_names_and_score_defaults():
    assert make_policy("lru", 8) is lru_key and make_policy("priority", 8) is priority_key
    score = make_policy("score", 8)
    assert isinstance(score, ScorePolicy) and score.num_blocks == 8
    assert (score.w_priority, score.w_progress, score.w_age, score.w_memory) == (1.0, 0.5, 0.25, 0.25)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo", 8)


# _make_room's other path, as heavy as the victims': a request with nobody left to evict yields.
@pytest.mark.points(6)
@pytest.mark.parametrize("mode", MODES)
def test_a_request_with_nobody_left_to_evict_preempts_itself(mode):
    """Y was scheduled more recently and is served first; X, last, finds no block and no one
    left below it in the order: X yields its own blocks rather than taking Y's."""
    y = decoding_request(0, 6, 1, last_scheduled_step=9)
    x = decoding_request(1, 8, 1, last_scheduled_step=5)
    sched = hand_built(lru_key, [y, x], mode=mode)
    plan = sched.schedule(now=10)
    assert plan == [(y, 1)] and sched.preemptor.take_events() == [1]
    preempted = State.SWAPPED if mode == "swap" else State.WAITING
    assert x.state is preempted and x.blocks == [] and sched.kv.num_free == 2


# Making room victim after victim until the request fits is _make_room's whole job: most of its points.
@pytest.mark.points(3)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("victims_needed", [2, 3])
def test_a_prefill_chunk_preempts_as_many_victims_as_it_takes(victims_needed, mode):
    """P prefills a chunk that needs `victims_needed` more blocks of 4; the pool is full and each
    victim holds one block: room is made victim after victim, least recently scheduled first,
    until the chunk fits (an `if` where the `while` belongs frees one block and then runs out)."""
    chunk = BLOCK_SIZE * victims_needed
    p = EngineRequest(list(range(20)), 4, request_id=0, last_scheduled_step=9)
    p.cur_len, p.state = 4, State.RUNNING
    victims = [decoding_request(1 + i, 3, 1, last_scheduled_step=5 - i) for i in range(victims_needed)]
    alloc = BlockAllocator(1 + victims_needed, BLOCK_SIZE)
    for r in [p, *victims]:
        reserve(r, alloc, r.cur_len)
    pool = BlockKvPool(TINY_CFG, 1 + victims_needed, BLOCK_SIZE, torch.float32)
    sched = Scheduler(KvManager(alloc, pool), lru_key, Preemptor(pool, alloc, mode), prefill_chunk=chunk, watermark_blocks=1)
    sched.running = [p, *victims]
    plan = sched.schedule(now=10)
    assert plan == [(p, chunk)]
    assert sched.preemptor.take_events() == [v.request_id for v in reversed(victims)]  # oldest first
    assert len(p.blocks) == 1 + victims_needed and alloc.num_free == 0
    preempted = State.SWAPPED if mode == "swap" else State.WAITING
    assert all(v.state is preempted and v.blocks == [] for v in victims)


# ---------------------------------------------------------------- admission: watermark, too large


def watermark_engine(model, watermark):
    """R runs (3 of 8 blocks); at step 1, W needs 5 blocks: exactly what is free."""
    engine = make_engine(model, 8, BLOCK_SIZE, watermark_blocks=watermark)
    r = engine.add_request(WorkItem(random_prompt(9, 512, 1), 4))
    w = engine.add_request(WorkItem(random_prompt(20, 512, 2), 4, arrival_step=1))
    return engine, r, w


@pytest.mark.points(2)
def test_watermark_keeps_admission_off_the_last_free_blocks(model, tiny_model_dir):
    engine, r, w = watermark_engine(model, watermark=1)
    engine.step()
    engine.step()
    assert r.state is State.RUNNING and w.state is State.WAITING  # 5 free - 5 = 0 < watermark 1
    assert engine.alloc.num_free == 5
    engine.run()
    assert engine.summary()["preempted_recompute"] == 0  # W started after R was done
    assert w.output_ids == hf_alone(tiny_model_dir, WorkItem(w.prompt_ids, 4))

    engine, r, w = watermark_engine(model, watermark=0)
    engine.step()
    engine.step()
    assert r.state is State.RUNNING and w.state is State.RUNNING and engine.alloc.num_free == 0


@pytest.mark.points(1)
def test_with_nobody_running_a_request_may_take_the_whole_pool(model, tiny_model_dir):
    engine = make_engine(model, 8, BLOCK_SIZE, watermark_blocks=2)
    big = WorkItem(random_prompt(29, 512, 3), 3)  # its prompt alone fills 8 of 8 blocks
    req = engine.add_request(big)
    engine.step()
    assert req.state is State.RUNNING and engine.alloc.num_free == 0
    engine.run()
    assert req.output_ids == hf_alone(tiny_model_dir, big)


def engine_state(engine):
    s = engine.scheduler
    return (sorted(engine.requests), [r.request_id for r in s.waiting], [r.request_id for r in s.running],
            [r.request_id for r in s.swapped], [r.request_id for r in engine.future],
            list(engine.alloc.free_blocks), engine.now)


@pytest.mark.points(3)
@pytest.mark.parametrize("arrival", [0, 2], ids=["now", "later"])
def test_a_request_larger_than_the_pool_is_rejected_cleanly(arrival, model, tiny_model_dir):
    engine = make_engine(model, 8, BLOCK_SIZE)  # 32 positions
    others = [WorkItem(random_prompt(10, 512, 11), 6), WorkItem(random_prompt(5, 512, 12), 6, arrival_step=1)]
    for item in others:
        engine.add_request(item)
    engine.step()
    before = engine_state(engine)
    with pytest.raises(RequestTooLargeError) as exc:
        engine.add_request(WorkItem(random_prompt(30, 512, 13), 5, arrival_step=arrival))  # 35 positions
    message = str(exc.value)
    assert isinstance(exc.value, InputError) and "\n" not in message
    assert "9 blocks" in message and "8" in message
    assert engine_state(engine) == before
    # The largest request that does fit (20 + 12 = 32 positions = the whole pool) is accepted.
    fits = WorkItem(random_prompt(20, 512, 14), 12, arrival_step=arrival)
    engine.add_request(fits)
    engine.run()
    for item, req in zip(others + [fits], engine.requests.values()):
        assert req.output_ids == hf_alone(tiny_model_dir, item)
    assert engine.alloc.num_free == 8


@pytest.mark.points(1)
@pytest.mark.parametrize("prompt,max_new", [([], 4), ([1, 2, 3], 0)], ids=["empty prompt", "no new tokens"])
def test_a_request_with_nothing_to_do_is_rejected(prompt, max_new, model, tiny_model_dir):
    """An empty prompt would never be scheduled and, at the head of the queue, would block everyone
    behind it; max_new_tokens = 0 would still make one token."""
    engine = make_engine(model, 8, BLOCK_SIZE)
    other = WorkItem(random_prompt(5, 512, 15), 4)
    engine.add_request(other)
    before = engine_state(engine)
    with pytest.raises(InputError, match="at least 1 of each"):
        engine.add_request(WorkItem(prompt, max_new))
    assert engine_state(engine) == before
    engine.run(max_steps=50)
    assert engine.requests[0].output_ids == hf_alone(tiny_model_dir, other)


# ---------------------------------------------------------------- finish reasons


@pytest.mark.points(2)
def test_finish_reasons(model, tiny_model_dir, make_model):
    prompt = random_prompt(9, 512, 21)
    full = hf_alone(tiny_model_dir, WorkItem(prompt, 8))
    stop_at = next(i for i in range(2, 8) if full[i] not in full[:i])
    engine = make_engine(model, 32, BLOCK_SIZE)
    by_stop = engine.add_request(WorkItem(prompt, 8, stop_token_ids=(full[stop_at],)))
    by_length = engine.add_request(WorkItem(prompt, 5))
    aborted = engine.add_request(WorkItem(prompt, 8))
    engine.step()
    engine.abort(aborted.request_id)
    engine.run()
    assert (by_stop.finish_reason, by_stop.output_ids) == ("stop", full[:stop_at + 1])  # stop id kept
    assert (by_length.finish_reason, by_length.output_ids) == ("length", full[:5])
    assert (aborted.finish_reason, aborted.output_ids) == ("aborted", full[:1])

    # EOS comes from the model's config: the same random weights with full[stop_at] as its EOS id.
    eos_dir = make_model(eos_token_id=full[stop_at])
    eos_engine = make_engine(load_engine_model(eos_dir), 32, BLOCK_SIZE)
    by_eos = eos_engine.add_request(WorkItem(prompt, 8))
    eos_engine.run()
    assert (by_eos.finish_reason, by_eos.output_ids) == ("eos", full[:stop_at + 1])
    assert by_eos.output_ids == hf_ids(eos_dir, prompt, 8)  # HF stops there too
    assert eos_engine.alloc.num_free == 32 == engine.alloc.num_free


# ---------------------------------------------------------------- counters and timeline


@pytest.mark.points(3)
@pytest.mark.parametrize("mode", MODES)
def test_counters_and_timeline(mode, model):
    engine = make_engine(model, quarter_pool(WORKLOAD), BLOCK_SIZE, preempt=mode)
    for item in WORKLOAD:
        engine.add_request(item)
    s = engine.scheduler
    while engine.has_unfinished():
        record = engine.step()
        assert record is engine.timeline[-1] and record.step == engine.now - 1
        assert record.blocks_used + record.blocks_free == engine.alloc.num_blocks
        assert record.blocks_used == sum(len(r.blocks) for r in engine.requests.values())
        assert (record.running, record.waiting, record.swapped) == (len(s.running), len(s.waiting), len(s.swapped))
        finished = sum(r.state is State.FINISHED for r in engine.requests.values())
        assert record.running + record.waiting + record.swapped + finished + len(engine.future) == len(WORKLOAD)
        assert record.swapped == sum(r.state is State.SWAPPED for r in engine.requests.values())
    c, reqs = engine.preemptor.counters, engine.requests.values()
    events = [rid for record in engine.timeline for rid in record.preempted]
    assert len(events) == c.preempted_recompute + c.preempted_swap == sum(r.num_preemptions for r in reqs) > 0
    # Every K/V entry computed is either still counted in cur_len at the end or was dropped to
    # be recomputed: work done = final cached lengths + tokens_recomputed.
    computed = sum(r.prefill_tokens + r.decode_tokens for r in engine.timeline)
    assert computed == sum(r.cur_len for r in reqs) + c.tokens_recomputed
    if mode == "swap":
        assert c.preempted_recompute == 0 and c.tokens_recomputed == 0
        bpb = bytes_per_block(model.config, BLOCK_SIZE, model.dtype)
        assert c.bytes_swapped_out == c.bytes_swapped_in > 0 and c.bytes_swapped_out % bpb == 0
        assert max(r.swapped for r in engine.timeline) > 0
    else:
        assert c.preempted_swap == 0 and c.bytes_swapped_out == c.bytes_swapped_in == 0
        assert c.tokens_recomputed > 0
    assert engine.summary()["blocks_peak_used"] == engine.alloc.num_blocks
    assert max(r.blocks_used for r in engine.timeline) == engine.alloc.num_blocks


def test_engine_rejects_unknown_mode_and_policy(model):
    with pytest.raises(ValueError, match="recompute or swap"):
        make_engine(model, 8, BLOCK_SIZE, preempt="drop")
    with pytest.raises(ValueError, match="lru, priority or score"):
        make_engine(model, 8, BLOCK_SIZE, policy="fifo")
    with pytest.raises(ValueError, match="prefill_chunk"):
        make_engine(model, 8, BLOCK_SIZE, prefill_chunk=0)
    with pytest.raises(ValueError, match="watermark_blocks"):
        make_engine(model, 8, BLOCK_SIZE, watermark_blocks=-1)


def test_an_engine_that_leaks_blocks_fails_fast_with_a_diagnosis(model, monkeypatch):
    """A swap-out that never gives its blocks back (a student bug): the pool drains, nothing can
    run, and `run` must say so within STALL_STEPS steps, not spin until the test's time limit."""
    import time

    from l5_eviction import EngineStalledError
    from l5_eviction.engine import STALL_STEPS

    def swap_out_keeping_blocks(self, req):
        req.swapped = None
        req.blocks, req.slot_indices = [], []  # forgets them without freeing them
        req.state = State.SWAPPED
        self.counters.preempted_swap += 1

    monkeypatch.setattr(Preemptor, "swap_out", swap_out_keeping_blocks)
    monkeypatch.setattr(Preemptor, "blocks_to_swap_in", lambda self, req: 1)
    monkeypatch.setattr(Preemptor, "swap_in", lambda self, req: None)
    engine = make_engine(model, quarter_pool(WORKLOAD), BLOCK_SIZE, preempt="swap")
    started = time.monotonic()
    with pytest.raises(EngineStalledError, match=rf"no token computed in {STALL_STEPS} steps .* blocks free"):
        engine.run(WORKLOAD, max_steps=100_000)
    assert time.monotonic() - started < 60 and engine.now < 10 * STALL_STEPS
