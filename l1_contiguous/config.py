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
    # Hybrid models (L13): which layers attend through a sliding window of the last
    # `sliding_window` positions. Empty: every layer is full attention (every published Qwen3).
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None

    @property
    def gqa_group_size(self) -> int:
        """How many query heads read one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def window_of(self, layer: int) -> int | None:
        """The layer's window W (it reads the last W positions, its own included), or None: all of them."""
        return self.sliding_window if layer in self.sliding_layers else None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, raw: dict) -> "Qwen3Config":
        if not isinstance(raw, dict):
            raise ModelLoadError(f"config.json holds a {type(raw).__name__}, not an object of settings")
        _check_architecture(raw)
        heads = _positive_int(raw, "num_attention_heads")
        kv_heads = _positive_int(raw, "num_key_value_heads", heads)
        hidden = _positive_int(raw, "hidden_size")
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if raw.get("head_dim") is None and hidden % heads:
            raise ModelLoadError(f"config.json has no head_dim and hidden_size={hidden} is not a multiple "
                                 f"of num_attention_heads={heads}; add head_dim")
        return cls(
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # Qwen3 sets head_dim explicitly (128 for Qwen3-0.6B, where hidden/heads is 64).
            head_dim=_positive_int(raw, "head_dim", hidden // heads),
            rope_theta=_rope_theta(raw),
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", 1e-6),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
            **_sliding_layers(raw, _positive_int(raw, "num_hidden_layers")),
        )


def load_config(model_dir: str | Path) -> Qwen3Config:
    """Read `config.json` (and `generation_config.json` for stop ids) from a model folder."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist; pass --model with an HF-format folder")
    path = model_dir / "config.json"
    if not path.exists() and not path.is_symlink():
        raise ModelLoadError(f"{model_dir} has no config.json; an HF-format model folder needs one")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} holds a {type(raw).__name__}, not an object of settings")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists() or gen_path.is_symlink():
        gen = read_json(gen_path)
        if not isinstance(gen, dict):
            raise ModelLoadError(f"{gen_path} holds a {type(gen).__name__}, not an object of settings")
        gen_eos = gen.get("eos_token_id")
        if gen_eos is not None:
            raw = {**raw, "eos_token_id": gen_eos}  # generate() stops on the generation config's ids
    return Qwen3Config.from_dict(raw)


def read_json(path: Path):
    """The parsed file, or a ModelLoadError that says why it cannot be read (one line)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is a broken link or vanished; restore the file") from None
    except IsADirectoryError:
        raise ModelLoadError(f"{path} is a folder, not a file; put the JSON file there") from None
    except PermissionError:
        raise ModelLoadError(f"{path} cannot be read (permission denied); fix its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); fix or re-download it") from None


def _check_architecture(raw: dict) -> None:
    if not isinstance(raw.get("rope_parameters") or {}, dict):
        raise ModelLoadError("config.json: rope_parameters must be an object")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
        raise ModelLoadError(
            f"config.json describes model_type={model_type!r} {archs}; this course implements Qwen3 only")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in raw]
    if missing:
        raise ModelLoadError(f"config.json lacks {', '.join(missing)}")


LAYER_TYPES = ("full_attention", "sliding_attention")
# A window of 1 (each position reads only itself) has no reference to compare with: transformers'
# sliding cache keeps the last `sliding_window - 1` keys as `[-sliding_window + 1:]`, which for 1
# is `[0:]`, every key, so HF's model attends to all positions. Refused rather than failed.
MIN_WINDOW = 2
WINDOW_1_WHY = ("transformers' cache keeps every key for a window of 1 (it slices [-sliding_window + 1:], which "
                "is [0:] for 1), so HF's reference would not slide at all")


def _sliding_layers(raw: dict, num_layers: int) -> dict:
    """sliding_layers and sliding_window, read as transformers' Qwen3 reads them: the window exists
    only with use_sliding_window; then `layer_types` names each layer's kind, or, when absent,
    layers from max_window_layers on slide. A "sliding_attention" layer without a window attends
    to everything (HF's attention gets no window either)."""
    types = raw.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != num_layers
                              or any(t not in LAYER_TYPES for t in types)):
        raise ModelLoadError(f"config.json: layer_types must list one of {', '.join(LAYER_TYPES)} for each of "
                             f"the {num_layers} layers, got {types!r}")
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return {}
    window = _positive_int(raw, "sliding_window")
    if types is None:
        first = raw.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ModelLoadError(f"config.json: max_window_layers must be an integer >= 0, got {first!r}")
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and window < MIN_WINDOW:
        raise ModelLoadError(f"config.json: sliding_window {window} is refused, use {MIN_WINDOW} or more: "
                             f"{WINDOW_1_WHY}")
    return {"sliding_layers": sliding, "sliding_window": window if sliding else None}


def _rope_theta(raw: dict) -> float:
    # Published Qwen3 checkpoints write `rope_theta` at the top level; transformers 5.x writes
    # `rope_parameters: {"rope_type": "default", "rope_theta": ...}` instead.
    params = raw.get("rope_parameters") or {}
    if "rope_theta" in params:
        if params.get("rope_type", "default") != "default":
            raise ModelLoadError(f"rope_type {params['rope_type']!r} is not supported; only default RoPE")
        return _positive_float(params, "rope_theta", 10000.0)
    if raw.get("rope_scaling"):
        raise ModelLoadError("rope_scaling is not supported; only default RoPE")
    return _positive_float(raw, "rope_theta", 10000.0)


def _positive_int(raw: dict, key: str, default: int | None = None) -> int:
    value = raw.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _positive_float(raw: dict, key: str, default: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelLoadError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    values = [value] if not isinstance(value, list) else value
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(values)
