"""Sampling for L8's n > 1: a temperature and a random generator per sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l1_contiguous import InputError
from l1_contiguous.errors import one_line, short_repr
from l5_eviction import WorkItem

MAX_TEMPERATURE = 100.0  # above this, softmax(logits / T) is all but uniform: sampling noise, not text
# Below this a temperature is greedy (vLLM's rule too): softmax(logits / T) is one-hot there anyway,
# and a T such as 1e-39 would overflow logits / T to inf and the softmax to NaN.
GREEDY_BELOW = 1e-5
SEED_LIMIT = 2**64  # torch.Generator seeds are unsigned 64-bit; sample k uses seed + k


@dataclass
class SampledWorkItem(WorkItem):
    n: int = 1  # parallel samples of this prompt
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # sample k draws from a generator seeded with seed + k


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def check_sampling(item: WorkItem, who: str, num_blocks: int) -> None:
    """InputError naming `who` for an n, temperature or seed the engine cannot honour."""
    n, temperature, seed = getattr(item, "n", 1), getattr(item, "temperature", 0.0), getattr(item, "seed", 0)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= num_blocks:
        raise InputError(f"{who}: n (samples) must be an int from 1 to the pool's {num_blocks} "
                         f"blocks (each sample writes into a block of its own), got {short_repr(n)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature <= MAX_TEMPERATURE:  # NaN fails this too
        raise InputError(f"{who}: temperature must be a number from 0 (greedy) to {MAX_TEMPERATURE:g}, "
                         f"got {short_repr(temperature)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_LIMIT - n:
        raise InputError(f"{who}: seed must be an int from 0 to 2**64 - n (sample k draws with seed + k), "
                         f"got {short_repr(seed)}")


def draw(req, logits_row: torch.Tensor) -> int:
    """Greedy at temperature 0 (below GREEDY_BELOW), else one draw from softmax(logits / T) with the
    request's generator."""
    if is_greedy(req.temperature):
        return int(logits_row.argmax())
    probs = torch.softmax(logits_row.float() / req.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=req.generator))


def draw_or_fail(req, logits_row: torch.Tensor) -> int:
    """`draw`, or -1 with `req.error` set if this request's sampling fails (e.g. NaN logits):
    the engine then finishes it alone with finish_reason "error" (see Engine.commit)."""
    try:
        return draw(req, logits_row)
    except Exception as exc:
        req.error = f"sampling failed: {one_line(exc)}"
        return -1
