"""L4: the model with every step on the paged path: prompts in chunks beside decodes, each row
reading its keys through the block table, ids equal to HF's; the metadata holds no gather list and
no mask; a chunk's rows read the keys the earlier chunks left in the pool."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_ids, random_prompt
from l1_contiguous import InputError, load_config
from l2_paged import BlockAllocator, Request, reserve
from l3_block_kernel import BlockKvPool
from l3_block_kernel.kernel_build import host_compiler
from l4_paged_prefill import PagedPrefillRunner, build_paged_meta, load_prefill_model

pytestmark = [pytest.mark.l4]


def run(model_dir, prompts, block_size, chunk, backend, max_new_tokens=8, nan_pool=True):
    model = load_prefill_model(model_dir)
    cfg = model.config
    reqs = [Request(list(p), max_new_tokens, request_id=i) for i, p in enumerate(prompts)]
    pool = BlockKvPool(cfg, 48, block_size, torch.float32)
    if nan_pool:
        for t in pool.K + pool.V:
            t.fill_(float("nan"))  # never-written slots must not reach a softmax or a sum
    alloc = BlockAllocator(48, block_size)
    runner = PagedPrefillRunner(model, pool, alloc, backend=backend, prefill_chunk=chunk)
    runner.generate(reqs)
    assert alloc.num_free == alloc.num_blocks
    return reqs


@pytest.mark.points(4)
@pytest.mark.parametrize("block_size,chunk", [(4, 5), (8, 3), (16, None)])
def test_chunked_prefill_beside_decodes_on_the_reference_equals_hf(tiny_model_dir, block_size, chunk):
    """Chunks that start and end inside blocks, in the same forwards as other requests' decodes:
    every row's causal offset (query_positions) and the block-by-block merge (merge_states) are
    what the reference runs on."""
    vocab = load_config(tiny_model_dir).vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (3, 17, 26)]
    for req in run(tiny_model_dir, prompts, block_size, chunk, "reference"):
        assert req.output_ids == hf_ids(tiny_model_dir, req.prompt_ids, 8)


@pytest.mark.skipif(host_compiler() is None, reason="the cpu backend needs g++ or clang++")
def test_the_cpu_kernel_runs_the_model_to_hf_s_ids(tiny_model_dir):
    """(The emulated CUDA kernel takes head_dim 32 and up: tests/test_l4_smoke.py runs it on the embedded model.)"""
    vocab = load_config(tiny_model_dir).vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (1, 12, 30)]
    for req in run(tiny_model_dir, prompts, 8, 7, "cpu", max_new_tokens=6):
        assert req.output_ids == hf_ids(tiny_model_dir, req.prompt_ids, 6)


def test_step_metadata_has_no_gather_list_and_no_mask():
    alloc = BlockAllocator(16, 4)
    a, b, c = Request([5] * 10), Request([6] * 6), Request([7] * 2)
    for req, cached in ((a, 6), (b, 6), (c, 0)):
        req.cur_len = cached
    b.output_ids = [9]  # b decodes its next token at position 6
    for req, n in ((a, 4), (b, 1), (c, 2)):
        reserve(req, alloc, req.cur_len + n)
    ids, meta = build_paged_meta([a, b, c], [4, 1, 2], "cpu")
    assert ids.tolist() == [5, 5, 5, 5, 9, 7, 7]
    assert meta.positions.tolist() == [6, 7, 8, 9, 6, 0, 1]
    assert meta.cu_seqlens_q.tolist() == [0, 4, 5, 7] and meta.context_lens.tolist() == [10, 7, 2]
    assert meta.block_tables[0, :3].tolist() == a.blocks and meta.max_query_len == 4
    assert not hasattr(meta, "kv_indices") and not hasattr(meta, "attn_mask")
    with pytest.raises(ValueError, match="slots reserved"):
        build_paged_meta([Request([1, 2, 3])], [3], "cpu")


def test_runner_options_are_checked(tiny_model_dir):
    model = load_prefill_model(tiny_model_dir)
    pool, alloc = BlockKvPool(model.config, 4, 8, torch.float32), BlockAllocator(4, 8)
    with pytest.raises(InputError, match="prefill_chunk"):
        PagedPrefillRunner(model, pool, alloc, prefill_chunk=0)
    with pytest.raises(InputError, match="backend must be one of"):
        PagedPrefillRunner(model, pool, alloc, backend="gather")
