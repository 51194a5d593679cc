#!/usr/bin/env python3
"""Build the Gradescope autograder bundle: a zip of the student copy (no solutions), plus
`setup.sh`, `run_autograder`, the grading runner `grade.py`, the hidden tests and the manifest of
the points each graded test carries.

    python scripts/make_autograder.py autograder.zip [--lessons l2,l3] [--hidden-tests FILE]

Upload the zip as the assignment's autograder ("Zip file upload"). Gradescope unpacks it in
/autograder/source and runs `setup.sh` once; then, for each submission, `run_autograder` grades
the lesson packages the student uploaded (see instructor/autograder/grade.py) and writes
/autograder/results/results.json. `--lessons` makes a weekly assignment: only those lessons'
tests are graded, still with the student's packages of the earlier lessons they build on.
Test files in instructor/hidden_tests/ (--hidden-tests-dir) go into the bundle only (never the student copy), their
results shown after grades are published.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = REPO_ROOT / "instructor" / "autograder"
HIDDEN_TESTS_DIR = REPO_ROOT / "instructor" / "hidden_tests"
SCRIPTS = ("setup.sh", "run_autograder")  # executable, at the bundle's root
EXECUTABLE = 0o100755 << 16  # zip external attributes of a regular file with mode 755


def _student_copy_tool():
    name = "make_student_copy"
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # its dataclasses need it
    spec.loader.exec_module(module)
    return module


def build(zip_path: Path, hidden_tests: Path, lessons: list[str], hidden_dir: Path) -> dict:
    """Write the bundle to `zip_path`; return its manifest."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "source"
        tool = _student_copy_tool()
        tool.make_student_copy(REPO_ROOT, copy)
        if note := tool.untracked_note(REPO_ROOT):  # left out of the bundle as out of the copy
            print(note)
        hidden_files = sorted(hidden_dir.glob("test_*.py")) if hidden_dir.is_dir() else []
        for path in hidden_files:
            shutil.copy(path, copy / "tests" / path.name)
        listed = hidden_tests.read_text(encoding="utf-8")
        (copy / "hidden_tests.txt").write_text(listed + "".join(f"\ntests/{p.name}" for p in hidden_files) + "\n")
        shutil.copy(TEMPLATES / "grade.py", copy / "grade.py")
        manifest = collect_manifest(copy, lessons)
        manifest["hidden_files"] = [f"tests/{p.name}" for p in hidden_files]  # run apart, never beside visible tests
        (copy / "grading_manifest.json").write_text(json.dumps(manifest, indent=1))
        files = sorted(p for p in copy.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        partial = Path(tmp) / "bundle.zip"  # moved over zip_path only when whole
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in SCRIPTS:
                info = zipfile.ZipInfo(name)
                info.external_attr = EXECUTABLE
                zf.writestr(info, (TEMPLATES / name).read_bytes(), zipfile.ZIP_DEFLATED)
            for path in files:
                zf.write(path, path.relative_to(copy).as_posix())
        beside = zip_path.with_name(f".{zip_path.name}.partial")  # the same file system as zip_path
        try:
            shutil.copyfile(partial, beside)
            os.replace(beside, zip_path)
        finally:
            beside.unlink(missing_ok=True)
    return manifest


def collect_manifest(copy: Path, lessons: list[str]) -> dict:
    """The graded tests of `lessons` as collected in the bundle's own copy (stubs, no student
    code): {"lessons", "packages" (every lesson's, earlier lessons are imported by later ones),
    "tests": {nodeid: {points, lesson, hidden, slow, notebook}}}."""
    sys.path.insert(0, str(copy))
    from harness.grading import LESSON_PACKAGES  # the copy's own list of lessons
    sys.path.pop(0)
    path = copy / "manifest.tmp.json"
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "--graded-only", "-p", "no:cacheprovider",
           "--hidden-tests", "hidden_tests.txt", "--manifest", str(path), "-m", " or ".join(lessons)]
    run = subprocess.run(cmd, cwd=copy, env={**os.environ, "PYTHONPATH": str(copy)}, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"error: collecting the bundle's tests failed:\n{(run.stdout + run.stderr)[-3000:]}")
    tests = json.loads(path.read_text())
    path.unlink()
    slow = [nodeid for nodeid, test in tests.items() if test["slow"]]
    if slow:  # the bundle runs no soak (Gradescope's time limit): a graded one could never be earned
        raise SystemExit(f"error: tests marked slow carry points: {slow}; give their points to the bounded version")
    # The bundle grades no notebook: its cells run in a kernel that is the student's code, so whatever
    # the kernel reports is the student's to forge. Notebooks earn their points in the student's own
    # `make test`; the judged tests grade the same functions.
    tests = {nodeid: test for nodeid, test in tests.items() if not test["notebook"]}
    return {"lessons": lessons, "packages": list(LESSON_PACKAGES.values()), "tests": tests}


