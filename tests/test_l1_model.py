"""L1: the hand-written Qwen3 and its contiguous cache, checked piece by piece and against HF."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from harness import hf_reference as hf
from harness.tiny_models import QWEN3_0_6B
import probes
from helpers import (assert_cache_holds_hf_kv, budget, forward_lengths, hf_ids, prefilled_then_one_token_per_step,
                     random_prompt)
from l1_contiguous import (ContiguousKvCache, InputError, ModelLoadError, Qwen3ForCausalLM, RMSNorm,
                          RotaryEmbedding, apply_rotary, attend, forward_step, greedy_generate, load_config)

pytestmark = [pytest.mark.l1]


# ---------------------------------------------------------------- building blocks

@pytest.mark.points(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_formula(dtype):
    x = torch.randn(5, 64).to(dtype).double()  # exactly representable in `dtype`
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data = torch.rand(64) + 0.5
    got = norm.to(dtype)(x.to(dtype))  # before the expected value exists: nothing to copy it from
    expected = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6)
    # HF order: normalize in fp32, cast back to the input dtype, then multiply by the weight.
    expected = norm.weight.to(dtype) * expected.to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
    if dtype == torch.bfloat16:  # multiplying before the cast would round differently somewhere
        wrong_order = (norm.weight.double() * x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        assert torch.equal(got, expected) and not torch.equal(got, wrong_order)


@pytest.mark.points(1)
def test_rotary_is_rotate_half_with_pairs_i_and_i_plus_half():
    d, theta = 8, 10000.0
    x = torch.randn(3, 2, d)
    positions = torch.tensor([0, 5, 17])
    cos, sin = RotaryEmbedding(d, theta).cos_sin(positions, torch.float32)
    got = apply_rotary(x, cos, sin)
    # Independent: treat (x[i], x[i + d/2]) as a complex number and multiply by e^{i * pos * freq_i}.
    half = d // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = z * torch.polar(torch.ones(3, half, dtype=torch.float64), positions[:, None].double() * freqs)[:, None, :]
    expected = torch.cat((z.real, z.imag), dim=-1).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.points(1)
def test_rotary_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(16, 1e6)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(pq, pk):
        cq, sq = rope.cos_sin(torch.tensor([pq]), torch.float32)
        ck, sk = rope.cos_sin(torch.tensor([pk]), torch.float32)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    assert torch.isclose(score(10, 3), score(107, 100), atol=1e-4)
    assert not torch.isclose(score(10, 3), score(10, 4), atol=1e-4)


@pytest.mark.points(2)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_attend_gqa_causal_matches_naive_loop(heads, kv_heads):
    t, s, d = 5, 9, 16  # 5 new queries at positions 4..8 over 9 keys
    q, k, v = torch.randn(t, heads, d), torch.randn(s, kv_heads, d), torch.randn(s, kv_heads, d)
    positions = torch.arange(4, 9)
    mask = torch.arange(s)[None, :] <= positions[:, None]
    got = attend(q, k, v, mask)
    expected = torch.empty_like(got)
    for i in range(t):
        for h in range(heads):
            kh = h // (heads // kv_heads)
            n = int(positions[i]) + 1
            w = torch.softmax((k[:n, kh] @ q[i, h]) / math.sqrt(d), dim=0)
            expected[i, h] = w @ v[:n, kh]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- config and weights

def test_rope_theta_read_from_both_spellings(tmp_path, tiny_model_dir):
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    raw.pop("rope_parameters", None)
    top_level = {**raw, "rope_theta": 123456.0}
    nested = {**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 654321.0}}
    for cfg, theta in ((top_level, 123456.0), (nested, 654321.0)):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert load_config(tmp_path).rope_theta == theta


def test_head_dim_comes_from_config_not_hidden_over_heads(make_model):
    d = make_model(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    cfg = load_config(d)
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads


def test_other_architecture_is_rejected(tmp_path, tiny_model_dir):
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "llama",
                                                      "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="llama"):
        load_config(tmp_path)


def test_missing_and_misshapen_tensors_are_named(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_model_dir / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    name = "model.layers.1.self_attn.k_norm.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        Qwen3ForCausalLM.from_pretrained(tmp_path)
    save_file({**tensors, name: torch.ones(3)}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"k_norm.*shape \(3,\)"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)


def test_missing_folder_and_config_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_config(tmp_path / "nope")
    with pytest.raises(InputError, match="config.json"):
        load_config(tmp_path)


def test_tied_head_reuses_the_embedding(make_model):
    d = make_model(tie_word_embeddings=True)
    model = Qwen3ForCausalLM.from_pretrained(d)
    assert probes.data_ptr(model.lm_head.weight) == probes.data_ptr(model.model.embed_tokens.weight)


# ---------------------------------------------------------------- the cache

@pytest.mark.points(2)
def test_cache_length_after_prefill_is_t_then_grows_by_one(tiny_model_dir):
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    cache = ContiguousKvCache(model.config, 32, torch.float32)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    with torch.inference_mode():
        logits = forward_step(model, cache, prompt)
        assert cache.length == len(prompt)  # not T + 1: the argmax'd token has no K/V yet
        for step in range(1, 4):
            logits = forward_step(model, cache, [int(logits[-1].argmax())])
            assert cache.length == len(prompt) + step


@pytest.mark.points(1)
def test_each_layer_writes_its_own_cache_layer(tiny_model_dir):
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    cache = ContiguousKvCache(model.config, 8, torch.float32)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    with torch.inference_mode():
        forward_step(model, cache, [5, 6, 7])
    for layer in range(model.config.num_hidden_layers):
        assert torch.isfinite(cache.k[layer][:3]).all() and torch.isfinite(cache.v[layer][:3]).all()
    assert not torch.equal(cache.k[0][:3], cache.k[1][:3])


@pytest.mark.points(1)
def test_cache_rejects_writes_past_its_end(tiny_model_dir):
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    cache = ContiguousKvCache(model.config, 4, torch.float32)
    with torch.inference_mode():
        forward_step(model, cache, [1, 2, 3])
        with pytest.raises(InputError, match="cannot take 2 more"):
            forward_step(model, cache, [4, 5])
    assert cache.length == 3


# Decoding from the cache must give what recomputing the whole sequence gives: kv_step's contract,
# most of its points (a cache written at the wrong rows, or not read, fails only here and below).
@pytest.mark.points(4)
def test_cached_decode_equals_full_recompute(tiny_model_dir):
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    prompt = random_prompt(12, model.config.vocab_size, seed=3)
    cache = ContiguousKvCache(model.config, len(prompt) + 6, torch.float32)
    with forward_lengths(Qwen3ForCausalLM) as lengths:
        gen = greedy_generate(model, prompt, 6, cache=cache)
    assert prefilled_then_one_token_per_step(lengths, len(prompt)), lengths
    assert_cache_holds_hf_kv(tiny_model_dir, cache, prompt + gen.new_ids[:-1])
    for step, logits in enumerate(gen.logits[len(prompt) - 1:]):
        seq = prompt + gen.new_ids[:step]
        with torch.inference_mode():
            full = forward_step(model, ContiguousKvCache(model.config, len(seq), torch.float32), seq)
        torch.testing.assert_close(logits, full[-1], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the cache is what makes decode cheap
# A greedy_generate that calls HF's generate, or that feeds the whole sequence again at every step,
# produces the right ids without using the cache; these tests see how the model is run.


@pytest.mark.points(2)
def test_greedy_generate_matches_hf_prefilling_once_then_one_token_per_step(tiny_model_dir):
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    prompt = random_prompt(9, model.config.vocab_size, seed=5)
    cache = ContiguousKvCache(model.config, len(prompt) + 5, torch.float32)
    with forward_lengths(Qwen3ForCausalLM) as lengths:
        gen = greedy_generate(model, prompt, 5, cache=cache, stop_ids=[])
    assert lengths == [9, 1, 1, 1, 1], "one forward of the prompt, then one token per decode step"
    assert gen.new_ids == hf_ids(tiny_model_dir, prompt, 5)
    assert_cache_holds_hf_kv(tiny_model_dir, cache, prompt + gen.new_ids[:-1])


@pytest.mark.points(2)
def test_decode_reads_the_cache_so_poisoning_it_changes_the_output(tiny_model_dir):
    """After the prefill, the cached K/V of the prompt are overwritten with noise: the decode steps
    must read them, so their logits change."""
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    prompt = random_prompt(8, model.config.vocab_size, seed=6)
    cache = ContiguousKvCache(model.config, len(prompt) + 3, torch.float32)

    def poison_after_prefill(module, args, output):
        if args[0].numel() == len(prompt):
            for layer in range(model.config.num_hidden_layers):
                cache.k[layer][: len(prompt)] = torch.randn_like(cache.k[layer][: len(prompt)]) * 10
    model.register_forward_hook(poison_after_prefill)
    poisoned = greedy_generate(model, prompt, 3, cache=cache, stop_ids=[])
    clean = greedy_generate(Qwen3ForCausalLM.from_pretrained(tiny_model_dir), prompt, 3, stop_ids=[])
    assert len(poisoned.logits) == len(clean.logits) == len(prompt) + 2
    assert torch.equal(poisoned.logits[len(prompt) - 1], clean.logits[len(prompt) - 1])  # prefill untouched
    assert not torch.allclose(poisoned.logits[len(prompt)], clean.logits[len(prompt)], atol=1e-3), \
        "the first decode step did not read the cache it was given"


@pytest.mark.points(1)
def test_l1_matches_hf_with_transformers_unimportable(tiny_model_dir, monkeypatch):
    """HF is the oracle, never the implementation: with transformers unimportable, and imported by
    no file of l1_contiguous/, greedy_generate still gives HF's ids."""
    import ast

    from helpers import student_package

    for path in student_package("l1_contiguous").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "transformers" for n in names), f"{path.name} imports transformers"
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    prompt = random_prompt(7, model.config.vocab_size, seed=8)
    cache = ContiguousKvCache(model.config, len(prompt) + 4, torch.float32)
    with monkeypatch.context() as blocked:
        blocked.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
        with forward_lengths(Qwen3ForCausalLM) as lengths:
            got = greedy_generate(model, prompt, 4, cache=cache).new_ids
    assert prefilled_then_one_token_per_step(lengths, len(prompt)), lengths
    assert got == hf_ids(tiny_model_dir, prompt, 4)
    assert_cache_holds_hf_kv(tiny_model_dir, cache, prompt + got[:-1])


