"""The student copy: solution fences become NotImplementedError stubs, and the same tests grade it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest

pytestmark = [pytest.mark.course]

ROOT = Path(__file__).resolve().parent.parent
# Fast L1 tests that need no model: each calls a fenced function (RMSNorm.forward, apply_rotary, attend).
FAST_L1 = "rmsnorm or rotary or attend_gqa"

SYNTHETIC = '''\
class Cache:
    def write(self, k, v):
        """Store k and v."""
        # BEGIN SOLUTION
        self.k = k
        self.v = v
        # END SOLUTION


def step(x):
    y = x + 1
    # BEGIN SOLUTION
    y = y * 2
    # END SOLUTION
    return y
'''


@pytest.fixture(scope="module")
def tool():
    # Registered in sys.modules before it runs: its dataclasses look their module up there.
    name = "make_student_copy"
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def student_copy(tool, tmp_path_factory):
    out = tmp_path_factory.mktemp("student") / "copy"
    status = tool.main([str(out)])
    assert status == 0
    return out


# ---------------------------------------------------------------- the fence replacement itself

def test_fence_becomes_one_raise_naming_lesson_and_method(tool):
    text, regions = tool.strip_solutions(SYNTHETIC, "L2", "lessons/L2-paged.md", "pool.py")
    assert regions == 2
    assert "SOLUTION" not in text and "self.k = k" not in text and "y * 2" not in text
    lines = text.splitlines()
    # the BEGIN line's indentation is kept, and the method is named Class.method
    assert '        raise NotImplementedError("L2: Cache.write — see lessons/L2-paged.md")' in lines
    assert '    raise NotImplementedError("L2: step — see lessons/L2-paged.md")' in lines
    assert "    return y" in lines and '        """Store k and v."""' in lines  # the rest is untouched
    namespace: dict = {}
    exec(compile(text, "pool.py", "exec"), namespace)  # a body left with a docstring + raise is valid
    with pytest.raises(NotImplementedError, match=r"^L2: Cache.write"):
        namespace["Cache"]().write(1, 2)
    with pytest.raises(NotImplementedError, match=r"^L2: step"):
        namespace["step"](1)


@pytest.mark.parametrize("source,line,words", [
    ("def f():\n    # BEGIN SOLUTION\n    # BEGIN SOLUTION\n    pass\n    # END SOLUTION\n", 3, "inside"),
    ("def f():\n    # BEGIN SOLUTION\n    pass\n", 2, "never closed"),
    ("def f():\n    pass\n    # END SOLUTION\n", 3, "without"),
], ids=["nested", "unclosed", "unopened"])
def test_unbalanced_or_nested_fences_are_errors_naming_file_and_line(tool, source, line, words):
    with pytest.raises(tool.FenceError, match=rf"^l9_x/mod\.py:{line}: .*{words}"):
        tool.strip_solutions(source, "L9", "lessons/L9-x.md", "l9_x/mod.py")


# ---------------------------------------------------------------- the copy of this repository

def test_copy_has_no_fenced_region_left_and_compiles(tool, student_copy):
    stubs = 0
    assert len(tool.LESSON_PACKAGES) >= 8 and "l12_quantized_kv" in tool.LESSON_PACKAGES
    for package in tool.LESSON_PACKAGES:
        for path in sorted((student_copy / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            assert "# BEGIN SOLUTION" not in text and "# END SOLUTION" not in text, path
            stubs += text.count("raise NotImplementedError(")
    assert stubs > 0
    l1_model = (student_copy / "l1_contiguous" / "model.py").read_text(encoding="utf-8")
    assert 'raise NotImplementedError("L1: Qwen3Attention.kv_step — see lessons/L1-' in l1_model
    for path in student_copy.rglob("*.py"):  # every Python file still parses
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
    assert (student_copy / "pyproject.toml").is_file() and not (student_copy / ".git").exists()
    assert not (student_copy / "instructor").exists()


def _pytest(cwd: Path) -> subprocess.CompletedProcess:
    tests = sorted(p.relative_to(cwd).as_posix() for p in (cwd / "tests").glob("test_l1_*.py"))
    assert tests, "no tests/test_l1_*.py to run"
    env = {**os.environ, "PYTHONPATH": str(cwd), "COLUMNS": "400"}  # wide: summary lines uncut
    cmd = [sys.executable, "-m", "pytest", "-m", "l1", "-q", "-rf", "-p", "no:cacheprovider",
           *tests, "-k", FAST_L1]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_l1_tests_fail_in_the_copy_with_not_implemented(student_copy):
    run = _pytest(student_copy)
    out = run.stdout + run.stderr
    failed = [line for line in out.splitlines() if line.startswith("FAILED ")]
    assert run.returncode == 1, out[-3000:]
    assert failed and not re.search(r"\d+ passed", out), out[-3000:]
    assert all("NotImplementedError: L1:" in line for line in failed), "\n".join(failed)


def test_the_original_passes_the_same_selection():
    run = _pytest(ROOT)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]


# ---------------------------------------------------------------- what the student is told

def test_every_fenced_function_is_in_its_lessons_what_you_write_table(tool, student_copy):
    """The stub names the section that explains it, read from the lesson's "What you write" table;
    a fenced function missing from that table would get a stub without a section."""
    stubs = re.compile(r'raise NotImplementedError\("(L\d+): ([\w.]+) — see (lessons/\S+\.md)( §[\d.]+)?"\)')
    found = []
    for package in tool.LESSON_PACKAGES:
        for path in sorted((student_copy / package).rglob("*.py")):
            found += stubs.findall(path.read_text(encoding="utf-8"))
    assert len(found) >= 20
    unlisted = [f"{lesson}: {name} ({text})" for lesson, name, text, section in found if not section]
    assert not unlisted, "add these to the lesson's 'What you write' table:\n" + "\n".join(unlisted)
    for lesson, name, text, section in found:
        assert f"`{name}`" in (ROOT / text).read_text(encoding="utf-8").split("## 1.")[0], (lesson, name)


def test_instructor_files_are_left_out_and_keep_leaves_a_lesson_solved(tool, tmp_path):
    assert (ROOT / "instructor" / "answers.md").is_file()
    assert tool.main([str(tmp_path / "copy"), "--keep", "L1,l2"]) == 0
    copy = tmp_path / "copy"
    assert not (copy / "instructor").exists() and not list((copy / "tests").glob("test_course_*"))
    assert not list((copy / "tests").glob("test_lessons_*"))  # course-marked modules stay behind
    assert "# BEGIN SOLUTION" in (copy / "l1_contiguous" / "model.py").read_text(encoding="utf-8")
    assert "# BEGIN SOLUTION" in (copy / "l2_paged" / "request.py").read_text(encoding="utf-8")
    assert "# BEGIN SOLUTION" not in (copy / "l3_block_kernel" / "block_table.py").read_text(encoding="utf-8")
    assert tool.main([str(tmp_path / "other"), "--keep", "L6"]) == 2
    readme = (copy / "README.md").read_text(encoding="utf-8")
    assert "## For instructors" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "## For instructors" not in readme and "make autograder" not in readme and "instructor/" not in readme
    assert "## Getting started" in readme and "What to submit" in readme and "own `.venv`" in readme