def bundle_path_problem(zip_path: Path, packages) -> str | None:
    """Why the bundle must not be written at `zip_path`, or None: never inside a lesson package,
    the folders students submit and the grader replaces (a bundle holds the hidden tests)."""
    resolved = zip_path.resolve()
    for package in packages:
        if REPO_ROOT / package in resolved.parents:
            return (f"{zip_path} is inside the lesson package {package}/, which students submit and the "
                    f"grader replaces; write the bundle outside the lesson packages, e.g. autograder.zip")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("zip_path", help="the zip to write, e.g. autograder.zip")
    parser.add_argument("--hidden-tests", default=str(REPO_ROOT / "instructor" / "hidden_tests.txt"),
                        help="node-id prefixes hidden until grades are published (default: %(default)s)")
    parser.add_argument("--hidden-tests-dir", default=None,
                        help=f"test files put in the bundle only, hidden until published (default: {HIDDEN_TESTS_DIR}, "
                             f"if it exists; a folder given here must exist)")
    parser.add_argument("--lessons", default="",
                        help="the lessons graded, comma- or space-separated, e.g. l2 or l1,l2 (default: every lesson)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from harness.grading import LESSON_PACKAGES

    lessons = args.lessons.replace(",", " ").split() or list(LESSON_PACKAGES)
    unknown = [lesson for lesson in lessons if lesson not in LESSON_PACKAGES]
    if unknown:
        print(f"error: --lessons {' '.join(unknown)}: no such lesson; choose from {' '.join(LESSON_PACKAGES)}",
              file=sys.stderr)
        return 2
    hidden = Path(args.hidden_tests)
    if not hidden.is_file():
        print(f"error: {hidden} does not exist; pass --hidden-tests FILE", file=sys.stderr)
        return 2
    hidden_dir = Path(args.hidden_tests_dir) if args.hidden_tests_dir is not None else HIDDEN_TESTS_DIR
    if args.hidden_tests_dir is not None and not hidden_dir.is_dir():  # a typo would grade without them
        print(f"error: --hidden-tests-dir {hidden_dir} is not a folder; give the folder that holds the hidden "
              f"test_*.py files", file=sys.stderr)
        return 2
    if problem := bundle_path_problem(Path(args.zip_path), LESSON_PACKAGES.values()):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from harness.cli import starting

    with starting():  # imports torch: a Ctrl-C inside an extension's import must not reach it
        from harness.benchmark import checked_output_path  # before 30 s of building, not after

    checked_output_path(args.zip_path, "zip_path")
    manifest = build(Path(args.zip_path).resolve(), hidden, lessons, hidden_dir)
    points = {lesson: sum(t["points"] for t in manifest["tests"].values() if t["lesson"] == lesson) for lesson in lessons}
    print(f"wrote {args.zip_path}: grades {', '.join(f'{k} ({v:g} points)' for k, v in points.items())}, "
          f"{len(manifest['tests'])} tests")
    print("upload it on Gradescope as the autograder; students submit their lesson packages "
          f"({'/ '.join(manifest['packages'])}/)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    from harness.cli import run_main

    sys.exit(run_main(main, "no bundle was written"))