# ---------------------------------------------------------------- against HF

CONFIGS = {
    "hd32-gqa2-untied": dict(head_dim=32, num_attention_heads=4, num_key_value_heads=2),
    "hd64-mha-tied": dict(head_dim=64, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True),
    "hd128-gqa4-untied": dict(head_dim=128, num_attention_heads=4, num_key_value_heads=1),
    "hd16-gqa4-tied-3layers": dict(head_dim=16, num_attention_heads=8, num_key_value_heads=2,
                                   num_hidden_layers=3, tie_word_embeddings=True),
}


@pytest.mark.points(2)
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_greedy_ids_match_hf_across_configs(make_model, name):
    d = make_model(seed=len(name), **CONFIGS[name])
    model = Qwen3ForCausalLM.from_pretrained(d)
    prompt = random_prompt(13, model.config.vocab_size, seed=1)
    cache = ContiguousKvCache(model.config, len(prompt) + 10, torch.float32)
    with forward_lengths(Qwen3ForCausalLM) as lengths:
        gen = greedy_generate(model, prompt, 10, cache=cache)
    assert prefilled_then_one_token_per_step(lengths, len(prompt)), lengths
    assert_cache_holds_hf_kv(d, cache, prompt + gen.new_ids[:-1])
    hf_model = hf.load_hf_model(str(d))
    assert gen.new_ids == hf.hf_greedy(hf_model, prompt, 10)
    ref = hf.hf_logits(hf_model, prompt + gen.new_ids[:-1])
    torch.testing.assert_close(torch.stack(gen.logits), ref, rtol=0, atol=1e-4)
    check_stop_ids(model, prompt, gen.new_ids)


