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

from helpers import load_script

pytestmark = [pytest.mark.course]

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ("l1", "l2", "l3", "l5", "l8", "l10")


def grade(cwd: Path, results: Path, *args: str, timeout: int = 900) -> list[dict]:
    """Run the graded tests in `cwd` as the autograder does; return results.json's tests.

    `--hypothesis-profile=grading` reports a failing property test without shrinking it, which
    on stubs could take minutes."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
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


def check_finishing_l1(tool, tmp_path, *args):
    assert tool.main([str(tmp_path / "copy"), "--keep", "L1"]) == 0
    tests = grade(tmp_path / "copy", tmp_path / "results.json", *args)
    not_earned = missed(tests, ("l1",))
    assert not not_earned, "L1 tests fail in a copy where L1 is finished:\n" + "\n".join(not_earned)
    offenders = scored(tests, set(LESSONS) - {"l1"})
    assert not offenders, ("tests of later lessons earn points when only L1 is done:\n"
                           + "\n".join(offenders))
    scores = by_lesson(tests)
    assert scores["l1"][0] == scores["l1"][1] > 0, scores
    assert set(scores) >= set(LESSONS), scores


def test_finishing_l1_earns_all_of_l1_and_nothing_else(tool, tmp_path):
    check_finishing_l1(tool, tmp_path, *FAST)


@pytest.mark.slow
def test_finishing_l1_earns_all_of_l1_and_nothing_else_notebooks_too(tool, tmp_path):
    check_finishing_l1(tool, tmp_path)


@pytest.mark.slow
def test_the_solution_scores_every_point(tmp_path):
    tests = grade(ROOT, tmp_path / "results.json", timeout=3600)
    not_earned = missed(tests, LESSONS)
    assert not not_earned, "graded tests fail on the solution:\n" + "\n".join(not_earned)
