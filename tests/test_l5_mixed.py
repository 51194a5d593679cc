"""L5: one forward per step. Decodes and prefill chunks share a flat batch, and L4's attention
reads every row's keys through the block tables in one call.

The mixed step must compute what two separate forwards compute (same K/V in the pool, same
logits), every engine step must be exactly one forward, and a model whose attention cannot take
a mixed batch is refused with a message that says how to load the right one. All of it is
provided code (L4's attention, L5's runner): these tests carry no points.
"""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers import random_prompt
from l1_contiguous import InputError, RotaryEmbedding, apply_rotary
from l1_contiguous.model import RMSNorm
from l2_paged import BlockAllocator, Request, reserve
from l3_block_kernel import BlockKvPool, load_block_model
from l3_block_kernel.kernel_build import host_compiler
from l4_paged_prefill import PagedPrefillRunner, PagedStepMeta, load_prefill_model
from l5_eviction import KvManager, StepRunner, WorkItem, build_step_meta, engine_backend, load_engine_model, make_engine
from l5_eviction import engine_ops
from l5_eviction.fused import FusedDecoderLayer, FusedRMSNorm, RotaryTable, writes_in_projection
from test_l5_engine import BLOCK_SIZE, WORKLOAD, hf_alone, outputs, quarter_pool

mixed = importlib.import_module("l5_eviction.mixed")
pytestmark = [pytest.mark.l5, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_engine_model(tiny_model_dir)


def half_done(model, num_blocks=64):
    """A pool and three requests: two with a prompt cached and their next token pending (decodes),
    one with nothing cached (a 9-token prefill), one halfway through its prompt (a 3-token chunk)."""
    pool = BlockKvPool(model.config, num_blocks, BLOCK_SIZE, model.dtype, model.device)
    alloc = BlockAllocator(num_blocks, BLOCK_SIZE)
    runner = PagedPrefillRunner(model, pool, alloc, backend="reference")
    decodes = [Request(random_prompt(n, 512, 10 + n), 4, request_id=i) for i, n in enumerate((5, 11))]
    runner.forward(decodes, [5, 11])  # prefill: cur_len 5 and 11
    for req in decodes:
        req.output_ids.append(7)  # the pending token at position cur_len
    fresh = Request(random_prompt(9, 512, 3), 4, request_id=2)
    halfway = Request(random_prompt(8, 512, 4), 4, request_id=3)
    runner.forward([halfway], [5])
    return pool, alloc, decodes + [fresh, halfway], [1, 1, 9, 3]


def test_step_meta_is_l4s_whatever_the_mix(model):
    pool, alloc, reqs, num_new = half_done(model)
    for req, n in zip(reqs, num_new):
        reserve(req, alloc, req.cur_len + n)
    ids, meta = build_step_meta(reqs, num_new, "cpu", "reference")
    assert isinstance(meta, PagedStepMeta) and meta.max_query_len == 9
    assert meta.positions.tolist() == [5, 11, *range(9), 5, 6, 7]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 11, 14]
    assert meta.context_lens.tolist() == [6, 12, 9, 8]
    assert ids.tolist() == [7, 7, *reqs[2].prompt_ids, *reqs[3].prompt_ids[5:8]]
    # Any order: the rows of a request are contiguous, and that is all L4's attention needs.
    _, reversed_meta = build_step_meta(reqs[::-1], num_new[::-1], "cpu", "reference")
    assert reversed_meta.positions.tolist() == [5, 6, 7, *range(9), 11, 5]