def check_stop_ids(model, prompt: list[int], ids: list[int]) -> None:
    """The stop rule of L1 §3: with one of the ids it produced given as a stop id, greedy_generate
    returns the ids up to and including its first occurrence (kept, as HF keeps EOS), after one
    forward per id, no more; a stop id it never produces changes nothing."""
    k = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), None)
    assert k is not None, "every id repeats the first: pick another prompt"
    with forward_lengths(Qwen3ForCausalLM) as lengths:
        stopped = greedy_generate(model, prompt, len(ids), stop_ids=[ids[k]])
    assert stopped.new_ids == ids[:k + 1], f"stop id {ids[k]} at new token {k}: expected {ids[:k + 1]}"
    assert len(lengths) == k + 1, f"{len(lengths)} forwards for {k + 1} ids: it went on after the stop id"
    assert len(stopped.logits) == len(prompt) + k, "one logits row per position fed"
    first = greedy_generate(model, prompt, len(ids), stop_ids=[ids[0]])
    assert first.new_ids == ids[:1], "a stop id picked first ends the run at once"
    absent = next(i for i in range(model.config.vocab_size) if i not in ids)
    assert greedy_generate(model, prompt, len(ids), stop_ids=[absent]).new_ids == ids


@pytest.mark.points(2)
@pytest.mark.parametrize("length", [1, 23, 70])  # 70 crosses 64 positions
def test_greedy_ids_match_hf_for_prompt_lengths(tiny_model_dir, length):
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    prompt = random_prompt(length, model.config.vocab_size, seed=length)
    cache = ContiguousKvCache(model.config, length + 16, torch.float32)
    with forward_lengths(Qwen3ForCausalLM) as lengths:
        ids = greedy_generate(model, prompt, 16, cache=cache, stop_ids=[]).new_ids
    assert lengths == [length] + [1] * 15  # the cache, not a recompute, serves each decode step
    assert ids == hf_ids(tiny_model_dir, prompt, 16)
    assert_cache_holds_hf_kv(tiny_model_dir, cache, prompt + ids[:-1])
    check_stop_ids(model, prompt, ids)


