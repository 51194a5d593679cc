"""Read a Qwen3 `config.json` into the few numbers the forward pass needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()

    @property
    def gqa_group_size(self) -> int:
        """How many query heads read one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, raw: dict) -> "Qwen3Config":
        _check_architecture(raw)
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # Qwen3 sets head_dim explicitly (128 for Qwen3-0.6B, where hidden/heads is 64).
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rope_theta=_rope_theta(raw),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
        )


def load_config(model_dir: str | Path) -> Qwen3Config:
    """Read `config.json` (and `generation_config.json` for stop ids) from a model folder."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist; pass --model with an HF-format folder")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json; an HF-format model folder needs one")
    raw = json.loads(path.read_text())
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            raw = {**raw, "eos_token_id": gen_eos}  # generate() stops on the generation config's ids
    return Qwen3Config.from_dict(raw)


def _check_architecture(raw: dict) -> None:
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
        raise ModelLoadError(
            f"config.json describes model_type={model_type!r} {archs}; this course implements Qwen3 only")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in raw]
    if missing:
        raise ModelLoadError(f"config.json lacks {', '.join(missing)}")


def _rope_theta(raw: dict) -> float:
    # Published Qwen3 checkpoints write `rope_theta` at the top level; transformers 5.x writes
    # `rope_parameters: {"rope_type": "default", "rope_theta": ...}` instead.
    params = raw.get("rope_parameters") or {}
    if "rope_theta" in params:
        if params.get("rope_type", "default") != "default":
            raise ModelLoadError(f"rope_type {params['rope_type']!r} is not supported; only default RoPE")
        return float(params["rope_theta"])
    if raw.get("rope_scaling"):
        raise ModelLoadError("rope_scaling is not supported; only default RoPE")
    return float(raw.get("rope_theta", 10000.0))


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
