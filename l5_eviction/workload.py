"""What a workload is made of: its items, the door's checks on them, and the record of a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from l1_contiguous import InputError
from l1_contiguous.errors import short_repr


@dataclass
class WorkItem:
    """One request of a workload."""

    prompt_ids: list[int]
    max_new_tokens: int = 20
    arrival_step: int = 0
    priority: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class StepRecord:
    step: int
    blocks_used: int
    blocks_free: int
    running: int
    waiting: int
    swapped: int
    prefill_tokens: int
    decode_tokens: int
    preempted: list[int] = field(default_factory=list)  # request ids preempted during this step


# Priorities are added to fractions in ScorePolicy's float score: beyond 1e9 those fractions stop
# counting (a float64 keeps about 16 digits).
MAX_PRIORITY = 10**9
MAX_ARRIVAL_STEP = 10**9  # a step number; past this a workload could not finish in any test or run

# Steps in a row that compute no token while requests wait to run: the engine is stuck (a leaked
# block, a scheduler that never admits), and `run` says so instead of spinning to max_steps.
STALL_STEPS = 100


class EngineStalledError(RuntimeError):
    """`run` saw STALL_STEPS steps in a row compute nothing while requests were unfinished."""


def check_work_item(item: WorkItem, cfg, who: str) -> None:
    """Every id, type and length of `item` against the model's config `cfg`; InputError naming
    `who` otherwise. (An empty prompt or max_new_tokens < 1 is the scheduler's `check`.)"""
    if not isinstance(item, WorkItem):
        raise InputError(f"{who}: add_request takes a WorkItem, got {type(item).__name__} {short_repr(item)}")
    ids, stop_ids = item.prompt_ids, item.stop_token_ids
    if not isinstance(ids, (list, tuple)) or not all(is_int(i) for i in ids):
        raise InputError(f"{who}: prompt_ids must be a list of ints, got {short_repr(ids)}")
    if not isinstance(stop_ids, (list, tuple, set, frozenset)) or not all(is_int(i) for i in stop_ids):
        raise InputError(f"{who}: stop_token_ids must be a list of ints, got {short_repr(stop_ids)}")
    bad = next((i for i in [*ids, *stop_ids] if not 0 <= i < cfg.vocab_size), None)
    if bad is not None:
        raise InputError(f"{who}: token id {bad!r} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    if not is_int(item.max_new_tokens):
        raise InputError(f"{who}: max_new_tokens must be an int, got {item.max_new_tokens!r}")
    if len(ids) + item.max_new_tokens > cfg.max_position_embeddings:
        raise InputError(f"{who}: {len(ids)} prompt + {item.max_new_tokens} new tokens exceed the model's "
                         f"{cfg.max_position_embeddings} positions; shorten it")
    if isinstance(item.priority, bool) or not isinstance(item.priority, (int, float)) \
            or not -MAX_PRIORITY <= item.priority <= MAX_PRIORITY:  # NaN fails this too
        raise InputError(f"{who}: priority must be a number from -10**9 to 10**9 (a policy weighs it "
                         f"in a float score), got {short_repr(item.priority)}")
    if not is_int(item.arrival_step) or not 0 <= item.arrival_step <= MAX_ARRIVAL_STEP:
        raise InputError(f"{who}: arrival_step must be an int from 0 to 10**9 (a step number), "
                         f"got {short_repr(item.arrival_step)}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def available_host_memory() -> int | None:
    """Bytes of memory the machine can still give (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def generated_ids(requests: dict) -> dict[int, list[int]]:
    return {i: r.output_ids for i, r in requests.items()}
