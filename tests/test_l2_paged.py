"""L2: the paged pool inside the model: several requests decoded together must equal HF alone,
garbage in unwritten slots must never reach a softmax, and every block must come back."""

from __future__ import annotations

import pytest
import torch

from harness import hf_reference as hf
from helpers import check_the_pool_is_the_cache, hf_ids, random_prompt
from probes_l2 import Layer0Attention
from l1_contiguous import Qwen3ForCausalLM, greedy_generate
from l2_paged import (BlockAllocator, KvPool, OutOfBlocksError, PagedAttention, PagedRunner, Request,
                      load_paged_model, reserve)

pytestmark = [pytest.mark.l2]


def make_runner(model_dir, num_blocks=64, block_size=4, nan=True, attention_cls=PagedAttention):
    """A runner on a fresh pool; nan=True poisons every slot first (the pool is torch.empty)."""
    model = load_paged_model(model_dir, attention_cls=attention_cls)
    pool = KvPool(model.config, num_blocks, block_size, torch.float32)
    if nan:
        for t in pool.K + pool.V:
            t.fill_(float("nan"))
    return PagedRunner(model, pool, BlockAllocator(num_blocks, block_size))


def make_requests(vocab_size, lengths, max_new, seed=0):
    return [Request(random_prompt(n, vocab_size, seed + i), max_new_tokens=m, request_id=i)
            for i, (n, m) in enumerate(zip(lengths, max_new))]


def check_all_free(runner: PagedRunner) -> None:
    alloc = runner.alloc
    assert alloc.num_free == alloc.num_blocks and sorted(alloc.free_blocks) == list(range(alloc.num_blocks))


# ---------------------------------------------------------------- against HF

