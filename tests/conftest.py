"""Shared fixtures: random tiny models made on the fly (cached per session), the embedded model,
and the allocator class the L2 allocator tests run against (`--allocator-class`)."""

from __future__ import annotations

import gc
import importlib
import json
import os
import re

import pytest
import torch
from hypothesis import Phase, settings

from harness.smoke import DEFAULT_MODEL
from harness.tiny_models import EMBEDDED_HYBRID_LAYER_TYPES, EMBEDDED_HYBRID_WINDOW, as_hybrid, make_random_model


# Property tests draw the same examples on every run (derandomized, no example database), so a
# submission scores the same each time it is graded. `pytest --hypothesis-profile=grading` (the
# autograder's) also reports a failing property test's first failing example instead of shrinking
# it (which can take minutes when the student's code is a stub).
settings.register_profile("default-derandomized", derandomize=True, database=None)
settings.register_profile("grading", derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate])
settings.load_profile("default-derandomized")


def share_the_cores_between_workers() -> None:
    """Under pytest-xdist (`make test`: JOBS processes), each worker gets its share of the cores
    for torch's threads, and so do the processes it starts: two workers of two threads each on
    two cores made OpenMP's waiting threads spin against each other (the bf16 and kernel files ran
    7x and 3x slower than in one process)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(threads)


share_the_cores_between_workers()


def pytest_collection_finish(session):
    """Start the compiles the selected tests will wait for (tests/prebuild.py)."""
    if not session.config.option.collectonly and session.items:
        import prebuild

        prebuild.start([item.nodeid for item in session.items])


def pytest_addoption(parser):
    parser.addoption("--allocator-class", default="l2_paged.allocator:BlockAllocator", metavar="MODULE:CLASS",
                     help="the allocator the L2 allocator tests run against (L2 exercise 3)")


@pytest.fixture(scope="session")
def allocator_cls(request):
    """The class under test in tests/test_l2_allocator.py: BlockAllocator unless --allocator-class."""
    module, _, name = request.config.getoption("--allocator-class").partition(":")
    return getattr(importlib.import_module(module), name)


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


@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory):
    """The embedded model as a hybrid (L13): layers 0 and 2 read a window of 64 positions, 1 and 3 all."""
    return as_hybrid(DEFAULT_MODEL, tmp_path_factory.mktemp("hybrid"), EMBEDDED_HYBRID_WINDOW,
                     EMBEDDED_HYBRID_LAYER_TYPES)


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


_STUB = re.compile(r"NotImplementedError: L\d+: .*")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A stub that raised in a thread the test does not join (L11's server and engine loop) only
    shows in the captured log; the test itself fails on what the client saw (a 500, a cut stream).
    Such a failure's report ends with the stub's line, so it names the function to write."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and not _STUB.search(report.longreprtext):  # a repr, NotImplementedError('L11: ...'), is not enough
        stub = _STUB.search(report.caplog + report.capstderr) or _STUB.search(_dead_thread_error(item))
        if stub:
            report.longrepr = f"{report.longreprtext}\n\nRaised in the server's thread: {stub.group(0)}"


def _dead_thread_error(item) -> str:
    """The error that stopped a fixture's engine loop in an earlier test (its `error`), or ""."""
    for value in getattr(item, "funcargs", {}).values():
        for obj in value if isinstance(value, tuple) else (value,):
            error = getattr(obj, "error", None)
            if isinstance(error, NotImplementedError):
                return f"NotImplementedError: {error}"
    return ""


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Python's shutdown garbage-collects every object still alive: once torch and transformers
    are loaded, several hundred thousand of them, 1 to 2 s of every run. They are about to go
    anyway; frozen, they are skipped (atexit handlers and weakref finalizers still run)."""
    gc.freeze()
