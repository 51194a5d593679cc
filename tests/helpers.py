"""Helpers the lesson tests share: running HF on the same folder, random prompts."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

from harness import hf_reference as hf

# `make check-lN` sets COURSE_QUICK=1: the same graded tests, with smaller soaks and fewer random
# examples, so a lesson's red-to-green loop stays short; `make test` and the autograder run full size.
QUICK = os.environ.get("COURSE_QUICK") == "1"


@contextlib.contextmanager
def forward_lengths(model_cls):
    """Yields a list that every forward of a `model_cls` module run inside the block appends its
    number of input tokens to: how a test sees that decode feeds one new token per step (the
    cache holds the rest) instead of the whole sequence again, or HF's model instead of ours."""
    lengths: list[int] = []

    def record(module, args):
        if isinstance(module, model_cls) and args:
            lengths.append(args[0].numel())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield lengths
    finally:
        handle.remove()


def prefilled_then_one_token_per_step(lengths: list[int], prompt_len: int) -> bool:
    """What `forward_lengths` sees of one request generated with a cache."""
    return lengths[:1] == [prompt_len] and set(lengths[1:]) <= {1}


def budget(full: int, quick: int) -> int:
    """How many requests or examples a soak or property test runs: `quick` in the fast loop."""
    return quick if QUICK else full


def hf_ids(model_dir, prompt_ids, max_new_tokens):
    return hf.hf_greedy(hf.load_hf_model(str(model_dir)), prompt_ids, max_new_tokens)


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def load_script(name: str):
    """Import scripts/<name>.py as a module (scripts/ is not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def run_script_json(name: str, argv: list[str], capsys) -> tuple[int, dict | None, str]:
    """Run a smoke script in-process; returns (exit status, the JSON object or None, stderr). An
    internal error (exit 3: a bug, or a function not written yet) fails the test with the end of
    the script's traceback."""
    import json

    from harness.smoke import run_smoke

    module = load_script(name)
    status = run_smoke(module.LESSON, module.__doc__, module.run, getattr(module, "add_options", None),
                       argv=argv + ["--json"])
    out, err = capsys.readouterr()
    if status == 3:  # an internal error, e.g. a function not written yet: show where, not `3 != 0`
        tail = "\n".join(err.strip().splitlines()[-6:])
        pytest.fail(f"scripts/{name}.py stopped on an internal error (exit 3); the end of its traceback:\n{tail}",
                    pytrace=False)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return status, (json.loads(last) if last.startswith("{") else None), err
