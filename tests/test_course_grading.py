"""The grade measures the student's work and nothing else (instructor-only: not in the student copy).

Graded with the README's command, a fresh student copy scores 0 in every lesson; the same copy
with only L1's solution regions put back scores all of L1's points and 0 elsewhere; the
repository itself (every solution) scores every point. A test of provided code that carries
points, or a graded test that passes on stubs, breaks the first two; the failure names it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from harness.grading import LESSON_PACKAGES
from helpers import load_script

pytestmark = [pytest.mark.course, pytest.mark.timeout(1800)]  # each test grades a copy in a subprocess

ROOT = Path(__file__).resolve().parent.parent
LESSONS = tuple(LESSON_PACKAGES)


def grade(cwd: Path, results: Path, *args: str, timeout: int = 900, quick: bool = False) -> list[dict]:
    """Run the graded tests in `cwd` as the autograder does; return results.json's tests.

    `--hypothesis-profile=grading` reports a failing property test without shrinking it, which
    on stubs could take minutes."""
    env = {**os.environ, "PYTHONPATH": str(cwd), **({"COURSE_QUICK": "1"} if quick else {})}
    cmd = [sys.executable, "-m", "pytest", "--graded-only", "-q", "-p", "no:cacheprovider", "--color=no",
           "--hypothesis-profile=grading", "--results-json", str(results), *args]
    run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert results.is_file(), (run.stdout + run.stderr)[-3000:]
    return json.loads(results.read_text())["tests"]


def by_lesson(tests: list[dict]) -> dict[str, list[float]]:
    scores = defaultdict(lambda: [0.0, 0.0])
    for t in tests:
        lesson = t["tags"][0]
        scores[lesson][0] += t["score"]
        scores[lesson][1] += t["max_score"]
    return dict(scores)


def scored(tests: list[dict], lessons) -> list[str]:
    return [f"{t['name']} ({t['score']:g} points)" for t in tests if t["tags"][0] in lessons and t["score"] > 0]


def missed(tests: list[dict], lessons) -> list[str]:
    return [f"{t['name']}: {t['output'].splitlines()[0] if t['output'] else t['status']}"
            for t in tests if t["tags"][0] in lessons and t["score"] < t["max_score"]]


@pytest.fixture(scope="module")
def tool():
    return load_script("make_student_copy")


# In `make test`: the notebooks are left out (they cost a minute here and grade the same fenced
# code); the copy with L1 finished shows that L2..L8's stubs earn nothing, and L1's own tests on a
# fresh copy that L1's stubs earn nothing. The slow variants grade everything.
FAST = ("-m", "not notebook")


def check_fresh_copy_scores_nothing(tool, tmp_path, *args):
    assert tool.main([str(tmp_path / "copy")]) == 0
    tests = grade(tmp_path / "copy", tmp_path / "results.json", *args)
    assert tests, "no graded test ran"
    offenders = scored(tests, LESSONS)
    assert not offenders, ("tests earn points on a fresh student copy: they do not test the fenced "
                           "code (remove their points marker) or pass on a stub:\n" + "\n".join(offenders))
    return tests


def test_a_fresh_student_copy_scores_nothing_in_l1(tool, tmp_path):
    check_fresh_copy_scores_nothing(tool, tmp_path, "-m", "l1 and not notebook")


@pytest.mark.slow
def test_a_fresh_student_copy_scores_nothing_in_any_lesson(tool, tmp_path):
    tests = check_fresh_copy_scores_nothing(tool, tmp_path)
    assert {t["tags"][0] for t in tests} >= set(LESSONS), by_lesson(tests)


def test_a_stub_that_raises_in_the_servers_thread_is_named_in_the_failure(tool, tmp_path):
    """L11's client tests fail on what the client sees (a cut stream, an error body); the stub
    that raised did so in the server's or the engine loop's thread. Its line must still end the
    test's output, so a student sees which function to write."""
    assert tool.main([str(tmp_path / "copy")]) == 0
    tests = grade(tmp_path / "copy", tmp_path / "results.json", "tests/test_l11_client.py", timeout=300)
    assert tests
    unnamed = [t["name"] for t in tests if "NotImplementedError: L11: " not in t["output"]]
    assert not unnamed, f"these fail without naming the stub: {unnamed}"


def check_finishing_l1(tool, tmp_path, *args, quick: bool = False):
    assert tool.main([str(tmp_path / "copy"), "--keep", "L1"]) == 0
    tests = grade(tmp_path / "copy", tmp_path / "results.json", *args, quick=quick)
    not_earned = missed(tests, ("l1",))
    assert not not_earned, "L1 tests fail in a copy where L1 is finished:\n" + "\n".join(not_earned)
    offenders = scored(tests, set(LESSONS) - {"l1"})
    assert not offenders, ("tests of later lessons earn points when only L1 is done:\n"
                           + "\n".join(offenders))
    scores = by_lesson(tests)
    assert scores["l1"][0] == scores["l1"][1] > 0, scores
    assert set(scores) >= set(LESSONS), scores


