"""Prefill the prompt in one forward, then decode one greedy token per forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import ContiguousKvCache
from .model import Qwen3ForCausalLM


@dataclass
class StepMeta:
    """What one forward of one request needs besides the token ids."""

    positions: torch.Tensor  # [T] int64, absolute positions of the new tokens
    attn_mask: torch.Tensor | None  # [T, S] bool, True where new token t may read cached key s


def causal_mask(positions: torch.Tensor, num_keys: int) -> torch.Tensor | None:
    """Query at position p reads keys 0..p. None for a single newest token (it reads everything)."""
    if positions.numel() == 1 and int(positions[0]) == num_keys - 1:
        return None
    key_positions = torch.arange(num_keys, device=positions.device)
    return key_positions[None, :] <= positions[:, None]


@dataclass
class Generation:
    new_ids: list[int] = field(default_factory=list)
    # logits[t] is the model's prediction for the token after position t: the prompt's
    # positions first (only the last one with keep_prompt_logits=False), then one row per
    # decode step. [T + N - 1, vocab], float32.
    logits: list[torch.Tensor] = field(default_factory=list)


def forward_step(model: Qwen3ForCausalLM, cache: ContiguousKvCache, ids: list[int],
                 last_only: bool = False) -> torch.Tensor:
    """Run `ids` at the cache's next positions; returns logits [len(ids), vocab] ([1, vocab] if last_only)."""
    cache.check_room(len(ids))
    device = model.device
    positions = torch.arange(cache.length, cache.length + len(ids), device=device)
    meta = StepMeta(positions, causal_mask(positions, cache.length + len(ids)))
    last = torch.tensor([len(ids) - 1], device=device) if last_only else None
    logits = model(torch.tensor(ids, device=device), cache, meta, logits_for=last)
    cache.advance(len(ids))
    return logits


@torch.inference_mode()
def greedy_generate(model: Qwen3ForCausalLM, prompt_ids: list[int], max_new_tokens: int,
                    cache: ContiguousKvCache | None = None, stop_ids=None,
                    keep_prompt_logits: bool = True) -> Generation:
    """Greedy decoding with a contiguous cache; stops after a stop id (kept, as HF keeps EOS).

    keep_prompt_logits=False keeps only the last prompt position's row (a 4k-token prompt on a
    151,936-word vocabulary would otherwise hold 2.3 GiB of float32 logits).
    """
    stop_ids = set(model.config.eos_token_ids if stop_ids is None else stop_ids)
    if cache is None:
        cache = ContiguousKvCache(model.config, len(prompt_ids) + max_new_tokens, model.dtype, model.device)
    out = Generation()
    # BEGIN SOLUTION
    logits = forward_step(model, cache, prompt_ids, last_only=not keep_prompt_logits)
    out.logits.extend(logits.float())
    while len(out.new_ids) < max_new_tokens:
        token = int(out.logits[-1].argmax())
        out.new_ids.append(token)
        if token in stop_ids or len(out.new_ids) == max_new_tokens:
            break
        out.logits.append(forward_step(model, cache, [token])[0].float())
    # END SOLUTION
    return out
