"""Autograder plugin for pytest (loaded by `-p harness.grading` in pyproject.toml).

- `@pytest.mark.points(n)` gives a test its weight. A test without it is worth 0: it still runs
  (and can fail the run) but is not part of the grade. Only tests of what the student writes (the
  code between `# BEGIN SOLUTION` and `# END SOLUTION`) carry points.
- A lesson marker (`l1`, `l2`, ...) or `course` says which lesson a test belongs to, so
  `pytest -m l2` runs one lesson; `notebook` marks the notebook runs, so `-m "l2 and not notebook"`
  with `--graded-only` is a lesson's fast loop (`make check-l2`). At the end of a run a score table per lesson is printed.
- `--graded-only` deselects the tests worth 0 points (what the autograder runs).
- `--results-json PATH` writes Gradescope's format: {"score", "tests": [{name, score, max_score,
  status, output, visibility, tags: [lesson]}]}. The output never holds ANSI colour codes. A test
  marked `hidden`, or whose node id starts with a line of `--hidden-tests FILE`, gets visibility
  "after_published".
- `--run-slow` runs the long soaks marked `slow` (CI runs their bounded versions only; they carry
  no points); tests marked `gpu` are skipped when torch sees no CUDA device.
- For the Gradescope runner (instructor/autograder/grade.py), which never trusts the run it grades:
  `--manifest PATH` writes the collected tests' points, lessons and visibility (the bundle's own
  copy, collected when it is built), and `--outcomes-log PATH` appends one JSON line per test
  phase and per collection error as they happen, so a run stopped by a time limit still tells
  which tests passed.
"""

from __future__ import annotations

import functools
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from harness import judge as _judge

# {"l1": "l1_contiguous", ...}: the one list of lessons, from the `lN_<name>/` packages at the
# repository's root: adding a lesson's package adds it to grading and the bundle.
LESSON_PACKAGES = {name.split("_")[0]: name for name in _judge.lesson_packages()}
# With KVCOURSE_JUDGE set, this process runs no student code (harness/__init__.py, judge.py).
JUDGE = _judge.ENDPOINT
LESSONS = ("course", *LESSON_PACKAGES)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MAX_OUTPUT = 4000  # characters of a failure kept in results.json: its start and its end


def strip_ansi(text: str) -> str:
    """`text` without terminal colour/cursor codes (IPython tracebacks carry them)."""
    return _ANSI.sub("", text)


def pytest_addoption(parser):
    group = parser.getgroup("grading")
    group.addoption("--results-json", default=None, help="write Gradescope-style results to this path")
    group.addoption("--run-slow", action="store_true", help="also run tests marked slow")
    group.addoption("--graded-only", action="store_true", help="deselect the tests that carry no points")
    group.addoption("--hidden-tests", default=None, metavar="FILE",
                    help="node-id prefixes, one a line, whose results are hidden until grades are published")
    group.addoption("--manifest", default=None, metavar="PATH",
                    help="write the collected tests' points, lessons and visibility as JSON (with --collect-only)")
    group.addoption("--outcomes-log", default=None, metavar="PATH",
                    help="append one JSON line per test phase and collection error, as they happen")


def pytest_collection_modifyitems(config, items):
    cuda = _cuda_available()
    if config.getoption("--graded-only"):
        kept = [item for item in items if _points_of(item) > 0]
        config.hook.pytest_deselected(items=[item for item in items if _points_of(item) == 0])
        items[:] = kept
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow soak: run with --run-slow"))
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)"))


def pytest_collection_finish(session):
    path = session.config.getoption("--manifest")
    if path:
        tests = {item.nodeid: {"points": _points_of(item), "lesson": _lesson_of(item),
                               "hidden": _is_hidden(item), "slow": "slow" in item.keywords,
                               "notebook": "notebook" in item.keywords, "keywords": _keywords_of(item)}
                 for item in session.items}
        Path(path).write_text(json.dumps(tests, indent=1))


def pytest_collectreport(report):
    if report.failed:
        _log_outcome({"collect_error": report.nodeid, "output": cap(strip_ansi(str(report.longrepr)))})


def _log_outcome(entry: dict) -> None:
    if _outcomes_log is not None:
        _outcomes_log.write(json.dumps(entry) + "\n")
        _outcomes_log.flush()


_outcomes_log = None


def _readable_temporary_folders() -> None:
    """Judged as root (Gradescope), the worker runs as another user and must read what a test
    made for it in a temporary folder (a model's files); pytest makes those folders 0700. Here
    they are 0755: readable, never writable, by the worker."""
    from _pytest.tmpdir import TempPathFactory

    made, base = TempPathFactory.mktemp, TempPathFactory.getbasetemp

    def getbasetemp(self):
        path = base(self)
        path.chmod(0o755)
        return path

    def mktemp(self, basename, numbered=True):
        path = made(self, basename, numbered)
        path.chmod(0o755)
        return path

    TempPathFactory.getbasetemp, TempPathFactory.mktemp = getbasetemp, mktemp


def pytest_configure(config):
    global _outcomes_log
    if JUDGE is not None:
        _readable_temporary_folders()
    path = config.getoption("--outcomes-log")
    if path:  # /dev/fd/N: the grader's pipe, written through the inherited descriptor (not reopened)
        fd = re.fullmatch(r"/dev/fd/(\d+)", path)
        _outcomes_log = open(int(fd[1]) if fd else path, "a", encoding="utf-8")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# The grade of a test as it travels on its reports: under pytest-xdist (`make test` runs `-n 2`)
