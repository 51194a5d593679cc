"""L12 against its oracle: HF's Qwen3 with a cache that quantizes on write (harness/quantized_cache.py,
which never imports the lesson). Logits step by step, prefill in chunks then decode, through a
pool filled with NaN codes, each decode step handing attention the pool's own codes; greedy ids
through the engine with preemption by recompute and by swap, prefix sharing and n > 1; the
calibration pool's amax against the K and V HF computes; a block cached under other scales is
never reused."""

from __future__ import annotations

import functools

import pytest
import torch

from harness import hf_reference as hf
from harness.quantized_cache import QuantizingCache
import probes
from helpers import random_prompt
from l2_paged import BlockAllocator, Request, blocks_needed, reserve
from l4_paged_prefill import build_paged_meta
from l5_eviction import WorkItem
from l8_prefix import SampledWorkItem
from l12_quantized_kv import FP8_E4M3, INT8, KvScales
from l12_quantized_kv.engine import calibrate, load_quantized_model, make_quantized_engine
from l12_quantized_kv.pool import CalibrationPool, QuantizedKvPool

pytestmark = [pytest.mark.l12, pytest.mark.usefixtures("one_torch_thread")]

VOCAB = 512  # harness.tiny_models.TINY
BS = 4
CALIBRATION = [random_prompt(40, VOCAB, seed=70 + i) for i in range(3)]
SETTINGS = [(FP8_E4M3, "head"), (FP8_E4M3, "tensor"), (INT8, "head"), (INT8, "tensor")]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_quantized_model(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return hf.load_hf_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def scales_for(model):
    return functools.lru_cache(maxsize=None)(lambda fmt, granularity: calibrate(model, CALIBRATION, fmt, granularity))


def oracle(scales: KvScales) -> QuantizingCache:
    return QuantizingCache(scales.fmt.name, scales.k, scales.v)


@torch.inference_mode()
def hf_step_logits(hf_model, ids: list[int], prompt_len: int, cache) -> torch.Tensor:
    """HF's logits at every position: one forward over the prompt, then one per token: [len(ids), vocab]."""
    rows = [hf_model(input_ids=torch.tensor([ids[:prompt_len]]), past_key_values=cache, use_cache=True).logits[0]]
    for t in range(prompt_len, len(ids)):
        rows.append(hf_model(input_ids=torch.tensor([[ids[t]]]), past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(rows).float()


def check_decode_hands_codes(model, pool, scales, scratch, backend: str) -> None:
    """§2.5's decode contract, in every layer: kv_step hands attention the layer's own code blocks
    (a view of the pool, neither dequantized nor copied) and its scales, so that decode reads codes
    through L4's attention. A kv_step that dequantizes the whole pool every step gives the same
    logits through the float path, reading four times the bytes: logits cannot tell.
    Writes one token at position 1 of `scratch`, a request whose block nothing else reads."""
    scratch.cur_len, scratch.output_ids = 1, [11]
    _, meta = build_paged_meta([scratch], [1], "cpu", backend)
    cfg = model.config
    k = torch.randn(1, cfg.num_key_value_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    for layer, block in enumerate(model.model.layers):
        k_all, v_all = block.self_attn.kv_step(k, k.clone(), pool, meta)
        for got, codes, layer_scales in ((k_all, pool.k_blocks[layer], scales.k[layer]),
                                         (v_all, pool.v_blocks[layer], scales.v[layer])):
            assert getattr(got, "codes", None) is not None, (
                f"layer {layer}: a decode step's kv_step returned a {type(got).__name__}, not the code blocks and "
                f"scales (QuantizedBlocks): decode must not dequantize the pool (§2.5)")
            assert probes.data_ptr(got.codes) == probes.data_ptr(codes) and got.codes.shape == codes.shape, \
                f"layer {layer}: a decode step's kv_step handed attention a copy of the codes, not the pool's own"
            assert torch.equal(got.scales, layer_scales), f"layer {layer}: decode's scales are not the layer's"


@torch.inference_mode()
def our_step_logits(model, scales, ids: list[int], chunks: list[int], backend: str) -> torch.Tensor:
    """The same positions through L12's attention on a quantized pool of NaN codes: prefill in
    `chunks` (a later chunk reads the earlier ones' codes), then one decode step per token, each
    of which reads codes (check_decode_hands_codes)."""
    n = blocks_needed(len(ids), BS) + 2
    pool = QuantizedKvPool(model.config, n, BS, scales)
    pool.fill_nan()
    alloc = BlockAllocator(n, BS)
    scratch = Request([7], 2)
    reserve(scratch, alloc, 2)  # block 0: the request's blocks do not start at 0
    prompt_len = sum(chunks)
    req = Request(list(ids[:prompt_len]), len(ids))
    reserve(req, alloc, len(ids))
    rows = []
    for chunk in chunks:
        input_ids, meta = build_paged_meta([req], [chunk], "cpu", backend)
        rows.append(model(input_ids, pool, meta, logits_for=torch.arange(chunk)))
        req.cur_len += chunk
    for t in range(prompt_len, len(ids)):
        req.output_ids.append(ids[t])
        input_ids, meta = build_paged_meta([req], [1], "cpu", backend)
        rows.append(model(input_ids, pool, meta, logits_for=torch.arange(1)))
        req.cur_len += 1
    check_decode_hands_codes(model, pool, scales, scratch, backend)
    return torch.cat(rows).float()


@pytest.mark.points(2)
@pytest.mark.parametrize("fmt, granularity", SETTINGS, ids=lambda x: getattr(x, "name", x))
def test_logits_equal_the_quantizing_oracle_prefill_in_chunks_then_decode(model, hf_model, scales_for, fmt,
                                                                           granularity):
    scales = scales_for(fmt, granularity)
    ids = random_prompt(23, VOCAB, seed=5)
    ours = our_step_logits(model, scales, ids, [7, 6], backend="reference")
    want = hf_step_logits(hf_model, ids, 13, oracle(scales)())
    unquantized = hf_step_logits(hf_model, ids, 13, None)
    diff, cost = float((ours - want).abs().max()), float((unquantized - want).abs().max())
    assert not torch.isnan(ours).any(), "NaN in the logits: a position was read before it was written"
    assert cost > 1e-3, f"test setup: quantization moves the logits by only {cost:.2g}"
    assert diff < cost / 100, (f"logits differ from the quantizing oracle by {diff:.3g} (quantization itself "
                               f"moves them by {cost:.3g}): K/V are not stored and read back as codes * scale")


@pytest.mark.points(1)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_decode_through_every_backend_equals_the_oracle(model, hf_model, scales_for, backend):
    scales = scales_for(INT8, "head")
    ids = random_prompt(19, VOCAB, seed=6)
    ours = our_step_logits(model, scales, ids, [9], backend=backend)
    want = hf_step_logits(hf_model, ids, 9, oracle(scales)())
    assert float((ours - want).abs().max()) < 1e-4


@functools.lru_cache(maxsize=None)
def _oracle_ids(model_dir: str, prompt: tuple[int, ...], n: int, fmt: str, k: tuple, v: tuple) -> list[int]:
    model = hf.load_hf_model(model_dir)
    cache = QuantizingCache(fmt, [torch.tensor(s) for s in k], [torch.tensor(s) for s in v])
    ids, logits = hf.hf_greedy_with_logits(model, list(prompt), n, cache)
    assert float(hf.top2_gaps(logits).min()) > 5e-3, "test setup: a near tie in the oracle's ids; pick another prompt"
    return ids


def oracle_ids(model_dir, prompt, n, scales: KvScales) -> list[int]:
    return _oracle_ids(str(model_dir), tuple(prompt), n, scales.fmt.name,
                       tuple(tuple(s.tolist()) for s in scales.k), tuple(tuple(s.tolist()) for s in scales.v))


PREFIX = random_prompt(18, VOCAB, seed=14)  # no near tie in the oracle's ids below


@pytest.mark.points(2)
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_every_request_ends_with_the_oracles_ids_under_preemption_and_sharing(model, tiny_model_dir, scales_for,
                                                                              preempt):
    scales = scales_for(FP8_E4M3, "head")
    prompts = [PREFIX + random_prompt(3 + i, VOCAB, seed=20 + i) for i in range(4)]
    items = [SampledWorkItem(p, 14, arrival_step=i, n=2 if i == 3 else 1) for i, p in enumerate(prompts)]
    engine = make_quantized_engine(model, scales, 16, BS, preempt=preempt, prefill_chunk=8, backend="cpu")
    engine.pool.fill_nan()
    requests = engine.run(items)
    s = engine.summary()
    assert s["preempted_" + preempt] > 0, "test setup: the pool never ran out"
    assert s["prefix_hit_tokens"] > 0 and s["fork_shared_tokens"] > 0, "test setup: nothing was shared"
    for r in requests.values():
        assert r.output_ids == oracle_ids(tiny_model_dir, r.prompt_ids, 14, scales), f"request {r.request_id}"
    engine.alloc.check()
    assert engine.alloc.num_free == engine.alloc.num_blocks


def test_a_swapped_block_comes_back_bit_identical(model, scales_for):
    scales = scales_for(INT8, "head")
    engine = make_quantized_engine(model, scales, 12, BS, preempt="swap", backend="cpu")
    engine.add_request(WorkItem(random_prompt(21, VOCAB, seed=9), 4))
    engine.step()
    (req,) = engine.requests.values()
    before = [(k[req.blocks].clone(), v[req.blocks].clone()) for k, v in zip(engine.pool.k_blocks, engine.pool.v_blocks)]
    engine.scheduler.running.remove(req)
    engine.preemptor.preempt(req)
    assert req.swapped is not None and req.swapped.k[0].dtype == torch.int8, "swap moves the codes, not values"
    engine.preemptor.alloc.alloc_blocks(2)  # the request comes back into other blocks
    engine.preemptor.swap_in(req)
    after = [(k[req.blocks], v[req.blocks]) for k, v in zip(engine.pool.k_blocks, engine.pool.v_blocks)]
    for (k0, v0), (k1, v1) in zip(before, after):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


@pytest.mark.points(2)
def test_a_block_cached_under_other_scales_is_never_reused(model, tiny_model_dir, scales_for):
    old, new = scales_for(INT8, "tensor"), scales_for(INT8, "head")
    prompt = PREFIX + [7, 7, 7]
    engine = make_quantized_engine(model, old, 24, BS, backend="cpu")
    engine.run([WorkItem(prompt, 6)])
    assert engine.alloc.cached_free, "test setup: nothing was cached"
    engine.run([WorkItem(prompt, 6)])
    assert engine.prefix.prefix_hit_tokens == 20, "the same 21-token prompt under the same scales hits 5 full blocks"
    engine.set_scales(new)
    hits = engine.prefix.prefix_hit_tokens
    requests = engine.run([WorkItem(prompt, 6)])
    assert engine.prefix.prefix_hit_tokens == hits, "a block written under the old scales was reused"
    assert requests[max(requests)].output_ids == oracle_ids(tiny_model_dir, prompt, 6, new)


@pytest.mark.points(3)
def test_the_calibration_pool_keeps_the_largest_abs_k_and_v_of_each_layers_heads(model, hf_model):
    prompts = [random_prompt(13, VOCAB, seed=30), random_prompt(29, VOCAB, seed=31)]
    pool = CalibrationPool(model.config, 12, BS)
    alloc = BlockAllocator(12, BS)
    want_k = torch.zeros(model.config.num_hidden_layers, model.config.num_key_value_heads)
    want_v = torch.zeros_like(want_k)
    for p in prompts:  # the second prompt's chunks come in two forwards: the amax is a running max
        req = Request(p, 1)
        reserve(req, alloc, len(p))
        for chunk in (len(p) // 2, len(p) - len(p) // 2):
            input_ids, meta = build_paged_meta([req], [chunk], "cpu")
            model(input_ids, pool, meta)
            req.cur_len += chunk
        with torch.inference_mode():
            cache = hf_model(input_ids=torch.tensor([p]), use_cache=True).past_key_values
        for layer in range(len(want_k)):
            k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [H_kv, T, D]
            want_k[layer] = torch.maximum(want_k[layer], k.abs().amax(dim=(1, 2)))
            want_v[layer] = torch.maximum(want_v[layer], v.abs().amax(dim=(1, 2)))
    torch.testing.assert_close(pool.k_amax, want_k, rtol=1e-5, atol=0)
    torch.testing.assert_close(pool.v_amax, want_v, rtol=1e-5, atol=0)
    nan = torch.full((1, model.config.num_key_value_heads, model.config.head_dim), float("nan"))
    pool.set_kv(0, torch.tensor([0]), nan, nan)
    assert torch.isnan(pool.k_amax[0]).all() and torch.isnan(pool.v_amax[0]).all(), "a NaN written must reach the amax"


def test_set_scales_is_refused_while_requests_run(model, scales_for):
    engine = make_quantized_engine(model, scales_for(FP8_E4M3, "head"), 12, BS, backend="cpu")
    engine.add_request(WorkItem(random_prompt(9, VOCAB, seed=2), 5))
    engine.step()
    with pytest.raises(ValueError, match="between requests"):
        engine.set_scales(scales_for(FP8_E4M3, "tensor"))


@pytest.mark.points(1)
def test_decode_hands_the_pools_own_code_blocks_to_attention(model, scales_for):
    """Dequantizing the whole pool for every decode step would give the same ids and read four
    times the bytes (and copy them): decode passes the code blocks themselves, not a copy."""
    scales = scales_for(FP8_E4M3, "head")
    pool = QuantizedKvPool(model.config, 6, BS, scales)
    alloc = BlockAllocator(6, BS)
    req = Request(random_prompt(5, VOCAB, seed=3), 2)
    reserve(req, alloc, 6)
    req.cur_len = 5
    req.output_ids.append(11)
    _, meta = build_paged_meta([req], [1], "cpu", "cpu")
    attention = model.model.layers[1].self_attn
    k = torch.randn(1, model.config.num_key_value_heads, model.config.head_dim)
    k_all, v_all = attention.kv_step(k, k.clone(), pool, meta)
    for got, codes, layer_scales in ((k_all, pool.k_blocks[1], scales.k[1]), (v_all, pool.v_blocks[1], scales.v[1])):
        assert probes.data_ptr(got.codes) == probes.data_ptr(codes) and got.codes.shape == codes.shape
        assert torch.equal(got.scales, layer_scales)
    slot = req.slot_indices[5]
    assert torch.equal(pool.K[1][slot].float(), (k[0] / scales.k[1].view(-1, 1)).to(torch.float8_e4m3fn).float())
