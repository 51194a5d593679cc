"""Grade one submission on Gradescope: the parent process that run_autograder starts.

It never imports the student's code (only the standard library is used here) and it alone writes
results.json:

1. The lesson packages are found in the upload (a few folders down, the shallowest match, never
   under `__MACOSX/` or a hidden folder, only folders with an `__init__.py`) and replace the stubs
   in a scratch copy of the bundle. Which were graded, and which were not found, goes into
   results.json's top-level `output`, which the student sees.
2. A few canary tests with random names, which must fail, are planted among the bundle's tests.
3. A worker runs pytest on the scratch copy as an unprivileged user (when this runs as root, as on
   Gradescope), so it cannot write results.json or the bundle. Each test has a time limit
   (pytest-timeout) and the whole run one more, below Gradescope's; the worker's outcomes are
   streamed test by test (the grading plugin's `--outcomes-log`), so what finished still counts.
4. Points come from the manifest collected from the bundle's own copy when it was built, never
   from the worker. A canary reported as passed means the reports were forged: the submission
   gets 0 and is flagged for the instructor. Imports that only a cheat needs are flagged too.

Settings (environment): AUTOGRADER_ROOT (/autograder), AUTOGRADER_SOURCE ($ROOT/source),
AUTOGRADER_SUBMISSION ($ROOT/submission), AUTOGRADER_RESULTS ($ROOT/results/results.json),
AUTOGRADER_PYTHON (the python that runs pytest), AUTOGRADER_TIME_LIMIT (seconds for the whole
run, default 1500), AUTOGRADER_TEST_TIMEOUT (seconds per test, default 180), AUTOGRADER_SELECT
(node-id prefixes: grade only those tests, to try the bundle on a part), AUTOGRADER_PYTEST_ARGS,
AUTOGRADER_WORKER_USER (default autograder-student; empty: the worker runs as the current user).
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

WORKER_USER = os.environ.get("AUTOGRADER_WORKER_USER", "autograder-student")  # "": the current user
LOG_CAP = 20_000  # characters of the worker's output kept at each end
OUTPUT_CAP = 4_000  # characters of one test's output in results.json, at both ends together
SEARCH_DEPTH = 4  # folders below the upload's root searched for a lesson package
# Only code that works against the grader needs these in a lesson package.
SUSPICIOUS = {
    "transformers": r"\b(import|from)\s+transformers\b",
    "the grading plugin": r"\bgrading\b|\bharness\b",
    "pytest internals": r"\b_?pytest\b",
    "atexit": r"\batexit\b",
    "inspect": r"\binspect\b",
    "frame access": r"_getframe|\bf_back\b|\bf_locals\b|\bf_globals\b|\bsettrace\b|\bsetprofile\b|get_referrers",
}


def cap(text: str, limit: int = OUTPUT_CAP) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters left out] ...\n{text[-half:]}"


def find_packages(submission: Path, packages: list[str]) -> tuple[dict[str, Path], list[str]]:
    """{package: folder} for the packages found in the upload, and the names not found."""
    candidates: dict[str, list[Path]] = {name: [] for name in packages}
    for folder, subfolders, files in os.walk(submission):
        here = Path(folder)
        depth = len(here.relative_to(submission).parts)
        subfolders[:] = sorted(d for d in subfolders if not d.startswith((".", "__MACOSX", "__pycache__"))
                               and depth < SEARCH_DEPTH)
        if here.name in candidates and "__init__.py" in files and here != submission:
            candidates[here.name].append(here)
    found = {name: min(paths, key=lambda p: (len(p.parts), str(p))) for name, paths in candidates.items() if paths}
    return found, [name for name in packages if name not in found]


def flags_of(found: dict[str, Path]) -> list[str]:
    """`file: what it uses` for each submitted file that uses something only a cheat needs."""
    flags = []
    for package, folder in found.items():
        for path in sorted(folder.rglob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            used = [what for what, pattern in SUSPICIOUS.items() if re.search(pattern, text)]
            if used:
                flags.append(f"{package}/{path.relative_to(folder)}: {', '.join(used)}")
    return flags


def plant_canaries(tests_dir: Path, lesson: str) -> list[str]:
    """Two tests that must fail, with random names: one collected first, one last."""
    rng = random.SystemRandom()
    nodeids = []
    for prefix in ("test_a", "test_z"):
        name = f"{prefix}{rng.randrange(16**10):010x}"
        value = rng.randrange(10**6)
        (tests_dir / f"{name}.py").write_text(
            "import pytest\n\n\n"
            f"@pytest.mark.{lesson}\n@pytest.mark.points(1)\n"
            f"def {name}_matches():\n    value = {value}\n    assert value == {value + 1}\n")
        nodeids.append(f"tests/{name}.py::{name}_matches")
    return nodeids


def worker_user() -> tuple[int, int] | None:
    """(uid, gid) of the unprivileged user the worker runs as, created if needed; None when this
    process is not root (a local try: the worker then runs as the current user)."""
    if os.geteuid() != 0 or not WORKER_USER:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(WORKER_USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", WORKER_USER], check=True)
        entry = pwd.getpwnam(WORKER_USER)
    return entry.pw_uid, entry.pw_gid


def can_run_as(user: tuple[int, int], python: str) -> bool:
    try:
        probe = subprocess.run([python, "-c", "import pytest, torch"], user=user[0], group=user[1],
                               extra_groups=[], capture_output=True, cwd="/", timeout=300)
    except OSError:  # e.g. the python lies under a folder only root may enter
        return False
    return probe.returncode == 0


class CappedLog:
    """The worker's output, read from a pipe as it comes: its first and last LOG_CAP characters."""

    def __init__(self, stream):
        self.head, self.tail, self.dropped = "", "", 0
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream):
        for chunk in iter(lambda: stream.read(8192), ""):
            room = LOG_CAP - len(self.head)
            self.head += chunk[:room]
            self.tail = (self.tail + chunk[room:])[-LOG_CAP:] if len(chunk) > room else self.tail
            self.dropped += max(0, len(chunk) - room)

    def text(self) -> str:
        self.thread.join(timeout=10)
        left_out = self.dropped - len(self.tail)
        middle = f"\n... [{left_out} characters left out] ...\n" if left_out > 0 else ""
        return self.head + middle + self.tail


