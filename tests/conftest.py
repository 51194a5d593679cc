"""Shared fixtures: random tiny models made on the fly (cached per session) and the embedded model."""

from __future__ import annotations

import json

import pytest
import torch

from harness.smoke import DEFAULT_MODEL
from harness.tiny_models import make_random_model


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    """make_model(seed=0, **config_overrides) -> folder of a random HF-format Qwen3 (cached)."""
    cache: dict[str, object] = {}

    def make(seed: int = 0, shard_size: str | None = None, **overrides):
        key = json.dumps([seed, shard_size, sorted(overrides.items())])
        if key not in cache:
            out = tmp_path_factory.mktemp("model")
            cache[key] = make_random_model(out, seed=seed, shard_size=shard_size, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_model):
    """The default random tiny model: 2 layers, GQA 4 query heads on 2 KV heads, head_dim 16."""
    return make_model()


@pytest.fixture(scope="session")
def embedded_model_dir():
    return DEFAULT_MODEL


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that run tiny models many times: a second intra-op thread gains nothing there,
    and on a busy machine every parallel region waits for the other thread's time slice (a
    200-request soak went from about 5 s to 92 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
