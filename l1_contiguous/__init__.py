"""L1: a hand-written Qwen3 with one contiguous KV cache per layer."""

from .cache import CacheFullError, ContiguousKvCache
from .config import Qwen3Config, load_config
from .errors import InputError, ModelLoadError
from .generate import Generation, StepMeta, causal_mask, forward_step, greedy_generate
from .model import Qwen3Attention, Qwen3ForCausalLM, RMSNorm, RotaryEmbedding, apply_rotary, attend, window_mask
from .weights import load_weights

__all__ = [
    "CacheFullError", "ContiguousKvCache", "InputError", "ModelLoadError", "Qwen3Config", "load_config",
    "Generation", "StepMeta", "causal_mask", "forward_step", "greedy_generate",
    "Qwen3Attention", "Qwen3ForCausalLM", "RMSNorm", "RotaryEmbedding", "apply_rotary", "attend", "window_mask",
    "load_weights",
]
