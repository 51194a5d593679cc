"""L4: the causal offset, the merge of two softmax states, the PyTorch reference built on them,
and cascade attention (the shared prefix read once), against independent computations.

The oracle everywhere is the plain definition: for each query row, gather its request's keys
position by position (a Python loop over the block table), mask by the causal rule and the
window, softmax, weighted sum, in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from l4_paged_prefill import (cascade_attention, common_prefix_blocks, merge_states, paged_prefill_attention,
                              paged_prefill_reference, query_positions)

pytestmark = [pytest.mark.l4]


def make_batch(context_lens, query_lens, block_size, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float64,
               fill=None, pad=-1, shared_blocks=0, seed=0):
    """A pool and a ragged batch: request r has context_lens[r] keys, its last query_lens[r] are the
    query rows. Tables are padded with `pad`; the first shared_blocks columns are the same blocks
    in every row. fill: a value for every slot no request reads (NaN: it must never matter)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in context_lens]
    num_blocks = shared_blocks + sum(c - shared_blocks for c in counts) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    shared, start = ids[:shared_blocks], shared_blocks
    tables = torch.full((len(context_lens), max(counts) + 1), pad, dtype=torch.int32)
    for r, c in enumerate(counts):
        tables[r, :c] = torch.tensor(shared + ids[start:start + c - shared_blocks], dtype=torch.int32)
        start += c - shared_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen, dtype=dtype), torch.randn(shape, generator=gen, dtype=dtype)
    if fill is not None:
        read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for r, n in enumerate(context_lens):
            for p in range(n):
                read[tables[r, p // block_size], p % block_size] = True
        k, v = (torch.where(read[:, :, None, None], t, fill) for t in (k, v))
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, torch.tensor(context_lens, dtype=torch.int32), tables


def naive(q, k, v, cu, lens, tables, window=None):
    """out [T, H, D] float64, lse [T, H]: each row's keys gathered one position at a time."""
    block_size, num_kv_heads = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    for r in range(len(lens)):
        n, length = int(cu[r + 1] - cu[r]), int(lens[r])
        for i in range(n):
            t, pos = int(cu[r]) + i, length - n + i
            first = 0 if window is None else max(0, pos - window + 1)
            keys = range(first, pos + 1)
            rows = [(int(tables[r, p // block_size]), p % block_size) for p in keys]
            kk = torch.stack([k[b, w] for b, w in rows]).double()  # [S, H_kv, D]
            vv = torch.stack([v[b, w] for b, w in rows]).double()
            for h in range(q.shape[1]):
                scores = kk[:, h // group] @ q[t, h].double() / math.sqrt(q.shape[2])
                out[t, h] = torch.softmax(scores, 0) @ vv[:, h // group]
                lse[t, h] = torch.logsumexp(scores, 0)
    return out, lse


# ---------------------------------------------------------------- query_positions (§2.2)


@pytest.mark.points(2)
def test_query_positions_put_each_chunk_after_its_requests_cached_keys():
    cu = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    lens = torch.tensor([10, 7, 2], dtype=torch.int32)
    positions, request = query_positions(cu, lens)
    assert positions.tolist() == [6, 7, 8, 9, 6, 0, 1]
    assert request.tolist() == [0, 0, 0, 0, 1, 2, 2]
    assert positions.dtype == torch.int64 and request.dtype == torch.int64


@pytest.mark.points(2)
@pytest.mark.parametrize("seed", range(4))
def test_query_positions_on_random_batches_with_requests_that_bring_no_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    query_lens = torch.randint(0, 6, (7,), generator=gen).tolist()
    query_lens[seed % 7] = 0  # a request with no row in this step
    lens = [n + int(torch.randint(0, 30, (1,), generator=gen)) for n in query_lens]
    lens = [max(1, n) for n in lens]
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions, request = query_positions(cu, torch.tensor(lens, dtype=torch.int32))
    want_pos = [lens[r] - n + i for r, n in enumerate(query_lens) for i in range(n)]
    want_req = [r for r, n in enumerate(query_lens) for _ in range(n)]
    assert positions.tolist() == want_pos and request.tolist() == want_req


# ---------------------------------------------------------------- merge_states (§2.4)


def partial(q, k, v):
    """Attention of q [T, H, D] over keys k, v [S, H, D] (one head each): out, lse in float64."""
    scores = torch.einsum("thd,shd->ths", q, k)
    return torch.einsum("ths,shd->thd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


@pytest.mark.points(2)
@pytest.mark.parametrize("split", [1, 5, 11])
def test_merging_two_disjoint_key_sets_is_attention_over_both(split):
    gen = torch.Generator().manual_seed(split)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((3, 2, 8), (12, 2, 8), (12, 2, 8)))
    whole_out, whole_lse = partial(q, k, v)
    a, b = partial(q, k[:split], v[:split]), partial(q, k[split:], v[split:])
    for first, second in ((a, b), (b, a)):  # the order of the two states does not matter
        out, lse = merge_states(*first, *second)
        torch.testing.assert_close(out.double(), whole_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse.double(), whole_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.points(2)
def test_a_side_that_saw_no_key_changes_nothing_even_if_its_out_is_nan():
    gen = torch.Generator().manual_seed(0)
    out_a, lse_a = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, generator=gen)
    out_b, lse_b = torch.full((4, 2, 8), float("nan")), torch.full((4, 2), float("-inf"))
    for out, lse in (merge_states(out_a, lse_a, out_b, lse_b), merge_states(out_b, lse_b, out_a, lse_a)):
        torch.testing.assert_close(out, out_a, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, lse_a, rtol=1e-6, atol=1e-6)


@pytest.mark.points(1)
def test_two_sides_that_saw_no_key_give_zero_and_minus_infinity_not_nan():
    out, lse = merge_states(torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf")),
                            torch.full((2, 3, 4), float("nan")), torch.full((2, 3), float("-inf")))
    assert torch.equal(out, torch.zeros(2, 3, 4)) and bool(torch.isneginf(lse).all())


@pytest.mark.points(1)
def test_merge_is_stable_for_large_log_sums():
    """exp(1000) overflows float32 and float64: the merge must subtract the larger lse first."""
    out_a, out_b = torch.ones(1, 1, 2), torch.full((1, 1, 2), 3.0)
    out, lse = merge_states(out_a, torch.tensor([[1000.0]]), out_b, torch.tensor([[1000.0 + math.log(3)]]))
    torch.testing.assert_close(out, torch.full((1, 1, 2), 2.5))  # weights 1 : 3
    torch.testing.assert_close(lse, torch.tensor([[1000.0 + math.log(4)]]))


# ---------------------------------------------------------------- the reference (§2.5)

CASES = [  # context_lens, query_lens, block_size
    ([10, 7, 2], [4, 1, 2], 4),          # the lesson's picture: a chunk, a decode, a first chunk
    ([17, 1, 33, 16], [17, 1, 5, 1], 8),  # whole prompts, a one-token prompt, a chunk mid-block
    ([40, 9], [1, 9], 16),               # a decode and a prompt inside one block
    ([5, 6, 7], [5, 3, 1], 1),           # blocks of one position
]


@pytest.mark.points(3)
@pytest.mark.parametrize("context_lens,query_lens,block_size", CASES)
@pytest.mark.parametrize("group", [1, 3])
def test_reference_equals_the_definition(context_lens, query_lens, block_size, group):
    case = make_batch(context_lens, query_lens, block_size, group=group, fill=float("nan"))
    out, lse = paged_prefill_reference(*case)
    want_out, want_lse = naive(*case)
    torch.testing.assert_close(out, want_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.points(2)
@pytest.mark.parametrize("window", [1, 3, 8])
def test_reference_reads_only_the_window(window):
    case = make_batch([30, 12, 5], [6, 1, 5], 4, fill=float("nan"), seed=window)
    out, _ = paged_prefill_reference(*case, window=window)
    torch.testing.assert_close(out, naive(*case, window=window)[0], rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- cascade (§2.6)


@pytest.mark.points(1)
def test_common_prefix_counts_the_leading_columns_every_request_holds():
    tables = [[7, 2, 9, 4], [7, 2, 5, 0], [7, 2, 6, 1]]
    assert common_prefix_blocks(tables, [14, 11, 16], [1, 1, 2], 4) == 2
    assert common_prefix_blocks([[7, 2, 9], [7, 3, 5], [7, 2, 6]], [12, 12, 12], [1, 1, 1], 4) == 1
    assert common_prefix_blocks([[7, 2], [8, 2]], [8, 8], [1, 1], 4) == 0


@pytest.mark.points(1)
def test_one_request_shares_nothing():
    assert common_prefix_blocks([[7, 2, 9]], [12], [1], 4) == 0


@pytest.mark.points(2)
def test_a_shared_block_that_some_query_still_lies_in_is_not_cascaded():
    """Request b's first query row is position 7, inside the second shared block (positions 4..7):
    the prefix pass reads every shared key for every row, which would let b's rows see keys after
    themselves. Only the first block is safe."""
    tables = [[7, 2, 9], [7, 2, 0]]
    assert common_prefix_blocks(tables, [10, 8], [1, 1], 4) == 1
    # The same tables, and equal padding entries: a column no request has computed is never shared.
    assert common_prefix_blocks([[7, 0, 0], [7, 0, 0]], [4, 4], [4, 4], 4) == 0
    assert common_prefix_blocks([[7, 2, 0], [7, 2, 0]], [6, 6], [2, 2], 4) == 1


@pytest.mark.points(4)
@pytest.mark.parametrize("context_lens,query_lens", [
    ([20, 10, 14], [1, 1, 1]),       # decodes; b's (position 9) inside the third shared block
    ([20, 17, 15], [4, 7, 3]),       # chunks; b's first row (10) inside the third shared block
    ([12, 13, 30, 14], [0, 1, 9, 2]),  # a request with no row in the step
    ([20, 11, 14], [1, 3, 2]),       # b's rows (8..10) lie inside the third shared block: two are safe
])
def test_cascade_equals_the_plain_path(context_lens, query_lens):
    q, k, v, cu, lens, tables = make_batch(context_lens, query_lens, 4, shared_blocks=3, fill=float("nan"))
    computed = [n - m for n, m in zip(context_lens, query_lens)]
    shared = common_prefix_blocks(tables.tolist(), context_lens, query_lens, 4)
    assert shared == min(3, min(computed) // 4)
    plain = paged_prefill_attention(q, k, v, cu, lens, tables, backend="reference")
    for blocks in range(shared + 1):
        got = cascade_attention(q, k, v, cu, lens, tables, blocks, backend="reference")
        torch.testing.assert_close(got, plain, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(plain, naive(q, k, v, cu, lens, tables)[0], rtol=1e-9, atol=1e-9)
