"""A request of L8's engine: L5's, with its prefix keys and its sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from l5_eviction import EngineRequest


@dataclass
class PrefixRequest(EngineRequest):
    block_keys: list[bytes] = field(default_factory=list)  # keys of its leading full blocks
    prompt_keys: list[bytes] = field(default_factory=list)  # keys of the full blocks it computes or hit
    held_steps: int = 0  # steps it was held waiting for a prefix another request computes
    temperature: float = 0.0
    generator: torch.Generator | None = None
    forks: list[int] = field(default_factory=list)  # sample indices to fork after the prefill
    group: int = 0  # request id of the first sample of its prompt
    sample_index: int = 0
