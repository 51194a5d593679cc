"""Hybrid models (provided code, no points): the config is read as transformers' Qwen3Config reads
it; L1's model with sliding layers gives HF's greedy ids, which differ from full attention's on the
same weights (the window matters on these prompts); lessons whose attention ignores windows refuse
a hybrid model instead of computing another one."""

from __future__ import annotations

import pytest

from harness import hf_reference as hf
from helpers import kjv_prompts
from l1_contiguous import ModelLoadError, Qwen3Config, Qwen3ForCausalLM, greedy_generate
from l3_block_kernel import load_block_model
from l5_eviction import load_engine_model

pytestmark = pytest.mark.l13

BASE = dict(model_type="qwen3", vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=6,
            num_attention_heads=2, num_key_value_heads=1, head_dim=4)


@pytest.mark.parametrize("extra", [
    {},
    {"use_sliding_window": True, "sliding_window": 8},  # no layer_types: layers from max_window_layers on
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
    {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"] * 3},
    {"use_sliding_window": False, "layer_types": ["sliding_attention", "full_attention"] * 3},
    {"use_sliding_window": True, "sliding_window": None, "layer_types": ["sliding_attention"] * 6},
])
def test_config_reads_windows_as_transformers_does(extra):
    from transformers import Qwen3Config as HfConfig

    theirs = HfConfig(**{k: v for k, v in {**BASE, **extra}.items() if k != "model_type"})
    ours = Qwen3Config.from_dict({**BASE, **extra})
    # HF's attention gets a window only where the layer type says so and the config has one.
    expect = [theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types]
    assert [ours.window_of(i) for i in range(6)] == expect


@pytest.mark.parametrize("bad", [["full_attention"] * 5, ["full", "sliding"] * 3, "sliding_attention"])
def test_config_refuses_layer_types_that_do_not_name_each_layer(bad):
    with pytest.raises(ModelLoadError, match="layer_types"):
        Qwen3Config.from_dict({**BASE, "layer_types": bad})


def test_l1_on_the_hybrid_embedded_model_matches_hf_and_differs_from_full_attention(hybrid_model_dir,
                                                                                    embedded_model_dir):
    hybrid, full = Qwen3ForCausalLM.from_pretrained(hybrid_model_dir), Qwen3ForCausalLM.from_pretrained(embedded_model_dir)
    oracle = hf.load_hf_model(str(hybrid_model_dir))
    differs = 0
    for prompt in kjv_prompts(hybrid_model_dir, [(0, 120), (1200, 90)]):
        ours = greedy_generate(hybrid, prompt, 40).new_ids
        assert ours == hf.hf_greedy(oracle, prompt, 40)
        differs += ours != greedy_generate(full, prompt, 40).new_ids
    assert differs, "the window changed nothing on these prompts: they test nothing about it"


def test_lessons_that_read_every_position_refuse_a_hybrid_model(hybrid_model_dir):
    with pytest.raises(ModelLoadError, match="sliding window of 64"):
        load_block_model(hybrid_model_dir)


def test_l5s_engine_reads_the_window_through_l4_and_gives_the_hybrid_models_ids(hybrid_model_dir):
    """L4's attention applies each layer's window, so L5's engine (one table, nothing freed) runs a
    hybrid model to HF's ids; keeping every block is what L13 improves on."""
    from l5_eviction import WorkItem, make_engine
    prompts = kjv_prompts(hybrid_model_dir, [(0, 120), (1200, 90)])
    engine = make_engine(load_engine_model(hybrid_model_dir), 40, 16, prefill_chunk=48)
    done = engine.run([WorkItem(p, 30) for p in prompts])
    oracle = hf.load_hf_model(str(hybrid_model_dir))
    for req, prompt in zip(sorted(done.values(), key=lambda r: r.request_id), prompts):
        assert req.output_ids == hf.hf_greedy(oracle, prompt, 30)