def run_worker(cmd: list[str], cwd: Path, env: dict, user, time_limit: float) -> tuple[str, int | None]:
    """Run pytest; return its (capped) output and exit status, None when stopped by the time limit."""
    ids = dict(user=user[0], group=user[1], extra_groups=[]) if user else {}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True, **ids)
    log = CappedLog(proc.stdout)
    try:
        status = proc.wait(timeout=time_limit)
    except subprocess.TimeoutExpired:
        status = None
    try:  # the worker's whole process group, whether it finished or not
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return log.text(), status


def read_outcomes(path: Path) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """({nodeid: {phase: outcome}} with "output" for the first failure, {file: collection error})."""
    outcomes: dict[str, dict[str, str]] = {}
    errors: dict[str, str] = {}
    if not path.is_file():
        return outcomes, errors
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in iter(lambda: f.readline(4 * OUTPUT_CAP), ""):
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut at the cap, or not ours
            if not isinstance(entry, dict):
                continue
            if "collect_error" in entry:
                errors[str(entry["collect_error"])] = cap(str(entry.get("output", "")))
            elif "nodeid" in entry:
                phases = outcomes.setdefault(str(entry["nodeid"]), {})
                phases[str(entry.get("when"))] = str(entry.get("outcome"))
                if entry.get("outcome") == "failed" and "output" not in phases:
                    phases["output"] = cap(str(entry.get("output", "")))
    return outcomes, errors


def status_of(phases: dict[str, str]) -> str:
    if "failed" in (phases.get("setup"), phases.get("call"), phases.get("teardown")):
        return "failed"
    if "skipped" in (phases.get("setup"), phases.get("call")):
        return "skipped"
    return "passed" if phases.get("call") == "passed" else "missing"


def why_not_run(nodeid: str, errors: dict[str, str], status: int | None, time_limit: float, log: str) -> str:
    module = nodeid.split("::")[0]
    if module in errors:
        return f"{module} could not be collected (so none of its tests ran):\n{errors[module]}"
    if status is None:
        return f"Not run: the grading time limit ({time_limit:g} s) was reached before this test."
    return f"Not run: the test run stopped early (pytest exit status {status}). Its output ends:\n{cap(log, 2000)}"


def grade(manifest: dict, select: list[str], outcomes, errors, status, time_limit, log) -> list[dict]:
    rows = []
    for nodeid, test in manifest["tests"].items():
        if select and not nodeid.startswith(tuple(select)):
            continue
        phases = outcomes.get(nodeid, {})
        result = status_of(phases)
        if result == "skipped":
            continue  # e.g. a gpu test on a machine without one: earns and costs nothing
        output = phases.get("output", "") if result != "missing" else why_not_run(
            nodeid, errors, status, time_limit, log)
        rows.append({"name": nodeid, "score": test["points"] if result == "passed" else 0.0,
                     "max_score": test["points"], "status": "passed" if result == "passed" else "failed",
                     "output": output, "visibility": "after_published" if test["hidden"] else "visible",
                     "tags": [test["lesson"]]})
    return rows


def lesson_totals(rows: list[dict]) -> str:
    totals: dict[str, list[float]] = {}
    for row in rows:
        total = totals.setdefault(row["tags"][0], [0.0, 0.0])
        total[0] += row["score"]
        total[1] += row["max_score"]
    return "\n".join(f"{lesson}: {got:g} / {out_of:g}" for lesson, (got, out_of) in totals.items())


