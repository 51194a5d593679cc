"""Helpers the lesson tests share: running HF on the same folder, random prompts."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from harness import hf_reference as hf
import probes

# `make check-lN` sets COURSE_QUICK=1: the same graded tests, with smaller soaks and fewer random
# examples, so a lesson's red-to-green loop stays short; `make test` and the autograder run full size.
QUICK = os.environ.get("COURSE_QUICK") == "1"
# Judged (the autograder, harness/judge.py), every engine step a test checks is a round trip to the
# worker: a property test whose examples step an engine hundreds of times runs `judged` examples.
JUDGED = bool(os.environ.get("KVCOURSE_JUDGE"))


forward_lengths = probes.forward_lengths  # runs beside the lesson's code (probes.py)


def prefilled_then_one_token_per_step(lengths: list[int], prompt_len: int) -> bool:
    """What `forward_lengths` sees of one request generated with a cache."""
    return lengths[:1] == [prompt_len] and set(lengths[1:]) <= {1}


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold `positions` K/V positions: the tests' own count, not the student's
    blocks_needed (which a test of the engine must not trust, and under the judge would cost a
    request each time)."""
    return -(-positions // block_size)


def budget(full: int, quick: int, judged: int | None = None) -> int:
    """How many requests or examples a soak or property test runs: `quick` in the fast loop,
    `judged` (where given) under the autograder's judge, `full` otherwise."""
    if QUICK:
        return quick
    return judged if JUDGED and judged is not None else full


def hf_ids(model_dir, prompt_ids, max_new_tokens):
    return hf.hf_greedy(hf.load_hf_model(str(model_dir)), prompt_ids, max_new_tokens)


def assert_cache_holds_hf_kv(model_dir, cache, seq: list[int]) -> None:
    """The K/V a contiguous cache holds after a run equal HF's for `seq` (the prompt and every new
    id fed back), computed here. This is state the run left: a greedy_generate that recomputed the
    whole sequence at every step leaves the cache it was given empty, whatever a probe inside the
    student's process was told (under the judge, forward_lengths records what that process says)."""
    assert cache.length == len(seq), f"the cache holds {cache.length} positions after the run, not {len(seq)}"
    for layer, (k, v) in enumerate(hf.hf_kv(hf.load_hf_model(str(model_dir)), seq)):
        for name, ours, theirs in (("K", cache.k[layer], k), ("V", cache.v[layer], v)):
            torch.testing.assert_close(ours[:len(seq)].float(), theirs, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"layer {layer} cached {name} differs from HF's: {m}")


def assert_tables_hold_hf_kv(oracle, pool_kv, tables, layers_of_table, seq: list[int], block_size: int,
                             null_block: int = -1) -> int:
    """Every position a block table says it holds, the pool holds HF's K and V there, for `seq` (the
    tokens written so far). `pool_kv[layer]` is (K, V), each [num_slots, H_kv, D], copied from the
    pool; `tables[g]` reads the layers `layers_of_table[g]`; entries equal to `null_block` hold
    nothing. A table is what attention reads through, so this is the run's state, not its report:
    a table that names blocks the K/V never went to fails, whatever the counters say. HF keeps only
    a sliding layer's last positions: positions it no longer holds are not compared. Returns the
    number of positions compared."""
    hf_layers = hf.hf_kv(oracle, seq)
    compared = 0
    for table, layers in zip(tables, layers_of_table):
        for layer in layers:
            hf_k, hf_v = hf_layers[layer]
            first_held = len(seq) - hf_k.shape[0]  # HF's sliding cache keeps the last positions only
            for entry, block in enumerate(table):
                positions = range(max(entry * block_size, first_held), min((entry + 1) * block_size, len(seq)))
                if block == null_block or not positions:
                    continue
                slots = torch.tensor([block * block_size + p % block_size for p in positions])
                rows = torch.tensor(list(positions)) - first_held
                for name, ours, theirs in (("K", pool_kv[layer][0], hf_k), ("V", pool_kv[layer][1], hf_v)):
                    torch.testing.assert_close(  # an engine's chunks and fused matmuls round differently
                        ours[slots].float(), theirs[rows], rtol=3e-3, atol=3e-3,  # a wrong block is off by O(1)
                        msg=lambda m: (f"layer {layer}, table entry {entry} (block {block}): the pool does not "
                                       f"hold HF's {name} of positions {positions.start}..{positions.stop - 1}\n{m}"))
                compared += len(positions)
    return compared


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def kjv_prompts(model_dir, spans: list[tuple[int, int]]) -> list[list[int]]:
    """Prompts of real text (assets/kjv-heldout.txt), one per (character offset, tokens): on text
    the embedded model attends far back, so a window changes its output (on random ids it barely does)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    text = (Path(__file__).resolve().parent.parent / "assets" / "kjv-heldout.txt").read_text()
    prompts = [tokenizer.encode(text[start:]).ids[:length] for start, length in spans]
    assert all(len(p) == n for p, (_, n) in zip(prompts, spans)), "the held-out text is too short for these spans"
    return prompts


def student_package(name: str) -> Path:
    """The folder of the student's lesson package `name`, from a path the judge was given by the
    grader (KVCOURSE_STUDENT_TREE), never from the package's own `__file__`, which under the judge
    is the student's code's answer and could name any file."""
    return Path(os.environ.get("KVCOURSE_STUDENT_TREE", Path(__file__).resolve().parent.parent)) / name


def load_script(name: str):
    """Import scripts/<name>.py as a module (scripts/ is not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    import signal

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    # A script guards its own start-up (harness.cli.guard_startup: Ctrl-C exits at once); imported
    # into the test process, it must not leave that behind for the tests after it.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        spec.loader.exec_module(module)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return module


def run_script_json(name: str, argv: list[str], capsys) -> tuple[int, dict | None, str]:
    """Run a smoke script in-process; returns (exit status, the JSON object or None, stderr). An
    internal error (exit 3: a bug, or a function not written yet) fails the test with the end of
    the script's traceback."""
    import json

    from harness.smoke import run_smoke

    module = load_script(name)
    status = run_smoke(module.LESSON, module.__doc__, module.run, getattr(module, "add_options", None),
                       argv=argv + ["--json"], teacher_force=getattr(module, "teacher_force", None))
    out, err = capsys.readouterr()
    if status == 3:  # an internal error, e.g. a function not written yet: show where, not `3 != 0`
        tail = "\n".join(err.strip().splitlines()[-6:])
        pytest.fail(f"scripts/{name}.py stopped on an internal error (exit 3); the end of its traceback:\n{tail}",
                    pytrace=False)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return status, (json.loads(last) if last.startswith("{") else None), err


def check_the_pool_is_the_cache(model_dir, make_runner) -> None:
    """A kv_step that kept K/V somewhere of its own would still give HF's ids. So: after a prefill
    and one decode step, the pool's slots hold HF's K and V for each position written; and noise
    written into the prompt's slots after the prefill changes the next step's logits.
    `make_runner()` returns a fresh L2-style runner (`step`, `forward_logits`, `pool`)."""
    from l2_paged import Request

    runner = make_runner()
    prompt = random_prompt(9, runner.model.config.vocab_size, seed=31)
    req = Request(list(prompt), max_new_tokens=4)
    runner.step([req], [len(prompt)])
    runner.step([req], [1])
    written = req.tokens[:req.cur_len]  # 10 positions
    cache = hf.load_hf_model(str(model_dir)).forward(torch.tensor([written]), use_cache=True).past_key_values
    slots = torch.tensor(req.slot_indices[:len(written)])
    for layer in range(runner.model.config.num_hidden_layers):
        hf_k, hf_v = (t[0].transpose(0, 1) for t in (cache.layers[layer].keys, cache.layers[layer].values))
        torch.testing.assert_close(runner.pool.K[layer][slots], hf_k, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"layer {layer}: the pool's K is not HF's K of the positions written\n{m}")
        torch.testing.assert_close(runner.pool.V[layer][slots], hf_v, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"layer {layer}: the pool's V is not HF's V of the positions written\n{m}")

    logits = []
    for poison in (False, True):
        runner = make_runner()
        req = Request(list(prompt), max_new_tokens=4)
        token = runner.forward([req], [len(prompt)])[0]
        req.output_ids.append(token)
        if poison:
            slots = torch.tensor(req.slot_indices[:len(prompt)])
            for t in runner.pool.K + runner.pool.V:
                t[slots] = torch.randn_like(t[slots]) * 10
        logits.append(runner.forward_logits([req], [1])[0])
    assert not torch.allclose(logits[0], logits[1], atol=1e-3), \
        "noise written into the pool after the prefill did not change the decode: it does not read the pool"