@pytest.mark.points(3)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_nan_filled_pool_still_equals_hf(tiny_model_dir, block_size):
    """Unwritten slots hold NaN; one NaN gathered into attention would poison the output (0 * NaN = NaN)."""
    runner = make_runner(tiny_model_dir, num_blocks=96 // block_size + 8, block_size=block_size)
    reqs = make_requests(runner.model.config.vocab_size, [5, 13, 2], [7, 4, 9])
    runner.generate(reqs)
    for r in reqs:
        assert r.output_ids == hf_ids(tiny_model_dir, r.prompt_ids, r.max_new_tokens), r.request_id
    check_all_free(runner)
    pool = runner.pool
    assert torch.isnan(pool.K[0]).any()  # the pool was never cleaned: slots nobody wrote are still NaN


@pytest.mark.points(2)
def test_the_pool_holds_hf_s_k_and_v_of_each_position_and_decode_reads_it(tiny_model_dir):
    check_the_pool_is_the_cache(tiny_model_dir, lambda: make_runner(tiny_model_dir))


@pytest.mark.points(4)
def test_batched_ragged_decode_equals_each_request_alone_and_hf(tiny_model_dir):
    lengths, max_new = [1, 7, 16, 17, 40], [12, 3, 9, 1, 6]  # different prompts and stop points
    runner = make_runner(tiny_model_dir, num_blocks=40, block_size=4)
    reqs = make_requests(runner.model.config.vocab_size, lengths, max_new, seed=10)
    runner.generate(reqs)
    l1 = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    for r in reqs:
        alone = greedy_generate(l1, r.prompt_ids, r.max_new_tokens).new_ids
        assert r.output_ids == alone == hf_ids(tiny_model_dir, r.prompt_ids, r.max_new_tokens), r.request_id
        assert len(r.output_ids) == r.max_new_tokens
    check_all_free(runner)


@pytest.mark.points(2)
def test_logits_of_every_step_match_hf(tiny_model_dir):
    runner = make_runner(tiny_model_dir)
    reqs = make_requests(runner.model.config.vocab_size, [6, 11, 3], [4, 2, 5], seed=20)
    rows = {r.request_id: [] for r in reqs}
    real = runner.forward_logits

    def recording(batch, num_new):
        logits = real(batch, num_new)
        for r, row in zip(batch, logits):
            rows[r.request_id].append(row.clone())
        return logits

    runner.forward_logits = recording
    runner.generate(reqs)
    hf_model = hf.load_hf_model(str(tiny_model_dir))
    for r in reqs:  # the prefill row predicts new token 0, decode step i predicts token i
        ref = hf.greedy_step_logits(hf_model, r.prompt_ids, r.output_ids)
        torch.testing.assert_close(torch.stack(rows[r.request_id]), ref, rtol=0, atol=1e-4)


@pytest.mark.points(2)
def test_reused_blocks_are_not_cleaned_and_do_not_need_to_be(tiny_model_dir):
    runner = make_runner(tiny_model_dir, num_blocks=12, block_size=4)
    vocab = runner.model.config.vocab_size
    first = make_requests(vocab, [9, 14], [6, 5], seed=30)
    runner.generate(first)
    used_first = {b for owners in runner.stats.owners for blocks in owners.values() for b in blocks}
    first_slots = runner.pool.K[1][[4 * b for b in sorted(used_first)]]
    assert torch.isfinite(first_slots).all()  # those blocks now hold the first batch's keys
    steps_before = len(runner.stats.owners)
    second = make_requests(vocab, [11, 4, 7], [5, 8, 3], seed=40)
    runner.generate(second)  # the same pool and allocator: blocks come back holding old K/V
    used_second = {b for owners in runner.stats.owners[steps_before:] for blocks in owners.values()
                   for b in blocks}
    assert used_first & used_second  # the second batch really did reuse dirty blocks
    for r in second:
        assert r.output_ids == hf_ids(tiny_model_dir, r.prompt_ids, r.max_new_tokens)
    check_all_free(runner)


# ---------------------------------------------------------------- the outline's pitfalls

@pytest.mark.points(2)
def test_cur_len_after_prefill_is_t_not_t_plus_1(tiny_model_dir):
    runner = make_runner(tiny_model_dir)
    reqs = make_requests(runner.model.config.vocab_size, [5, 9], [4, 4])
    runner.forward(reqs, [5, 9])
    assert [r.cur_len for r in reqs] == [5, 9]  # the token just picked has no K/V yet
    for r, token in zip(reqs, [1, 2]):
        r.output_ids.append(token)
    runner.forward(reqs, [1, 1])
    assert [r.cur_len for r in reqs] == [6, 10]


def test_an_off_by_one_cur_len_would_be_caught(tiny_model_dir, monkeypatch):
    runner = make_runner(tiny_model_dir)
    real = PagedRunner.forward_logits

    def off_by_one(self, reqs, num_new):
        out = real(self, reqs, num_new)
        for r, n in zip(reqs, num_new):
            r.cur_len += n > 1  # the bug: T + 1 after prefill
        return out

    monkeypatch.setattr(PagedRunner, "forward_logits", off_by_one)
    reqs = make_requests(runner.model.config.vocab_size, [6, 10], [5, 5], seed=3)
    try:
        runner.generate(reqs)
    except RuntimeError:  # here the next token is sliced from tokens[cur_len:], which is now empty
        return
    assert any(r.output_ids != hf_ids(tiny_model_dir, r.prompt_ids, 5) for r in reqs)


@pytest.mark.points(1)
def test_kv_indices_must_be_1d(tiny_model_dir, monkeypatch):
    runner = make_runner(tiny_model_dir)
    reqs = make_requests(runner.model.config.vocab_size, [4, 7], [3, 3], seed=5)
    for r in reqs:
        reserve(r, runner.alloc, len(r.prompt_ids))
    ids, meta = runner.build_meta(reqs, [4, 7])
    assert meta.kv_indices.dim() == 1 and meta.kv_indices.numel() == 11
    # With extra brackets the gather gives [1, S, H_kv, D] instead of [S, H_kv, D]: the forward breaks.
    real = PagedRunner.build_meta

    def bracketed(self, reqs, num_new):
        ids, meta = real(self, reqs, num_new)
        meta.kv_indices = meta.kv_indices[None, :]
        return ids, meta

    monkeypatch.setattr(PagedRunner, "build_meta", bracketed)
    try:
        runner.generate(reqs)
    except RuntimeError:
        return
    assert any(r.output_ids != hf_ids(tiny_model_dir, r.prompt_ids, 3) for r in reqs)


@pytest.mark.points(2)
def test_each_attention_layer_writes_its_own_layer(tiny_model_dir):
    runner = make_runner(tiny_model_dir, num_blocks=8, block_size=4)
    reqs = make_requests(runner.model.config.vocab_size, [6], [1])
    runner.forward(reqs, [6])
    slots = torch.tensor(reqs[0].slot_indices[:6])
    pool = runner.pool
    for layer in range(runner.model.config.num_hidden_layers):
        assert torch.isfinite(pool.K[layer][slots]).all() and torch.isfinite(pool.V[layer][slots]).all()
        others = torch.ones(pool.num_slots, dtype=torch.bool)
        others[slots] = False
        assert torch.isnan(pool.K[layer][others]).all()  # nothing written outside slot_mapping
    assert not torch.equal(pool.K[0][slots], pool.K[1][slots])  # distinct data per layer
    # A model whose layers all use layer 0 must not pass the comparison with HF.
    bad = make_runner(tiny_model_dir, attention_cls=Layer0Attention)
    reqs = make_requests(bad.model.config.vocab_size, [8, 12], [6, 6], seed=7)
    bad.generate(reqs)
    assert any(r.output_ids != hf_ids(tiny_model_dir, r.prompt_ids, 6) for r in reqs)


@pytest.mark.points(1)
def test_indices_reaching_the_pool_are_int64(tiny_model_dir, monkeypatch):
    runner = make_runner(tiny_model_dir)
    seen = []
    real = KvPool.set_kv

    def spy(self, layer, slot_mapping, k, v):
        seen.append(slot_mapping.dtype)
        return real(self, layer, slot_mapping, k, v)

    monkeypatch.setattr(KvPool, "set_kv", spy)
    reqs = make_requests(runner.model.config.vocab_size, [3, 5], [3, 2])
    runner.generate(reqs)
    assert seen and set(seen) == {torch.int64}


# ---------------------------------------------------------------- running out, giving back

@pytest.mark.points(3)
def test_pool_exhaustion_mid_run_leaves_the_allocator_intact(tiny_model_dir):
    runner = make_runner(tiny_model_dir, num_blocks=3, block_size=4)
    alloc = runner.alloc
    # Prefill: 1 block each (2 of 3). First decode step: both reach position 4 and need a 2nd block,
    # 2 blocks for the step with 1 free: the step reserves nothing at all (all or nothing).
    reqs = make_requests(runner.model.config.vocab_size, [4, 4], [3, 3])
    with pytest.raises(OutOfBlocksError) as info:
        runner.generate(reqs)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert "asked for 2" in str(info.value) and "only 1 are free" in str(info.value)
    a, b = reqs
    assert len(a.blocks) == len(b.blocks) == 1 and len(a.slot_indices) == len(b.slot_indices) == 4
    held = a.blocks + b.blocks
    assert sorted(held + alloc.free_blocks) == [0, 1, 2] and alloc.num_used == len(held) == 2
    for r in reqs:  # the caller can still clean up: every block comes back
        alloc.free(r.blocks)
    check_all_free(runner)


@pytest.mark.points(3)
def test_blocks_are_freed_at_finish_and_counters_match_a_hand_computed_run(tiny_model_dir):
    """The worked example of lessons/L2-paged.md: block size 4, a pool of 8 blocks.

    A: 3-token prompt, 2 new tokens. B: 6-token prompt, 5 new. C: 9-token prompt, 3 new.
    step      writes (position -> slot)             blocks after the step         used  wasted
    prefill   A 0-2 -> 0-2, B 0-5 -> 4-9, C 0-8 -> 12-20  A [0] B [1,2] C [3,4,5]  6     1+2+3
    decode 1  A 3->3, B 6->10, C 9->21              A done: block 0 back          5     1+2
    decode 2  B 7->11, C 10->22                     C done: 3, 4, 5 back          2     0
    decode 3  B 8->20 (C's freed block 5, dirty)    B [1,2,5]                     3     3
    decode 4  B 9->21                               B done                        0     0
    """
    runner = make_runner(tiny_model_dir, num_blocks=8, block_size=4)
    metas = []
    real = runner.build_meta

    def recording(reqs, num_new):
        ids, meta = real(reqs, num_new)
        metas.append(meta)
        return ids, meta

    runner.build_meta = recording
    reqs = make_requests(runner.model.config.vocab_size, [3, 6, 9], [2, 5, 3], seed=50)
    runner.generate(reqs)
    stats = runner.stats
    assert stats.owners == [{0: [0], 1: [1, 2], 2: [3, 4, 5]}, {1: [1, 2], 2: [3, 4, 5]}, {1: [1, 2]},
                            {1: [1, 2, 5]}, {}]  # after decode 1 A is gone; after decode 2 C is gone
    assert stats.blocks_used == [6, 5, 2, 3, 0]
    assert stats.wasted_slots == [6, 3, 0, 3, 0]
    assert runner.alloc.peak_used == 6 and max(stats.wasted_slots) == 6
    assert [m.slot_mapping.tolist() for m in metas[1:]] == [[3, 10, 21], [11, 22], [20], [21]]
    assert metas[0].slot_mapping.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, *range(12, 21)]
    assert metas[3].kv_indices.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 20]  # never C's stale 21, 22
    assert [len(r.output_ids) for r in reqs] == [2, 5, 3] and all(r.blocks == [] for r in reqs)
    for r in reqs:
        assert r.output_ids == hf_ids(tiny_model_dir, r.prompt_ids, r.max_new_tokens)
    check_all_free(runner)


@pytest.mark.points(1)
def test_a_stop_id_finishes_a_request_early_and_frees_its_blocks(tiny_model_dir):
    vocab = load_paged_model(tiny_model_dir).config.vocab_size
    runner = make_runner(tiny_model_dir, num_blocks=16, block_size=4)
    free_run = make_requests(vocab, [5, 8], [10, 10], seed=60)
    runner.generate(free_run)  # the tiny model has no EOS: both make 10 tokens
    stop = free_run[0].output_ids[2]  # call A's third token a stop id and run again
    runner = make_runner(tiny_model_dir, num_blocks=16, block_size=4)
    runner.stop_ids = {stop}
    a, b = make_requests(vocab, [5, 8], [10, 10], seed=60)
    runner.generate([a, b])
    end = free_run[0].output_ids.index(stop)
    assert a.output_ids == free_run[0].output_ids[:end + 1]  # the stop id is kept, as HF keeps EOS
    assert a.finished and a.request_id not in runner.stats.owners[end]  # its blocks went back at once
    check_all_free(runner)
