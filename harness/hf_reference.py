"""The oracle: HuggingFace transformers' Qwen3 on the same folder, device and dtype.

Every smoke script and test compares against these functions; nothing else imports HF modeling.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@functools.lru_cache(maxsize=4)
def load_hf_model(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """AutoModelForCausalLM in eval mode, cached (tests load the same folder many times)."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, cache_factory=None) -> list[int]:
    """HF `generate` with do_sample=False, one request alone; returns the new tokens only."""
    return hf_greedy_with_logits(model, prompt_ids, max_new_tokens, cache_factory)[0]


@torch.inference_mode()
def hf_greedy_with_logits(model, prompt_ids: list[int], max_new_tokens: int,
                          cache_factory=None) -> tuple[list[int], torch.Tensor]:
    """HF greedy `generate`, and the logits it chose each new token from (its own cached steps,
    in the model's dtype, returned as float32): ([new ids], [len(new ids), vocab]).
    cache_factory: makes the request's cache (L12's QuantizingCache); default HF's own."""
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=_first(eos) if eos is not None else 0,
                              output_logits=True, return_dict_in_generate=True)
    ids = torch.tensor([prompt_ids], device=model.device)
    cache = {} if cache_factory is None else {"past_key_values": cache_factory()}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, **cache)
    new_ids = out.sequences[0, len(prompt_ids):].tolist()
    logits = torch.stack([step[0] for step in out.logits])[:len(new_ids)].float().cpu()
    return new_ids, logits


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of one forward over `ids` with no cache: [len(ids), vocab], float32."""
    out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
    return out.logits[0].float()


@torch.inference_mode()
def hf_kv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """HF's cached K and V after one forward over `ids`, per layer, each [len(ids), H_kv, D] in
    float32: keys after k_norm and RoPE, as a cache stores them."""
    out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=True)
    return [(layer.keys[0].transpose(0, 1).float().cpu(), layer.values[0].transpose(0, 1).float().cpu())
            for layer in out.past_key_values.layers]


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row: small gaps are where two correct runs may disagree."""
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def greedy_step_logits(model, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """HF logits at the positions that chose `new_ids`: [len(new_ids), vocab]."""
    seq = prompt_ids + new_ids[:-1]
    return hf_logits(model, seq)[len(prompt_ids) - 1:]


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) else value
