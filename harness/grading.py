"""Autograder plugin for pytest (loaded by `-p harness.grading` in pyproject.toml).

- `@pytest.mark.points(n)` gives a test its weight (1 when absent); a lesson marker (`l1`, `l2`,
  ...) or `course` says which lesson it grades, so `pytest -m l2` runs one lesson.
- At the end of a run a score table per lesson is printed.
- `--results-json PATH` writes Gradescope's format: {"score", "tests": [{name, score, max_score, output}]}.
- `--run-slow` runs the long soaks marked `slow` (CI runs their bounded versions only);
  tests marked `gpu` are skipped when torch sees no CUDA device.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

LESSONS = ("course", "l1", "l2", "l3", "l5", "l8")


def pytest_addoption(parser):
    group = parser.getgroup("grading")
    group.addoption("--results-json", default=None, help="write Gradescope-style results to this path")
    group.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    cuda = _cuda_available()
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow soak: run with --run-slow"))
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class _Scores:
    def __init__(self):
        self.rows: dict[str, dict] = {}

    def record(self, item, report) -> None:
        row = self.rows.setdefault(item.nodeid, {
            "name": item.nodeid, "lesson": _lesson_of(item), "max_score": _points_of(item),
            "outcome": "passed", "output": ""})
        if report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"
        elif report.failed:
            row["outcome"] = "failed"
            row["output"] = _short_failure(report)


_scores = _Scores()
_items: dict[str, pytest.Item] = {}


def pytest_runtest_setup(item):
    _items[item.nodeid] = item


def pytest_runtest_logreport(report):
    item = _items.get(report.nodeid)
    if item is not None:
        _scores.record(item, report)


def _lesson_of(item) -> str:
    return next((name for name in LESSONS if item.get_closest_marker(name)), "other")


def _points_of(item) -> float:
    mark = item.get_closest_marker("points")
    return float(mark.args[0]) if mark else 1.0


def _short_failure(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else str(report.longrepr)[-2000:]


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
              "max_score": r["max_score"], "output": r["output"]} for r in rows]
    with open(path, "w") as f:
        json.dump({"score": score, "tests": tests}, f, indent=2)
