"""Read Qwen3 weights from safetensors (one file or sharded) and check them against the config."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from .config import Qwen3Config, read_json
from .errors import ModelLoadError


class ModelFolderWarning(UserWarning):
    """The folder loads, but not every weights file in it is read (HF's choice, repeated here)."""


def expected_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor our model needs, by its HF name, with its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def load_weights(model_dir: str | Path, cfg: Qwen3Config, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Return {HF name: tensor} for every tensor in `expected_shapes`, cast to `dtype` on `device`."""
    wanted = expected_shapes(cfg)
    files = _tensor_files(Path(model_dir))
    found: dict[str, torch.Tensor] = {}
    for file in files:
        found |= _read_tensors(file, wanted)
    missing = [n for n in wanted if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"tensor {missing[0]} is missing from {model_dir}{more}")
    for name, shape in wanted.items():
        if tuple(found[name].shape) != shape:
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(found[name].shape)}, config.json implies {shape}")
    return {n: t.to(device=device, dtype=dtype) for n, t in found.items()}


def _read_tensors(file: Path, wanted: dict) -> dict[str, torch.Tensor]:
    """The wanted tensors of one safetensors file; a ModelLoadError if the file cannot be read."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys() if name in wanted}
    except PermissionError:
        raise ModelLoadError(f"{file} cannot be read (permission denied); fix its permissions") from None
    except Exception as exc:  # safetensors raises its own error types for a corrupt or cut file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{file} is not a readable safetensors file ({reason}); re-download it") from None


def _tensor_files(model_dir: Path) -> list[Path]:
    """The files HF reads, the way it picks them: model.safetensors if present, else the shards the
    index names. Never both merged, and never another *.safetensors lying in the folder."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    has_index = index.exists() or index.is_symlink()
    if single.exists() or single.is_symlink():
        if has_index:
            warnings.warn(f"{model_dir} has both model.safetensors and {index.name}; loading model.safetensors, "
                          f"as transformers does (remove one to silence this)", ModelFolderWarning, stacklevel=3)
        return [single]
    if not has_index:
        others = sorted(p.name for p in model_dir.glob("*.safetensors"))
        found = f" (it has {', '.join(others[:3])}, names transformers does not load)" if others else ""
        raise ModelLoadError(f"{model_dir} has no model.safetensors nor {index.name}{found}")
    raw = read_json(index)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(f"{index} has no weight_map of tensor name -> shard file; fix or re-download it")
    shard_names = sorted(set(weight_map.values()))
    # A shard is named relative to the folder: "../x" or "/etc/x" would read files outside it. (A
    # shard that is itself a symlink, as in HF's hub cache, is fine: only the name is checked.)
    outside = [s for s in shard_names if Path(s).is_absolute() or ".." in Path(s).parts]
    if outside:
        raise ModelLoadError(f"shard {outside[0]!r} listed in {index.name} lies outside {model_dir}; an index "
                             f"may name only files in the model folder")
    missing = [s for s in shard_names if not (model_dir / s).is_file()]
    if missing:
        raise ModelLoadError(f"shard {missing[0]} listed in {index.name} is not in {model_dir}")
    return [model_dir / s for s in shard_names]