@pytest.mark.points(1)
def test_hf_comparison_notices_adjacent_pair_rope(tiny_model_dir, monkeypatch):
    """The check is sharp enough: GPT-J-style RoPE (pairs 2i, 2i+1) must not pass for Qwen3's."""
    import l1_contiguous.model as m

    def adjacent_pairs(x, cos, sin):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[:, None, : x.shape[-1] // 2], sin[:, None, : x.shape[-1] // 2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)

    monkeypatch.setattr(m, "apply_rotary", adjacent_pairs)
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir)
    prompt = random_prompt(20, model.config.vocab_size, seed=9)
    cache = ContiguousKvCache(model.config, 24, torch.float32)
    with forward_lengths(Qwen3ForCausalLM) as lengths:
        gen = greedy_generate(model, prompt, 4, cache=cache, stop_ids=[])
    assert lengths == [20, 1, 1, 1] and cache.length == 23
    ref = hf.hf_logits(hf.load_hf_model(str(tiny_model_dir)), prompt + gen.new_ids[:-1])
    assert (torch.stack(gen.logits) - ref).abs().max() > 1e-2


@pytest.mark.points(2)
def test_qwen3_0_6b_shapes_sharded_checkpoint_matches_hf(make_model):
    """Qwen3-0.6B's config (vocab 151936, head_dim 128 != 1024/16, tied) cut to 2 layers (1 in the
    fast loop), stored sharded and in bfloat16 as the published checkpoint is, run in float32."""
    d = make_model(shard_size="150MB", hf_init=False, dtype="bfloat16",
                   **{**QWEN3_0_6B, "num_hidden_layers": budget(2, 1)})
    assert (d / "model.safetensors.index.json").is_file()
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    model = Qwen3ForCausalLM.from_pretrained(d)
    assert model.dtype == torch.float32 and model.config.head_dim == 128 and model.config.tie_word_embeddings
    prompt = random_prompt(9, model.config.vocab_size, seed=2)
    cache = ContiguousKvCache(model.config, len(prompt) + budget(6, 3), torch.float32)
    with forward_lengths(Qwen3ForCausalLM) as lengths:
        gen = greedy_generate(model, prompt, budget(6, 3), cache=cache)
    assert prefilled_then_one_token_per_step(lengths, len(prompt)), lengths
    assert cache.length == len(prompt) + len(gen.new_ids) - 1, "the cache it was given holds every fed position"
    hf_model = hf.load_hf_model(str(d))
    assert gen.new_ids == hf.hf_greedy(hf_model, prompt, budget(6, 3))
    ref = hf.hf_logits(hf_model, prompt + gen.new_ids[:-1])
    # Logits of this random model reach ~±100; compare relative to their scale.
    assert (torch.stack(gen.logits) - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-4


@pytest.mark.slow  # no points: the autograder runs no soak; the 2-layer test above carries them
def test_qwen3_0_6b_full_depth_matches_hf(make_model):
    d = make_model(shard_size="1GB", hf_init=False, dtype="bfloat16", **QWEN3_0_6B)
    model = Qwen3ForCausalLM.from_pretrained(d)
    prompt = random_prompt(7, model.config.vocab_size, seed=4)
    assert greedy_generate(model, prompt, 4).new_ids == hf_ids(d, prompt, 4)
