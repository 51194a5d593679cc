"""The embedded model: its files load through our loader and HF's, its config is what the
training script writes, and its default continuations read as (KJV) English."""

from __future__ import annotations

import json
import re

import pytest
import torch

from harness import hf_reference as hf
from harness.smoke import DEFAULT_MODEL, DEFAULT_PROMPTS
from helpers import load_script
from l1_contiguous import Qwen3ForCausalLM, greedy_generate, load_config

pytestmark = [pytest.mark.course]

CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                 "rms_norm_eps", "tie_word_embeddings", "eos_token_id", "rope_parameters")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))


def test_files_are_small_and_complete():
    names = {p.name for p in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir()) < 20 * 2**20


def test_config_is_what_the_training_script_writes(tokenizer):
    script = load_script("train_tiny_model")
    written = script.build_model(tokenizer.eos_token_id).config.to_dict()
    committed = json.loads((DEFAULT_MODEL / "config.json").read_text())
    for field in CONFIG_FIELDS:
        assert committed[field] == written[field], field
    assert load_config(DEFAULT_MODEL).gqa_group_size == 2  # GQA, so the head mapping is exercised


def test_our_loader_and_hf_agree_on_the_committed_weights(tokenizer):
    ids = tokenizer.encode("And God said, Let there be light: and there was light.")
    ours = Qwen3ForCausalLM.from_pretrained(DEFAULT_MODEL)
    gen = greedy_generate(ours, ids, 2)
    ref = hf.hf_logits(hf.load_hf_model(str(DEFAULT_MODEL)), ids + gen.new_ids[:-1])
    torch.testing.assert_close(torch.stack(gen.logits), ref, rtol=0, atol=1e-4)


def test_tokenizer_loads_offline_and_round_trips(tokenizer):
    text = "In the beginning God created the heaven and the earth."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("prompt", DEFAULT_PROMPTS)
def test_default_continuations_are_words_not_loops(tokenizer, prompt):
    model = Qwen3ForCausalLM.from_pretrained(DEFAULT_MODEL)
    new_ids = greedy_generate(model, tokenizer.encode(prompt), 20).new_ids
    words = re.findall(r"[A-Za-z]+", tokenizer.decode(new_ids))
    assert len(new_ids) == 20 and len(words) >= 10
    assert len({w.lower() for w in words}) / len(words) >= 0.4  # not "and in the month" forever
    # A word the BPE learned as one whole-word token is a word of the corpus, not a fragment.
    vocab = tokenizer.get_vocab()
    known = [w for w in words if "\u0120" + w in vocab or w in vocab]
    assert len(known) / len(words) >= 0.7