def main() -> int:
    root = Path(os.environ.get("AUTOGRADER_ROOT", "/autograder"))
    source = Path(os.environ.get("AUTOGRADER_SOURCE", root / "source"))
    submission = Path(os.environ.get("AUTOGRADER_SUBMISSION", root / "submission"))
    results = Path(os.environ.get("AUTOGRADER_RESULTS", root / "results" / "results.json"))
    python = os.environ.get("AUTOGRADER_PYTHON", str(root / "venv" / "bin" / "python"))
    time_limit = float(os.environ.get("AUTOGRADER_TIME_LIMIT", 1500))
    test_timeout = float(os.environ.get("AUTOGRADER_TEST_TIMEOUT", 180))
    select = os.environ.get("AUTOGRADER_SELECT", "").split()
    manifest = json.loads((source / "grading_manifest.json").read_text())

    work = Path(tempfile.mkdtemp(prefix="autograder-"))
    copy = work / "source"
    # What the tests do not need stays out of the worker's reach: which tests are hidden, the points.
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(
        "grading_manifest.json", "hidden_tests.txt", "grade.py", "setup.sh", "run_autograder", "__pycache__"))
    found, missing = find_packages(submission, manifest["packages"])
    for package, folder in found.items():
        shutil.rmtree(copy / package)
        # symlinks=True: a link is copied as a link, never followed by root to a file it may not read
        shutil.copytree(folder, copy / package, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    notes = [f"graded: {p} (from {found[p].relative_to(submission)})" for p in found]
    notes += [f"not found in the submission: {p} (the handout's stub is graded in its place)" for p in missing]
    print("\n".join(notes))
    flags = flags_of(found)
    for flag in flags:
        print(f"FLAG for the instructor: {flag}")

    canaries = plant_canaries(copy / "tests", manifest["lessons"][0])
    files = sorted({n.split("::")[0] for n in manifest["tests"] if not select or n.startswith(tuple(select))})
    outcomes_log = work / "outcomes.jsonl"
    cmd = [python, "-m", "pytest", "--graded-only", "--continue-on-collection-errors", "--color=no", "-q",
           "-p", "no:cacheprovider", "--hypothesis-profile=grading", f"--timeout={test_timeout:g}",
           "--outcomes-log", str(outcomes_log), "-m", " or ".join(manifest["lessons"]),
           canaries[0].split("::")[0], *files, canaries[1].split("::")[0],
           *shlex.split(os.environ.get("AUTOGRADER_PYTEST_ARGS", ""))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGRADER_")}
    env.update(HOME=str(work), PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    user = worker_user()
    source_mode = source.stat().st_mode & 0o777
    if user is not None:
        os.chmod(source, 0o700)  # the bundle (manifest, hidden tests) out of the worker's reach
        if not can_run_as(user, python):
            print(f"warning: {WORKER_USER} cannot run {python}; the worker runs as root (make the "
                  "environment readable by other users)")
            user = None
    if user is None:
        print("note: the worker runs as the current user, with no privilege separation")
    else:
        shutil.chown(work, *user)
        for path in work.rglob("*"):
            os.chown(path, *user, follow_symlinks=False)
    try:
        log, status = run_worker(cmd, copy, env, user, time_limit)
    finally:
        os.chmod(source, source_mode)
    print(log)

    outcomes, errors = read_outcomes(outcomes_log)
    rows = grade(manifest, select, outcomes, errors, status, time_limit, log)
    # A worker whose report says anything passed must also report the canaries failed.
    anything_passed = any(row["status"] == "passed" for row in rows)
    forged = [c for c in canaries if status_of(outcomes.get(c, {})) == "passed"
              or (anything_passed and status is not None and status_of(outcomes.get(c, {})) != "failed")]
    output = "\n".join(notes)
    if forged:
        print(f"FLAG for the instructor: canary tests that must fail were reported as passed: {forged}; "
              "the test reports were tampered with, the score is 0")
        for row in rows:
            row["score"], row["status"] = 0.0, "failed"
            row["output"] = "Not scored: the grader could not trust this run's reports; your instructor will review it."
        output += "\nThis submission's test reports could not be trusted; your instructor will review it."
    if status is None:
        output += f"\nThe grading time limit ({time_limit:g} s) was reached: tests that had not run score 0."
    output += "\n" + lesson_totals(rows)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({"score": sum(r["score"] for r in rows), "output": output, "tests": rows}, indent=1))
    print(f"wrote {results}\n{lesson_totals(rows)}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def write_internal_error(results: Path) -> None:
    """The grader itself broke: say so in results.json (the traceback is in Gradescope's log)."""
    import traceback

    traceback.print_exc()
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({"score": 0, "tests": [], "output": (
        "The grader failed before it could score this submission (an internal error, not your code's); "
        "your instructor has the log.")}))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        write_internal_error(Path(os.environ.get("AUTOGRADER_RESULTS",
                                                 Path(os.environ.get("AUTOGRADER_ROOT", "/autograder")) / "results" / "results.json")))
        sys.exit(0)
