"""L2: the bookkeeping without a model: the block allocator, reserve(), ForwardMeta, the ragged mask,
and sizing the pool from bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.smoke import DEFAULT_MODEL
from helpers import budget
from harness.tiny_models import QWEN3_0_6B
from l1_contiguous import InputError, Qwen3Config, load_config
from l2_paged import (BlockAllocator, OutOfBlocksError, Request, build_meta, bytes_per_block,
                      num_blocks_for_budget, parse_size, ragged_causal_mask, release, reserve)

pytestmark = [pytest.mark.l2]


def snapshot(alloc: BlockAllocator):
    """Everything a rejected call must leave as it was."""
    return list(alloc.free_blocks), alloc.num_free, alloc.num_used, alloc.peak_used


# ---------------------------------------------------------------- the allocator
# These tests and the property test below take the class from the `allocator_cls` fixture:
# `pytest tests/test_l2_allocator.py -k allocator --allocator-class mymodule:MyAllocator` runs them
# against another implementation of the same interface (L2 exercise 3).


# alloc_blocks' whole contract in one life of an allocator: most of its points, so that breaking any
# one rule (ids, counts, the peak, a refused call that changes nothing) costs more than half.
@pytest.mark.points(7)
def test_fresh_allocator_hands_out_distinct_ids_and_takes_them_back(allocator_cls):
    alloc = allocator_cls(num_blocks=6, block_size=16)
    assert (alloc.num_free, alloc.num_used) == (6, 0)
    a, b = alloc.alloc_blocks(2), alloc.alloc_blocks(3)
    assert a == [0, 1] and b == [2, 3, 4]  # a fresh allocator counts up: easy to read in a block map
    assert (alloc.num_free, alloc.num_used, alloc.peak_used) == (1, 5, 5)
    alloc.free(a)  # handed-out blocks are used: giving them back is not a double free
    assert (alloc.num_free, alloc.num_used, alloc.peak_used) == (3, 3, 5)  # peak remembers the high mark
    for bad, error in ((-1, ValueError), (4, OutOfBlocksError)):
        before = snapshot(alloc)
        with pytest.raises(error):
            alloc.alloc_blocks(bad)
        assert snapshot(alloc) == before
    assert sorted(alloc.alloc_blocks(3)) == [0, 1, 5]  # freed ids are handed out again, to the last one
    assert alloc.alloc_blocks(0) == [] and (alloc.num_free, alloc.peak_used) == (0, 6)
    alloc.free(b)


# All or nothing when the pool runs dry is alloc_blocks' hard part: most of its points.
@pytest.mark.points(4)
def test_running_out_raises_the_dedicated_error_and_changes_nothing(allocator_cls):
    alloc = allocator_cls(4, 16)
    alloc.alloc_blocks(3)
    before = snapshot(alloc)
    with pytest.raises(OutOfBlocksError) as info:
        alloc.alloc_blocks(2)
    assert isinstance(info.value, RuntimeError)  # later lessons catch the subclass, scripts the base
    assert (info.value.requested, info.value.free) == (2, 1)
    assert "asked for 2" in str(info.value) and "only 1 are free" in str(info.value)
    assert snapshot(alloc) == before
    assert alloc.alloc_blocks(1) == [3]  # the last block is still there to take


def check_free_refused(allocator_cls, bad) -> None:
    alloc = allocator_cls(4, 16)
    alloc.alloc_blocks(1)  # block 0 is used, 1..3 free
    before = snapshot(alloc)
    with pytest.raises(ValueError):
        alloc.free(bad)
    assert snapshot(alloc) == before


# A double free is the bug a pool cannot survive (two requests end up writing one block): it
# carries most of `free`'s points.
@pytest.mark.points(3)
@pytest.mark.parametrize("bad", [[1], [0, 0]], ids=["already-free", "twice-in-one-call"])
def test_double_free_is_rejected_without_a_trace(allocator_cls, bad):
    check_free_refused(allocator_cls, bad)


UNKNOWN_IDS = [-1, 4, 10**6, "2", 2.0, None, True]  # 4 is one past the end of a 4-block pool


@pytest.mark.points(1)
def test_free_rejects_unknown_ids_without_a_trace(allocator_cls):
    for bad in UNKNOWN_IDS:
        check_free_refused(allocator_cls, [bad])


# free's whole contract on one allocator: most of its points, so that any one rule broken (a
# double free, a repeat in one call, an unknown id, a bad id after good ones) costs more than half.
@pytest.mark.points(10)
def test_free_refuses_every_bad_call_and_changes_nothing(allocator_cls):
    alloc = allocator_cls(4, 16)
    owned = alloc.alloc_blocks(3)  # 3 is free
    bad_calls = [[3], [owned[0], owned[0]], [owned[1], owned[0], owned[1]], *([b] for b in UNKNOWN_IDS),
                 [owned[0], owned[1], 3], [owned[2], 4], [owned[0], None]]
    for bad in bad_calls:
        before = snapshot(alloc)
        with pytest.raises(ValueError):
            alloc.free(bad)
        assert snapshot(alloc) == before, f"free({bad!r}) was refused but changed the allocator"
    alloc.free([owned[2], owned[0]])
    assert sorted(alloc.free_blocks) == [0, 2, 3] and alloc.num_used == 1
    alloc.free([owned[1]])
    assert sorted(alloc.free_blocks) == [0, 1, 2, 3]


@pytest.mark.points(1)
def test_a_bad_id_anywhere_in_the_list_frees_none_of_it(allocator_cls):
    alloc = allocator_cls(4, 16)
    owned = alloc.alloc_blocks(3)
    before = snapshot(alloc)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([owned[0], owned[1], 3])  # 3 was never handed out
    assert snapshot(alloc) == before


@pytest.mark.points(1)
def test_allocator_rejects_bad_sizes_and_negative_counts(allocator_cls):
    for blocks, size in ((0, 16), (4, 0), (-1, 16)):
        with pytest.raises(ValueError):
            allocator_cls(blocks, size)
    alloc = allocator_cls(4, 16)
    with pytest.raises(ValueError):
        alloc.alloc_blocks(-1)
    assert alloc.num_free == 4


def check_invariants(alloc: BlockAllocator, owned: list[list[int]], peak: int) -> None:
    held = [b for group in owned for b in group]
    assert alloc.num_free + alloc.num_used == alloc.num_blocks  # free + used = total
    assert alloc.num_used == len(held)
    assert len(set(alloc.free_blocks)) == len(alloc.free_blocks)  # no id twice in the free list
    assert len(set(held)) == len(held)  # no id handed out twice
    assert set(alloc.free_blocks) | set(held) == set(range(alloc.num_blocks))
    assert not set(alloc.free_blocks) & set(held)
    assert alloc.peak_used == peak


OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 10)),
    st.tuples(st.just("free"), st.integers(0, 99), st.integers(1, 10)),  # a group, how many of it
    st.tuples(st.just("double_free"), st.integers(0, 99)),  # an owned id with a free one
    st.tuples(st.just("repeat"), st.integers(0, 99)),  # the same owned id twice in one call
    st.tuples(st.just("unknown"), st.sampled_from([-1, -100, 16, 17, 10**9])),
), max_size=50)


@pytest.mark.points(3)
@settings(max_examples=budget(150, 40), deadline=None)
@given(num_blocks=st.integers(1, 16), ops=OPS)
def test_random_alloc_free_sequences_keep_every_invariant(allocator_cls, num_blocks, ops):
    """Runs against `--allocator-class MODULE:CLASS` when given (L2 exercise 3)."""
    alloc = allocator_cls(num_blocks, 4)
    owned: list[list[int]] = []  # what the "requests" hold, as the test's own model
    peak = 0
    for op in ops:
        before = snapshot(alloc)
        kind = op[0]
        if kind == "alloc":
            n = op[1]
            if n > alloc.num_free:
                with pytest.raises(OutOfBlocksError):
                    alloc.alloc_blocks(n)
                assert snapshot(alloc) == before
            else:
                owned.append(alloc.alloc_blocks(n))
                peak = max(peak, sum(map(len, owned)))
        elif kind == "free" and owned:
            group = owned[op[1] % len(owned)]
            give_back, keep = group[:op[2]], group[op[2]:]
            alloc.free(give_back)
            group[:] = keep
        elif kind in ("double_free", "repeat") and any(owned):
            held = [b for g in owned for b in g]
            victim = held[op[1] % len(held)]
            if kind == "double_free" and alloc.free_blocks:
                bad = [victim, alloc.free_blocks[op[1] % alloc.num_free]]
            else:
                bad = [victim, victim]
            with pytest.raises(ValueError):
                alloc.free(bad)
            assert snapshot(alloc) == before
        elif kind == "unknown" and not 0 <= op[1] < num_blocks:
            with pytest.raises(ValueError):
                alloc.free([op[1]])
            assert snapshot(alloc) == before
        check_invariants(alloc, owned, peak)
    for group in owned:
        alloc.free(group)
    assert sorted(alloc.free_blocks) == list(range(num_blocks))


# ---------------------------------------------------------------- reserve

@pytest.mark.points(2)
@pytest.mark.parametrize("length,blocks", [(15, 1), (16, 1), (17, 2), (32, 2), (33, 3), (48, 3), (64, 4)])
def test_reserve_at_block_boundaries(length, blocks):
    alloc = BlockAllocator(8, 16)
    alloc.alloc_blocks(3)  # blocks 0..2 taken elsewhere, so the request's ids are not 0, 1, 2
    req = Request(prompt_ids=list(range(length)))
    reserve(req, alloc, length // 2)  # a prompt's first chunk, then the rest: only what is missing
    reserve(req, alloc, length)
    assert len(req.blocks) == blocks and alloc.num_used == 3 + blocks
    assert len(req.slot_indices) == blocks * 16  # whole blocks are reserved
    assert req.slot_indices == [b * 16 + within for b in req.blocks for within in range(16)]
    position = length - 1  # the last token lives in block position // 16, at position % 16
    assert req.slot_indices[position] == req.blocks[position // 16] * 16 + position % 16
    before, free_before = (list(req.blocks), list(req.slot_indices)), snapshot(alloc)
    with pytest.raises(OutOfBlocksError):  # more than the free blocks, by one: nothing may change
        reserve(req, alloc, (blocks + alloc.num_free + 1) * 16)
    assert (req.blocks, req.slot_indices) == before and snapshot(alloc) == free_before


@pytest.mark.points(1)
def test_reserve_grows_only_when_a_block_fills_and_keeps_earlier_slots():
    alloc = BlockAllocator(8, 16)
    req = Request(prompt_ids=[1] * 15)
    reserve(req, alloc, 15)
    first = list(req.slot_indices)
    reserve(req, alloc, 16)
    assert req.slot_indices == first  # position 15 is the last slot of block 0: no new block
    reserve(req, alloc, 17)
    assert len(req.blocks) == 2 and req.slot_indices[:16] == first
    reserve(req, alloc, 3)  # a smaller target never gives blocks back
    assert len(req.blocks) == 2
    release(req, alloc)
    assert (req.blocks, req.slot_indices, alloc.num_free) == ([], [], 8)


@pytest.mark.points(2)
def test_reserve_is_all_or_nothing_when_the_pool_is_short():
    alloc = BlockAllocator(3, 16)
    req = Request(prompt_ids=[1] * 10)
    reserve(req, alloc, 10)
    other = alloc.alloc_blocks(1)
    req_before = (list(req.blocks), list(req.slot_indices))
    alloc_before = snapshot(alloc)
    with pytest.raises(OutOfBlocksError) as info:
        reserve(req, alloc, 40)  # needs 3 blocks: 2 more, only 1 free
    assert (info.value.requested, info.value.free) == (2, 1)
    assert (req.blocks, req.slot_indices) == req_before
    assert snapshot(alloc) == alloc_before
    assert sorted(alloc.free_blocks + req.blocks + other) == [0, 1, 2]


# ---------------------------------------------------------------- ForwardMeta and the ragged mask

@pytest.mark.points(2)
def test_ragged_causal_mask_on_a_hand_built_batch():
    # Request 0 prefills 3 tokens (positions 0..2); request 1 decodes one token at position 2.
    q_pos, q_req = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 0, 0, 1])
    k_pos, k_req = torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 0, 0, 1, 1, 1])
    got = ragged_causal_mask(q_pos, q_req, k_pos, k_req)  # before the expected value exists
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],  # r0 pos 0 reads its own key 0
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1],  # r1's new token reads r1's whole history, none of r0's keys
    ], dtype=torch.bool)
    assert torch.equal(got, expected)
    one = torch.tensor([5])
    assert ragged_causal_mask(one, torch.tensor([0]), torch.arange(6), torch.zeros(6, dtype=torch.long)) is None


@pytest.mark.points(2)
def test_build_meta_worked_example():
    """The example drawn in l2_paged/meta.py: block size 4, A holds blocks [2, 0], B holds [1]."""
    def holding(blocks, **fields):
        slots = [b * 4 + within for b in blocks for within in range(4)]
        return Request(blocks=blocks, slot_indices=slots, **fields)

    a = holding([2, 0], prompt_ids=[10, 11, 12, 13, 14, 15])  # prefills its 6 prompt tokens
    b = holding([1], prompt_ids=[20, 21], output_ids=[22], cur_len=2)  # decodes token 22 at position 2
    ids, meta = build_meta([a, b], [6, 1], "cpu")
    assert ids.tolist() == [10, 11, 12, 13, 14, 15, 22]
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 5, 2]
    assert meta.slot_mapping.tolist() == [8, 9, 10, 11, 0, 1, 6]
    assert meta.kv_indices.tolist() == [8, 9, 10, 11, 0, 1, 4, 5, 6]
    assert meta.cu_seqlens_q.tolist() == [0, 6, 7] and meta.cu_seqlens_k.tolist() == [0, 6, 9]
    assert meta.is_prefill and meta.attn_mask.shape == (7, 9)
    assert meta.attn_mask[6].tolist() == [False] * 6 + [True] * 3


@pytest.mark.points(1)
def test_meta_indices_are_1d_int64():
    alloc = BlockAllocator(4, 4)
    reqs = [Request(prompt_ids=[1, 2, 3, 4, 5]), Request(prompt_ids=[6, 7])]
    for r in reqs:
        reserve(r, alloc, len(r.prompt_ids))
    ids, meta = build_meta(reqs, [5, 2], "cpu")
    for name in ("positions", "slot_mapping", "kv_indices", "cu_seqlens_q", "cu_seqlens_k"):
        t = getattr(meta, name)
        assert t.dtype == torch.int64 and t.dim() == 1, name  # torch.tensor([[...]]) would be 2-D
    assert ids.dtype == torch.int64 and meta.attn_mask.dtype == torch.bool


# ---------------------------------------------------------------- sizing the pool from bytes

def qwen3_config(**fields) -> Qwen3Config:
    return Qwen3Config.from_dict({"model_type": "qwen3", **fields})


QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def test_num_blocks_for_budget_on_the_embedded_model():
    cfg = load_config(DEFAULT_MODEL)
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (4, 4, 32)
    # K and V × 4 layers × 4 KV heads × 32 dims × 4 bytes = 4096 B per token; 16 tokens = 64 KiB.
    assert bytes_per_block(cfg, 16, torch.float32) == 65536
    assert bytes_per_block(cfg, 16, torch.bfloat16) == 32768
    assert num_blocks_for_budget(cfg, 64 * 2**20, 16, torch.float32) == 1024
    assert num_blocks_for_budget(cfg, 64 * 2**20, 16, torch.bfloat16) == 2048
    assert num_blocks_for_budget(cfg, 65536 * 3 - 1, 16, torch.float32) == 2  # whole blocks only
    with pytest.raises(InputError, match="holds no block"):
        num_blocks_for_budget(cfg, 65535, 16, torch.float32)


def test_pool_sizing_for_real_qwen3_checkpoints():
    small = qwen3_config(**QWEN3_0_6B)
    assert small.kv_bytes_per_token(2) == 114_688  # 2 × 28 layers × 8 heads × 128 dims × 2 bytes
    assert bytes_per_block(small, 16, torch.bfloat16) == 1_835_008 == int(1.75 * 2**20)
    big = qwen3_config(**QWEN3_8B)
    assert big.kv_bytes_per_token(2) == 147_456  # 144 KiB per token
    # An 80 GB card, minus 16.4 GB of bf16 weights and ~4 GB for activations, leaves 59.6 GB for KV.
    blocks = num_blocks_for_budget(big, int(59.6e9), 16, torch.bfloat16)
    assert blocks == 25_261 and blocks * 16 == 404_176  # token slots: ~98 requests of 4,096 tokens
    assert num_blocks_for_budget(small, int(74.8e9), 16, torch.bfloat16) == 40_762  # 0.6B: 1.2 GB weights


@pytest.mark.parametrize("text,value", [
    ("64MiB", 64 * 2**20), ("2GiB", 2 * 2**30), ("1.5KiB", 1536), ("500MB", 500 * 10**6),
    ("3gb", 3 * 10**9), (" 12 mib ", 12 * 2**20), ("4096", 4096), ("4096B", 4096),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "lots", "64XB", "-5MiB", "1e9", "64 Mi B"])
def test_parse_size_rejects_what_it_cannot_read(text):
    with pytest.raises(InputError, match="64MiB"):
        parse_size(text)
