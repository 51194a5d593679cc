"""A request's life in the engine.

    WAITING ──admit──► RUNNING ──finish──► FINISHED   (eos, length, stop, aborted, error)
       ▲                 │  │
       └──preempt────────┘  └──preempt (swap)──► SWAPPED ──swap in──► RUNNING
          (recompute: blocks dropped, prefill prompt + generated tokens again)

Progress is one number, `cur_len`: how many of `tokens` have K/V in the pool. Whatever state a
request comes from (new, half-prefilled by chunks, recomputing after preemption, decoding), the
engine computes `tokens[cur_len:]` and samples a new token once nothing is pending.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from l2_paged import Request


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class SwappedKv:
    """A preempted request's K/V in host memory: per layer [num_blocks, block_size, H_kv, D]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class EngineRequest(Request):
    priority: int = 0  # larger = more important
    arrival_step: int = 0
    stop_token_ids: tuple[int, ...] = ()
    state: State = State.WAITING
    finish_reason: str | None = None  # "eos", "stop", "length", "aborted", "error"
    error: str | None = None  # why it failed, with finish_reason "error" (e.g. its sampling raised)
    last_scheduled_step: int = -1
    swapped: SwappedKv | None = None
    num_preemptions: int = 0

    @property
    def num_pending(self) -> int:
        """Tokens without K/V yet: the prompt (or a chunk's rest) at prefill, 1 when decoding."""
        return len(self.tokens) - self.cur_len

    @property
    def in_prefill(self) -> bool:
        """Are its pending tokens prompt (or a recompute's history), not one decode?"""
        return self.num_pending > 1