# the process that prints the table runs no test and sees only the reports its workers send.
GRADE_PROPERTY = "kvcourse-grade"


class _Scores:
    def __init__(self):
        self.rows: dict[str, dict] = {}

    def record(self, report, grade: dict) -> None:
        row = self.rows.setdefault(report.nodeid, {
            "name": report.nodeid, "lesson": grade["lesson"], "max_score": grade["points"],
            "outcome": "passed", "output": "", "hidden": grade["hidden"]})
        if report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"
        elif report.failed:
            row["outcome"] = "failed"
            row["output"] = _failure_text(report)


_scores = _Scores()


def pytest_runtest_teardown(item, nextitem):
    if JUDGE is not None:
        JUDGE.drop_copies()
        if JUDGE.broken:  # the worker is gone (judge.py: Endpoint.stop): the later tests are not run
            item.session.shouldstop = JUDGE.broken


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Every report of the item (setup, call, teardown) carries its grade from here on."""
    grade = {"lesson": _lesson_of(item), "points": _points_of(item), "hidden": _is_hidden(item)}
    item.user_properties.append((GRADE_PROPERTY, grade))


def pytest_runtest_logreport(report):
    _log_outcome({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                  "output": _failure_text(report) if report.failed else ""})
    grade = next((value for name, value in report.user_properties if name == GRADE_PROPERTY), None)
    if grade is not None:
        _scores.record(report, grade)


def _lesson_of(item) -> str:
    return next((name for name in LESSONS if item.get_closest_marker(name)), "other")


def _keywords_of(item) -> list[str]:
    """The names `-k` matches against, as pytest gathers them: the item's and its parents' names
    (not the session's or the root folder's) and its markers' (the lessons' points tables are checked
    by evaluating their `-k` selections on these)."""
    names = {node.name for node in item.listchain() if not isinstance(node, pytest.Session)
             and not (isinstance(node, pytest.Directory) and isinstance(node.parent, pytest.Session))}
    return sorted(names | {mark.name for mark in item.iter_markers()} | set(item.listextrakeywords()))


def _points_of(item) -> float:
    mark = item.get_closest_marker("points")
    return float(mark.args[0]) if mark else 0.0


def _is_hidden(item) -> bool:
    if item.get_closest_marker("hidden"):
        return True
    path = item.config.getoption("--hidden-tests")
    return bool(path) and any(item.nodeid.startswith(p) for p in _hidden_prefixes(path))


@functools.lru_cache(maxsize=None)
def _hidden_prefixes(path: str) -> tuple[str, ...]:
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


def cap(text: str, limit: int = MAX_OUTPUT) -> str:
    """`text`, or when longer than `limit` its first and last limit/2 characters."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters left out] ...\n{text[-half:]}"


def _failure_text(report) -> str:
    """The failure as pytest prints it, without ANSI codes; when long, its one-line message (itself
    capped) and the ends of the traceback (the test, and the error where it was raised)."""
    text = strip_ansi(str(report.longrepr))
    if len(text) <= MAX_OUTPUT:
        return text
    crash = getattr(report.longrepr, "reprcrash", None)
    head = cap(strip_ansi(crash.message), MAX_OUTPUT // 4) if crash is not None else ""
    return f"{head}\n...\n{cap(text)}"


def graded_rows() -> list[dict]:
    """Tests that ran (skipped ones earn and cost nothing)."""
    return [r for r in _scores.rows.values() if r["outcome"] != "skipped"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = graded_rows()
    if not rows:
        return
    per_lesson = defaultdict(lambda: [0.0, 0.0, 0, 0])
    for r in rows:
        s = per_lesson[r["lesson"]]
        s[0] += r["max_score"] if r["outcome"] == "passed" else 0.0
        s[1] += r["max_score"]
        s[2] += r["outcome"] == "passed"
        s[3] += 1
    tr = terminalreporter
    tr.section("score by lesson")
    tr.write_line(f"{'lesson':<8}{'points':>14}{'tests passed':>16}")
    for lesson in sorted(per_lesson, key=lambda x: (LESSONS + ("other",)).index(x)):
        got, total, ok, n = per_lesson[lesson]
        tr.write_line(f"{lesson:<8}{got:>7g} / {total:<5g}{ok:>9} / {n}")
    got = sum(s[0] for s in per_lesson.values())
    total = sum(s[1] for s in per_lesson.values())
    tr.write_line(f"{'total':<8}{got:>7g} / {total:<5g}")
    path = config.getoption("--results-json")
    if path:
        _write_results(path, rows, got)
        tr.write_line(f"wrote {path}")


def _write_results(path: str, rows: list[dict], score: float) -> None:
    tests = [{"name": r["name"], "score": r["max_score"] if r["outcome"] == "passed" else 0.0,
              "max_score": r["max_score"], "status": r["outcome"], "output": r["output"],
              "visibility": "after_published" if r["hidden"] else "visible", "tags": [r["lesson"]]}
             for r in rows]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"score": score, "tests": tests}, f, indent=2)