@pytest.mark.parametrize("backend", ["reference"] + (["cpu"] if host_compiler() else []))
def test_mixed_forward_equals_two_separate_forwards(model, backend):
    """Same logits and the same K/V in the pool as a prefill forward plus a decode forward (up to
    rounding: a matmul over more rows may block its sums differently)."""
    pool, alloc, reqs, num_new = half_done(model)
    pool_b, alloc_b, reqs_b = copy.deepcopy((pool, alloc, reqs))
    mixed = StepRunner(model, KvManager(alloc, pool), backend=backend).forward_logits(reqs, num_new)
    two = PagedPrefillRunner(model, pool_b, alloc_b, backend=backend)
    separate = torch.cat([two.forward_logits(reqs_b[:2], [1, 1]), two.forward_logits(reqs_b[2:], [9, 3])])
    torch.testing.assert_close(mixed, separate, rtol=1e-5, atol=1e-5)
    for layer in range(model.config.num_hidden_layers):
        for req in reqs:
            slots = req.slot_indices[:req.cur_len]
            torch.testing.assert_close(pool.K[layer][slots], pool_b.K[layer][slots], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(pool.V[layer][slots], pool_b.V[layer][slots], rtol=1e-4, atol=1e-5)
    assert [r.cur_len for r in reqs] == [r.cur_len for r in reqs_b] == [6, 12, 9, 8]


def test_every_step_is_one_forward(model, tiny_model_dir, monkeypatch):
    engine = make_engine(model, quarter_pool(WORKLOAD), BLOCK_SIZE, prefill_chunk=8)
    calls, real = [], engine.runner.forward_logits

    def counting(reqs, num_new):
        calls.append((engine.now, list(num_new)))
        return real(reqs, num_new)

    monkeypatch.setattr(engine.runner, "forward_logits", counting)
    engine.run(WORKLOAD)
    steps = [step for step, _ in calls]
    assert len(steps) == len(set(steps)) == sum(1 for r in engine.timeline if r.prefill_tokens or r.decode_tokens)
    assert any(r.prefill_tokens and r.decode_tokens for r in engine.timeline)  # some steps were mixed
    assert outputs(engine) == [hf_alone(tiny_model_dir, item) for item in WORKLOAD]


def test_engine_backends_agree(model):
    assert engine_backend("cuda") == "kernel" and engine_backend("cpu", torch.bfloat16) == "reference"
    assert engine_backend("cpu") == ("cpu" if host_compiler() else "reference")
    runs = {}
    for backend in ("reference",) + (("cpu",) if host_compiler() else ()):
        engine = make_engine(model, quarter_pool(WORKLOAD), BLOCK_SIZE, backend=backend)
        assert engine.runner.backend == backend
        engine.run(WORKLOAD)
        runs[backend] = outputs(engine)
    assert all(run == runs["reference"] for run in runs.values())


def test_without_a_cpu_kernel_the_engine_takes_the_reference_and_says_why_once(monkeypatch):
    monkeypatch.setattr(mixed, "cpu_kernel_builds", lambda: False)
    mixed._say_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [engine_backend("cpu") for _ in range(3)] == ["reference"] * 3
    mixed._say_once.cache_clear()
    assert len(caught) == 1 and "attends with L4's PyTorch reference" in str(caught[0].message)


def test_a_model_without_mixed_attention_is_refused(tiny_model_dir):
    l3_model = load_block_model(tiny_model_dir)
    with pytest.raises(InputError, match="BlockTableAttention cannot; load the model with "
                                         "l5_eviction.load_engine_model") as info:
        make_engine(l3_model, 8, BLOCK_SIZE)
    assert "\n" not in str(info.value)
    make_engine(load_engine_model(tiny_model_dir), 8, BLOCK_SIZE).run([WorkItem([1, 2, 3], 2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_models_norms_are_one_call_with_l1s_numbers(model, dtype):
    """Every RMSNorm of the engine's model (two per layer and the final one) is one call (C++ in
    float32 where it builds, else torch's F.rms_norm) computing L1's formula: float32 math, cast
    back before the weight."""
    norms = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    assert not any(type(m) is RMSNorm for layer in model.model.layers
                   for m in (layer.input_layernorm, layer.post_attention_layernorm))
    gen = torch.Generator().manual_seed(0)
    for norm in norms[:2]:
        l1 = RMSNorm(norm.weight.shape[0], norm.eps).to(dtype)
        weight = (1 + torch.randn(norm.weight.shape, generator=gen)).to(dtype)
        l1.weight = torch.nn.Parameter(weight)
        x = (3 * torch.randn(5, norm.weight.shape[0], generator=gen)).to(dtype)
        got = FusedRMSNorm(l1)(x)
        assert got.dtype == dtype
        torch.testing.assert_close(got, l1(x), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


needs_ops = pytest.mark.skipif(not engine_ops.engine_ops_build(), reason="the engine's C++ operations need g++ or clang++")


@needs_ops
def test_the_engines_cpp_operations_compute_l1s_arithmetic():
    """q/k norm + rotary, RMSNorm and silu * up, each against L1's PyTorch formulas, on rows that
    are not contiguous with each other (a slice of a wider product)."""
    gen = torch.Generator().manual_seed(3)
    t, heads, d = 5, 6, 32
    wide = 3 * torch.randn(t, heads * d + 40, generator=gen)  # q's and k's heads, then other columns
    weight = 1 + torch.randn(heads, d, generator=gen)
    cos, sin = RotaryEmbedding(d, 10000.0).cos_sin(torch.tensor([0, 3, 7, 100, 2047]), torch.float32)
    heads_in = wide[:, :heads * d].view(t, heads, d)
    normed = torch.stack([_with_weight(RMSNorm(d, 1e-6), weight[h])(heads_in[:, h]) for h in range(heads)], 1)
    want = apply_rotary(normed, cos, sin)
    got = engine_ops.qk_norm_rope(wide, heads, d, weight, 1e-6, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    x = 3 * torch.randn(t, 2 * 256, generator=gen)[:, :256]  # rows 512 floats apart
    norm = _with_weight(RMSNorm(256, 1e-6), 1 + torch.randn(256, generator=gen))
    torch.testing.assert_close(engine_ops.rms_norm(x, norm.weight, 1e-6), norm(x), rtol=1e-5, atol=1e-5)

    gate_up = 4 * torch.randn(t, 2 * 96, generator=gen)
    torch.testing.assert_close(engine_ops.silu_mul(gate_up), F.silu(gate_up[:, :96]) * gate_up[:, 96:],
                               rtol=1e-5, atol=1e-5)

    residual = 3 * torch.randn(t, 256, generator=gen)
    before = residual.clone()
    torch.testing.assert_close(engine_ops.add_rms_norm(x, residual, norm.weight, 1e-6), norm(before + x),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, before + x, rtol=0, atol=0)  # the sum, in place

    q_heads, kv_heads = 4, 2  # heads = q's and k's; then v's, and 8 columns more
    v = torch.randn(t, kv_heads * d, generator=gen)
    qkv = torch.cat([wide[:, :heads * d], v, torch.randn(t, 8, generator=gen)], dim=1)[:, :-8]  # rows 8 apart
    k_slots, v_slots = torch.zeros(9, kv_heads, d), torch.zeros(9, kv_heads, d)
    slots = torch.tensor([7, 0, 3, 8, 1])
    q = engine_ops.qk_norm_rope_write(qkv, q_heads, kv_heads, d, weight, 1e-6, cos, sin, k_slots, v_slots, slots)
    torch.testing.assert_close(q, want[:, :q_heads], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_slots[slots], want[:, q_heads:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_slots[slots], v.view(t, kv_heads, d), rtol=0, atol=0)
    assert not k_slots[[2, 4, 5, 6]].any() and not v_slots[[2, 4, 5, 6]].any()  # no other slot written


def _with_weight(norm, weight):
    norm.weight = torch.nn.Parameter(weight)
    return norm


@needs_ops
def test_without_the_cpp_operations_the_engine_model_computes_the_same_logits(model, monkeypatch):
    """Where they do not build (no compiler), every operation falls back to torch's, same logits."""
    pool, alloc, reqs, num_new = half_done(model)
    for req, n in zip(reqs, num_new):
        reserve(req, alloc, req.cur_len + n)
    ids, meta = build_step_meta(reqs, num_new, "cpu", "reference")
    slow_pool = copy.deepcopy(pool)
    with torch.inference_mode():
        fast = model(ids, pool, meta)
        monkeypatch.setattr(engine_ops, "engine_ops_build", lambda: False)
        meta.plan = None
        slow = model(ids, slow_pool, meta)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)
    assert_same_kv(pool, slow_pool, reqs, model.config)


def stepped(model, pool_cls=BlockKvPool):
    """half_done's state on a pool of `pool_cls`, then one mixed step: (logits, pool, requests)."""
    pool, alloc, reqs, num_new = half_done(model)
    if pool_cls is not BlockKvPool:
        mine = pool_cls(model.config, pool.num_blocks, BLOCK_SIZE, model.dtype, model.device)
        for layer in range(model.config.num_hidden_layers):
            mine.K[layer].copy_(pool.K[layer])
            mine.V[layer].copy_(pool.V[layer])
        pool = mine
    logits = PagedPrefillRunner(model, pool, alloc, backend="reference").forward_logits(reqs, num_new)
    return logits, pool, reqs


def assert_same_kv(pool_a, pool_b, reqs, config):
    for layer in range(config.num_hidden_layers):
        for req in reqs:
            slots = req.slot_indices[:req.cur_len]
            torch.testing.assert_close(pool_a.K[layer][slots], pool_b.K[layer][slots], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(pool_a.V[layer][slots], pool_b.V[layer][slots], rtol=1e-4, atol=1e-5)


def test_the_engine_model_computes_l4s_logits_and_kv(model, tiny_model_dir):
    """Its layers carry the residual (the adds inside the norms), write K/V inside the q/k call and
    read a rotary table, and still compute what L4's model (L1's layer) does: logits and pool."""
    assert all(type(layer) is FusedDecoderLayer for layer in model.model.layers)
    assert isinstance(model.rotary, RotaryTable)
    ours, our_pool, reqs = stepped(model)
    l4 = load_prefill_model(tiny_model_dir)
    theirs, their_pool, _ = stepped(l4)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert_same_kv(our_pool, their_pool, reqs, model.config)


class RecordingPool(BlockKvPool):
    """A pool with its own write (as L12's quantizing one has): the engine must call it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.writes = []

    def set_kv(self, layer, slot_mapping, k, v):
        self.writes.append(layer)
        super().set_kv(layer, slot_mapping, k, v)


def test_a_pool_with_its_own_write_gets_every_write(model):
    """The K/V write moves into the q/k call only for L2's plain write: a pool that overrides
    set_kv, or an attention whose cache step is not L4's, keeps its own (same numbers)."""
    plain, plain_pool, reqs = stepped(model)
    recorded, pool, _ = stepped(model, RecordingPool)
    assert pool.writes == list(range(model.config.num_hidden_layers))
    torch.testing.assert_close(recorded, plain, rtol=1e-6, atol=1e-6)
    assert_same_kv(pool, plain_pool, reqs, model.config)

    class OwnStep(type(model.model.layers[0].self_attn)):
        def kv_step(self, k, v, pool, meta):
            return super().kv_step(k, v, pool, meta)
    x, cos = torch.zeros(2, model.config.hidden_size), torch.zeros(2, model.config.head_dim)
    two = torch.tensor([0, 1])
    meta = PagedStepMeta(positions=two, slot_mapping=two, cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
                         context_lens=torch.tensor([2], dtype=torch.int32),
                         block_tables=torch.zeros(1, 1, dtype=torch.int32), max_query_len=2)
    attn = model.model.layers[0].self_attn
    assert writes_in_projection(attn, x, cos, plain_pool, meta) == engine_ops.engine_ops_build()
    assert not writes_in_projection(attn, x, cos, pool, meta)
    attn.__class__ = OwnStep
    try:
        assert not writes_in_projection(attn, x, cos, plain_pool, meta)
    finally:
        attn.__class__ = OwnStep.__bases__[0]


@needs_ops
def test_the_cpp_write_refuses_a_slot_outside_the_pool_and_writes_nothing():
    heads, kv_heads, d, slots = 4, 2, 8, 6
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d)
    weight, (cos, sin) = torch.ones(heads + kv_heads, d), RotaryEmbedding(d, 10000.0).cos_sin(torch.arange(3), torch.float32)
    k_slots, v_slots = torch.zeros(slots, kv_heads, d), torch.zeros(slots, kv_heads, d)
    for bad in (slots, -1):
        with pytest.raises(InputError, match=f"outside the pool \\({slots} slots\\)"):
            engine_ops.qk_norm_rope_write(qkv, heads, kv_heads, d, weight, 1e-6, cos, sin, k_slots, v_slots,
                                          torch.tensor([0, bad, 2]))
        assert not k_slots.any() and not v_slots.any()


def test_the_rotary_table_gives_l1s_angles_at_any_position():
    """Grown past its first 1024 positions when asked; past MAX_POSITIONS it computes L1's angles
    without growing."""
    l1 = RotaryEmbedding(32, 10000.0)
    table = RotaryTable(l1)
    for positions in ([0, 5, 1023], [1024, 7, 3000], [RotaryTable.MAX_POSITIONS + 5, 2]):
        positions = torch.tensor(positions)
        for got, want in zip(table.cos_sin(positions, torch.float32), l1.cos_sin(positions, torch.float32)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert table.cos.shape == (4096, 32)
    bf16 = table.cos_sin(torch.tensor([3]), torch.bfloat16)
    assert bf16[0].dtype == torch.bfloat16 and torch.equal(bf16[0], l1.cos_sin(torch.tensor([3]), torch.bfloat16)[0])