def test_finishing_l1_earns_all_of_l1_and_nothing_else(tool, tmp_path):
    check_finishing_l1(tool, tmp_path, *FAST, quick=True)  # reduced sizes; the slow variant grades at full size


@pytest.mark.slow
def test_finishing_l1_earns_all_of_l1_and_nothing_else_notebooks_too(tool, tmp_path):
    check_finishing_l1(tool, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_the_solution_scores_every_point(tmp_path):
    tests = grade(ROOT, tmp_path / "results.json", timeout=3600)
    not_earned = missed(tests, LESSONS)
    assert not not_earned, "graded tests fail on the solution:\n" + "\n".join(not_earned)


# A greedy_generate that gets HF's ids without using the cache: HF's own generate, or our model
# run on the whole sequence again at every step. Spliced into a copy where L1 is otherwise done.
HF_GENERATE = """\
    import dataclasses
    import transformers  # the cheat: HF computes, our cache is never used
    fields = {k: v for k, v in dataclasses.asdict(model.config).items() if k != "eos_token_ids"}
    theta = fields.pop("rope_theta")
    hf_model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **fields, rope_parameters={"rope_type": "default", "rope_theta": theta})).eval()
    hf_model.load_state_dict(model.state_dict(), strict=False)
    if model.config.tie_word_embeddings:
        hf_model.lm_head.weight = hf_model.model.embed_tokens.weight
    ids = torch.tensor([prompt_ids])
    prompt_logits = hf_model(ids).logits[0].float()
    res = hf_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                            return_dict_in_generate=True, eos_token_id=list(stop_ids) or None, pad_token_id=0)
    out.new_ids = res.sequences[0, len(prompt_ids):].tolist()
    out.logits = list(prompt_logits if keep_prompt_logits else prompt_logits[-1:]) + [s[0].float() for s in res.scores[:-1]]
"""
RECOMPUTE = """\
    seq = list(prompt_ids)  # the cheat: no cache, the whole sequence again at every step
    while len(out.new_ids) < max_new_tokens:
        logits = forward_step(model, ContiguousKvCache(model.config, len(seq), model.dtype, model.device), seq)
        if out.logits:
            out.logits.append(logits[-1].float())
        else:
            out.logits.extend(logits.float() if keep_prompt_logits else logits[-1:].float())
        token = int(out.logits[-1].argmax())
        out.new_ids.append(token)
        seq.append(token)
        if token in stop_ids:
            break
"""
STUB = """\
    raise NotImplementedError("L1: greedy_generate")
"""
L1_TESTS = ("tests/test_l1_model.py", "tests/test_l1_smoke.py", "-m", "l1 and not notebook")


def l1_with_greedy_generate(tool, folder: Path, body: str) -> Path:
    assert tool.main([str(folder), "--keep", "L1"]) == 0
    path = folder / "l1_contiguous" / "generate.py"
    text = path.read_text()
    start, end = text.index("    # BEGIN SOLUTION\n"), text.index("    # END SOLUTION\n")
    path.write_text(text[:start] + body + text[end + len("    # END SOLUTION\n"):])
    return folder


@pytest.fixture(scope="module")
def earned_with_greedy_generate_unwritten(tool, tmp_path_factory) -> set[str]:
    copy = l1_with_greedy_generate(tool, tmp_path_factory.mktemp("stub") / "copy", STUB)
    tests = grade(copy, copy.parent / "results.json", *L1_TESTS, quick=True)
    return {t["name"] for t in tests if t["score"] > 0}


@pytest.mark.parametrize("cheat", [HF_GENERATE, pytest.param(RECOMPUTE, marks=pytest.mark.slow)],
                         ids=["hf-generate", "recompute-every-step"])
def test_greedy_generate_without_the_cache_earns_nothing_more_than_leaving_it_unwritten(
        tool, tmp_path, cheat, earned_with_greedy_generate_unwritten):
    copy = l1_with_greedy_generate(tool, tmp_path / "copy", cheat)
    tests = grade(copy, tmp_path / "results.json", *L1_TESTS, quick=True)
    assert tests
    gained = [t["name"] for t in tests if t["score"] > 0 and t["name"] not in earned_with_greedy_generate_unwritten]
    assert not gained, "these tests pay for a greedy_generate that does not use the cache:\n" + "\n".join(gained)
