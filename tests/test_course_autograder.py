"""The Gradescope bundle (`make autograder`), run in a temporary folder laid out like Gradescope's
(/autograder/source, /autograder/submission, /autograder/results): it holds no solution, a fresh
student copy's packages score 0 and the solution's packages score full marks, and results.json
has Gradescope's fields."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import load_script

pytestmark = [pytest.mark.course]

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("l1_contiguous", "l2_paged", "l3_block_kernel", "l5_eviction", "l8_prefix", "l11_serve")
# In `make test` the bundle grades one fast file (L2's allocator, reserve, meta and mask: a few
# seconds); the slow variant grades everything.
FAST = "tests/test_l2_allocator.py"
HIDDEN = "tests/test_l2_allocator.py::test_random_alloc_free_sequences_keep_every_invariant"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """autograder.zip unpacked in <tmp>/autograder/source, with one test listed as hidden."""
    tmp = tmp_path_factory.mktemp("bundle")
    (tmp / "hidden.txt").write_text(f"# hidden until published\n{HIDDEN}\n")
    assert load_script("make_autograder").main([str(tmp / "autograder.zip"), "--hidden-tests",
                                                str(tmp / "hidden.txt")]) == 0
    with zipfile.ZipFile(tmp / "autograder.zip") as zf:
        names = zf.namelist()
        modes = {i.filename: i.external_attr >> 16 for i in zf.infolist()}
        zf.extractall(tmp / "autograder" / "source")
    for name in ("setup.sh", "run_autograder"):
        assert modes[name] & 0o111, f"{name} is not executable in the zip"
        (tmp / "autograder" / "source" / name).chmod(0o755)
    return tmp / "autograder", names


def run_bundle(root: Path, packages_from: Path, tmp_path: Path, selection: str | None) -> dict:
    submission = tmp_path / "submission"  # a student's upload: the packages, one folder down
    for package in PACKAGES:
        shutil.copytree(packages_from / package, submission / "my-work" / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    results = tmp_path / "results" / "results.json"
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "AUTOGRADER_SUBMISSION": str(submission),
           "AUTOGRADER_RESULTS": str(results), "AUTOGRADER_PYTHON": sys.executable,
           "AUTOGRADER_PYTEST_ARGS": "--hypothesis-profile=grading " + (selection or "")}
    env.pop("PYTHONPATH", None)  # the scratch copy must be what is imported, as on Gradescope
    run = subprocess.run([str(root / "source" / "run_autograder")], env=env, capture_output=True,
                         text=True, timeout=3600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return json.loads(results.read_text())


def test_the_bundle_holds_the_student_copy_and_no_solution(bundle):
    root, names = bundle
    assert {"setup.sh", "run_autograder", "hidden_tests.txt", "pyproject.toml", "harness/grading.py"} <= set(names)
    assert not [n for n in names if n.startswith(("instructor/", "tests/test_course_", "tests/test_lessons_"))]
    for name in names:
        if name.startswith(PACKAGES) and name.endswith(".py"):
            text = (root / "source" / name).read_text(encoding="utf-8")
            assert "# BEGIN SOLUTION" not in text, f"{name} holds a solution"


def check_scores(fresh: dict, solution: dict) -> None:
    fields = {"name", "score", "max_score", "status", "output", "visibility"}
    for results in (fresh, solution):
        assert results["tests"] and all(fields <= set(t) for t in results["tests"])
        assert all(t["max_score"] > 0 for t in results["tests"])  # --graded-only
        assert not any("\x1b[" in t["output"] for t in results["tests"])
    assert fresh["score"] == 0, [t["name"] for t in fresh["tests"] if t["score"]]
    total = sum(t["max_score"] for t in solution["tests"])
    assert solution["score"] == total > 0, [t["name"] for t in solution["tests"] if t["score"] < t["max_score"]]
    assert all(t["status"] == "failed" and "NotImplementedError" in t["output"] for t in fresh["tests"])


def test_a_fresh_copy_scores_0_and_the_solution_full_marks(bundle, tmp_path):
    root, _ = bundle
    fresh = run_bundle(root, root / "source", tmp_path / "fresh", FAST)
    solution = run_bundle(root, ROOT, tmp_path / "solution", FAST)
    check_scores(fresh, solution)
    visibility = {t["name"]: t["visibility"] for t in solution["tests"]}
    assert visibility.pop(HIDDEN) == "after_published"
    assert set(visibility.values()) == {"visible"}


@pytest.mark.slow
def test_the_whole_grade_fresh_copy_0_solution_full(bundle, tmp_path):
    root, _ = bundle
    check_scores(run_bundle(root, root / "source", tmp_path / "fresh", None),
                 run_bundle(root, ROOT, tmp_path / "solution", None))
