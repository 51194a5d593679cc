"""Who is preempted when a running request needs a block and none is free.

A policy is a key: the request with the *smallest* key is the victim, and the scheduler serves
running requests from the largest key down, so victims are always taken from requests that
were not yet given blocks in this step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .lifecycle import EngineRequest


def lru_key(req: EngineRequest, now: int) -> tuple:
    """Least recently scheduled first; among equals, the latest arrival (it has waited least)."""
    return (req.last_scheduled_step, -req.arrival_step, -req.request_id)


def priority_key(req: EngineRequest, now: int) -> tuple:
    """Lowest priority first, then the latest arrival."""
    return (req.priority, -req.arrival_step, -req.request_id)


@dataclass(frozen=True)
class ScorePolicy:
    """A weighted score: high priority, much progress, long waits and small footprints are kept.

    score = w_priority * priority + w_progress * generated/max_new_tokens
            + w_age * (now - arrival_step) / (now + 1) - w_memory * blocks held / blocks in pool
    """

    num_blocks: int
    w_priority: float = 1.0
    w_progress: float = 0.5
    w_age: float = 0.25
    w_memory: float = 0.25

    def __call__(self, req: EngineRequest, now: int) -> tuple:
        progress = len(req.output_ids) / max(req.max_new_tokens, 1)
        age = (now - req.arrival_step) / (now + 1)
        memory = len(req.blocks) / self.num_blocks
        score = (self.w_priority * req.priority + self.w_progress * progress
                 + self.w_age * age - self.w_memory * memory)
        return (score, -req.request_id)


def make_policy(name: str, num_blocks: int):
    """'lru', 'priority' or 'score' -> a key function (req, now) -> sortable key."""
    if name == "lru":
        return lru_key
    if name == "priority":
        return priority_key
    if name == "score":
        return ScorePolicy(num_blocks)
    raise ValueError(f"unknown policy {name!r}; choose lru, priority or score")


POLICIES = ("lru", "priority", "score")
