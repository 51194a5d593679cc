"""L5: a scheduler with continuous batching that preempts (recompute or swap) when the pool is full."""

from .build import make_engine
from .engine import Engine
from .kv_manager import KvManager
from .lifecycle import EngineRequest, State, SwappedKv
from .mixed import (MixedBatchAttention, StepRunner, build_step_meta, check_engine_model,
                    engine_backend, load_engine_model)
from .policies import POLICIES, ScorePolicy, lru_key, make_policy, priority_key
from .preempt import MODES, PreemptCounters, Preemptor, trim
from .scheduler import DEFAULT_PREFILL_CHUNK, RequestTooLargeError, Scheduler
from .workload import EngineStalledError, StepRecord, WorkItem, generated_ids

__all__ = [
    "EngineStalledError",
    "DEFAULT_PREFILL_CHUNK", "Engine", "StepRecord", "WorkItem", "generated_ids", "make_engine",
    "EngineRequest", "State", "SwappedKv", "MixedBatchAttention", "StepRunner", "build_step_meta",
    "check_engine_model", "engine_backend", "load_engine_model", "POLICIES", "ScorePolicy", "lru_key",
    "make_policy", "priority_key", "MODES", "PreemptCounters", "Preemptor", "trim",
    "RequestTooLargeError", "Scheduler", "KvManager",
]
