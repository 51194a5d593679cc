"""Random Qwen3 models in HF format, made on the fly for tests and for the real-checkpoint check.

With transformers' default init (std 0.02) a random Qwen3 is nearly uniform over its vocabulary
and greedy decoding repeats one id, which would let a broken cache pass any comparison. Scaling
the init up makes every position's logits depend strongly on the context, so a wrong K/V shows.
"""

from __future__ import annotations

from pathlib import Path

import torch

QWEN3_0_6B = dict(  # the published Qwen3-0.6B config.json, minus fields our model ignores
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    bos_token_id=151643, eos_token_id=151645,
)

TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=None, eos_token_id=None,
)


def hf_config(**overrides):
    """A transformers Qwen3Config from TINY with `overrides`."""
    from transformers import Qwen3Config

    fields = {**TINY, **overrides}
    theta = fields.pop("rope_theta")
    return Qwen3Config(**fields, rope_parameters={"rope_type": "default", "rope_theta": theta})


def make_random_model(out_dir: str | Path, seed: int = 0, init_std: float = 0.25,
                      shard_size: str | None = None, hf_init: bool = True, dtype: str = "float32",
                      **overrides) -> Path:
    """Save a random Qwen3 (HF format) to `out_dir` and return the path.

    dtype is how the weights are stored ("bfloat16" as in the published Qwen3 checkpoints); a
    loader that asks for float32 upcasts them exactly.

    hf_init=False skips transformers' init and draws every weight once: at Qwen3-0.6B's vocabulary
    that is 3x faster (HF draws the 151936 x 1024 embedding once and the head tied to it twice more).
    The same seed then gives other weights, so tests that picked prompts for this seed's logit gaps
    keep the default.
    """
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(initializer_range=init_std, **overrides)
    if hf_init:
        model = Qwen3ForCausalLM(cfg).eval()
        _randomize_norms(model, seed)
    else:
        model = _drawn_once(Qwen3ForCausalLM, cfg, seed, init_std)
    model.to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    for file in Path(out_dir).iterdir():  # safetensors writes 0600; a judged worker (another user) reads it
        file.chmod(0o644)
    return out_dir


def _randomize_norms(model, seed: int) -> None:
    # RMSNorm weights start at 1.0; random ones make a test notice a norm applied to the wrong
    # tensor (e.g. q_norm's weight used for k) that all-ones weights would hide.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=gen))


def _drawn_once(model_cls, cfg, seed: int, init_std: float):
    """model_cls(cfg) built on the meta device, then each weight drawn once: N(0, init_std), and
    norms uniform in [1, 1.5) as _randomize_norms makes them. For saving only: the rotary
    buffers (not saved) are left uninitialised."""
    with torch.device("meta"):
        model = model_cls(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the head its own tensor; a tied head must share it again
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(1.0, 1.5, generator=gen)
            else:
                p.normal_(0.0, init_std, generator=gen)
    return model.eval()


# How L13 runs the embedded model (4 layers) as a hybrid: every other layer reads the last 64 positions.
EMBEDDED_HYBRID_WINDOW = 64
EMBEDDED_HYBRID_LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


def as_hybrid(model_dir: str | Path, out_dir: str | Path, window: int, layer_types: list[str]) -> Path:
    """A folder that runs the model in `model_dir` as a hybrid: `layer_types` names each layer's kind
    ("sliding_attention" or "full_attention"), sliding layers read the last `window` positions. Its
    config is a new file; every other file links to the original (the weights are the same: what
    changes is which keys each layer reads)."""
    import json

    model_dir, out_dir = Path(model_dir).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.is_file() and file.name != "config.json":
            (out_dir / file.name).symlink_to(file)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=window, layer_types=list(layer_types))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "config.json").chmod(0o644)
    return out_dir
