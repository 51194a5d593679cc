"""The Gradescope bundle (`make autograder`), run in a temporary folder laid out like Gradescope's
(/autograder/source, /autograder/submission, /autograder/results), as an instructor would try it
and as a student who wants points without the work would attack it.

In `make test` each case grades one or two fast files (AUTOGRADER_SELECT, a few seconds each);
the slow variants grade everything."""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from harness.grading import LESSON_PACKAGES
from helpers import load_script

pytestmark = [pytest.mark.course, pytest.mark.timeout(900)]  # each test grades in a subprocess

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = tuple(LESSON_PACKAGES.values())
FAST = "tests/test_l2_allocator.py"  # L2's allocator, reserve, meta and mask: a few seconds
HIDDEN = "tests/test_l2_allocator.py::test_random_alloc_free_sequences_keep_every_invariant"
HIDDEN_FILE = "test_l2_hidden_extra.py"  # only in the bundle, from the hidden tests folder
HIDDEN_TEST = """import pytest
from l2_paged import BlockAllocator


@pytest.mark.l2
@pytest.mark.points(1)
def test_two_blocks_come_back_in_the_free_list():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    alloc.free(alloc.alloc_blocks(2))
    assert alloc.num_free == 2
"""


def build(tmp: Path, *args: str) -> Path:
    """autograder.zip built with `args`, unpacked in <tmp>/autograder/source; returns <tmp>/autograder."""
    (tmp / "hidden.txt").write_text(f"# hidden until published\n{HIDDEN}\n")
    (tmp / "hidden_tests").mkdir()
    (tmp / "hidden_tests" / HIDDEN_FILE).write_text(HIDDEN_TEST)
    assert load_script("make_autograder").main([str(tmp / "autograder.zip"), "--hidden-tests", str(tmp / "hidden.txt"),
                                                "--hidden-tests-dir", str(tmp / "hidden_tests"), *args]) == 0
    with zipfile.ZipFile(tmp / "autograder.zip") as zf:
        modes = {i.filename: i.external_attr >> 16 for i in zf.infolist()}
        zf.extractall(tmp / "autograder" / "source")
    for name in ("setup.sh", "run_autograder"):
        assert modes[name] & 0o111, f"{name} is not executable in the zip"
        (tmp / "autograder" / "source" / name).chmod(0o755)
    return tmp / "autograder"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("bundle"))


def submit(tmp_path: Path, packages_from: Path, folder: str = "my-work", edits: dict | None = None) -> Path:
    """A student's upload: the packages in `folder` (below the upload's root); `edits` maps
    "package/file.py" to (old, new) text replacements."""
    submission = tmp_path / "submission"
    for package in PACKAGES:
        shutil.copytree(packages_from / package, submission / folder / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name, (old, new) in (edits or {}).items():
        path = submission / folder / name
        text = path.read_text()
        assert old in text, f"{old!r} is not in {name}"
        path.write_text(text.replace(old, new, 1))
    return submission


# Each checkout grades with users of its own: a grading kills every process of its worker user when
# a part ends, so two checkouts grading at once (CI's clone beside a working copy) would otherwise
# kill each other's workers.
_CHECKOUT = hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]
USERS = {"AUTOGRADER_WORKER_USER": f"ag-worker-{_CHECKOUT}", "AUTOGRADER_JUDGE_USER": f"ag-judge-{_CHECKOUT}"}


@functools.lru_cache(maxsize=None)
def grading_pythons() -> dict[str, str]:
    """The worker's environment (grade.py's worker_environment) and the judge's python (its
    python_for), made once for this test process and handed to every grading
    (AUTOGRADER_WORKER_PYTHON, AUTOGRADER_JUDGE_PYTHON) instead of made again by each: about 12 s
    a grading. Empty when not root (both then run the grader's python) or where the grader refuses
    to make one (each grading then says why, and run_bundle skips with that reason)."""
    made = {"AUTOGRADER_WORKER_PYTHON": "", "AUTOGRADER_JUDGE_PYTHON": ""}
    if os.geteuid() != 0:
        return made
    grade = load_script_at(ROOT / "instructor" / "autograder" / "grade.py")
    grade.WORKER_USER, grade.JUDGE_USER = USERS["AUTOGRADER_WORKER_USER"], USERS["AUTOGRADER_JUDGE_USER"]
    folder = Path(tempfile.mkdtemp(prefix="autograder-pythons-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    folder.chmod(0o711)
    makers = {"AUTOGRADER_WORKER_PYTHON": lambda: grade.worker_environment(sys.executable, grade.worker_user(), folder),
              "AUTOGRADER_JUDGE_PYTHON": lambda: grade.python_for(sys.executable, grade.judge_user(), folder,
                                                                  "judge-python")}
    for setting, make in makers.items():
        try:
            made[setting] = make()
        except grade.Refused:
            pass
    return made


def run_bundle(root: Path, submission: Path, tmp_path: Path, select: str | None = FAST, **settings) -> dict:
    """results.json of run_autograder on `submission`, plus its "log" (stdout) and "seconds".
    Skipped, with the grader's reason, where the grader refuses to grade on this machine (as root,
    the worker's user can run neither this python nor a system one over its packages)."""
    results = tmp_path / "results" / "results.json"
    env = {**os.environ, **USERS, "AUTOGRADER_ROOT": str(root), "AUTOGRADER_SUBMISSION": str(submission),
           "AUTOGRADER_RESULTS": str(results), "AUTOGRADER_PYTHON": sys.executable, "AUTOGRADER_SELECT": select or "",
           **grading_pythons(),
           **{f"AUTOGRADER_{k.upper()}": str(v) for k, v in settings.items()}}
    env.pop("PYTHONPATH", None)  # the scratch copy must be what is imported, as on Gradescope
    start = time.monotonic()
    run = subprocess.run([str(root / "source" / "run_autograder")], env=env, capture_output=True,
                         text=True, timeout=3600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    graded = json.loads(results.read_text())
    if "refused" in graded.get("extra_data", {}):
        pytest.skip(f"the grader cannot run the worker on this machine: {graded['extra_data']['refused']}")
    return {**graded, "log": run.stdout, "seconds": time.monotonic() - start}


def scores(results: dict) -> dict[str, float]:
    return {t["name"]: t["score"] for t in results["tests"]}


def failed(results: dict) -> list[str]:
    return [t["name"] for t in results["tests"] if t["score"] < t["max_score"]]


def check_fresh_and_solution(fresh: dict, solution: dict) -> None:
    fields = {"name", "score", "max_score", "status", "output", "visibility", "tags"}
    for results in (fresh, solution):
        assert results["tests"] and all(fields <= set(t) for t in results["tests"])
        assert all(t["max_score"] > 0 for t in results["tests"])  # graded tests only
        assert not any("\x1b[" in t["output"] for t in results["tests"])
    assert fresh["score"] == 0, [t["name"] for t in fresh["tests"] if t["score"]]
    unexplained = [t["name"] for t in fresh["tests"] if t["status"] != "failed" or "NotImplementedError" not in t["output"]]
    assert not unexplained, f"fresh-copy tests that do not fail on a stub's NotImplementedError: {unexplained}"
    total = sum(t["max_score"] for t in solution["tests"])
    assert solution["score"] == total > 0, failed(solution)


# ---------------------------------------------------------------- what the bundle holds


def test_the_bundle_holds_the_student_copy_the_manifest_and_no_solution(bundle):
    source = bundle / "source"
    names = {p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()}
    assert {"setup.sh", "run_autograder", "grade.py", "grading_manifest.json", "hidden_tests.txt",
            "pyproject.toml", "harness/grading.py", f"tests/{HIDDEN_FILE}"} <= names
    assert not [n for n in names if n.startswith(("instructor/", "tests/test_course_", "tests/test_lessons_"))]
    for name in names:
        if name.startswith(PACKAGES) and name.endswith(".py"):
            assert "# BEGIN SOLUTION" not in (source / name).read_text(encoding="utf-8"), f"{name} holds a solution"
    manifest = json.loads((source / "grading_manifest.json").read_text())
    assert manifest["packages"] == list(PACKAGES)
    tests = manifest["tests"]
    assert tests and all(t["points"] > 0 and not t["slow"] for t in tests.values())
    assert tests[HIDDEN]["hidden"] and tests[f"tests/{HIDDEN_FILE}::test_two_blocks_come_back_in_the_free_list"]["hidden"]
    assert {t["lesson"] for t in tests.values()} == set(LESSON_PACKAGES)


def test_hidden_tests_are_left_out_of_the_student_copy(tmp_path):
    assert load_script("make_student_copy").main([str(tmp_path / "copy")]) == 0
    assert not (tmp_path / "copy" / "instructor").exists()
    assert not list((tmp_path / "copy" / "tests").glob("test_*hidden*"))


# ---------------------------------------------------------------- honest submissions


def test_a_fresh_copy_scores_0_and_the_solution_full_marks_from_a_finder_zip_two_folders_down(bundle, tmp_path):
    fresh = run_bundle(bundle, submit(tmp_path / "fresh", bundle / "source"), tmp_path / "fresh",
                       select=f"{FAST} tests/{HIDDEN_FILE}")
    # A Finder zip: __MACOSX/ holds resource forks, here also complete stub packages, listed first;
    # a hidden folder too. The solution itself is two folders down.
    solution = submit(tmp_path / "solution", ROOT, folder="course/my-work")
    for decoy in ("__MACOSX", ".old"):
        for package in PACKAGES:
            shutil.copytree(bundle / "source" / package, solution / decoy / package)
            (solution / decoy / package / f"._{package}").write_bytes(b"\x00\x05\x16\x07")
    graded = run_bundle(bundle, solution, tmp_path / "solution", select=f"{FAST} tests/{HIDDEN_FILE}")
    check_fresh_and_solution(fresh, graded)
    assert f"graded: l2_paged (from {Path('course/my-work/l2_paged')})" in graded["output"]
    # The totals the student sees at once count the visible tests only.
    visible = sum(t["max_score"] for t in graded["tests"] if t["visibility"] == "visible")
    assert f"l2: {visible:g} / {visible:g}" in graded["output"] and "and 2 hidden tests (4 points), shown when" in graded["output"]
    visibility = {t["name"]: t["visibility"] for t in graded["tests"]}
    assert visibility.pop(HIDDEN) == visibility.pop(f"tests/{HIDDEN_FILE}::test_two_blocks_come_back_in_the_free_list") == "after_published"
    assert set(visibility.values()) == {"visible"}


@pytest.mark.timeout(1200)
def test_a_weekly_bundle_grades_only_its_lesson_with_the_students_earlier_packages(tmp_path):
    root = build(tmp_path, "--lessons", "l2")
    manifest = json.loads((root / "source" / "grading_manifest.json").read_text())
    assert {t["lesson"] for t in manifest["tests"].values()} == {"l2"}
    copy = tmp_path / "l1-l2-done"
    assert load_script("make_student_copy").main([str(copy), "--keep", "L1,L2"]) == 0
    results = run_bundle(root, submit(tmp_path / "week", copy), tmp_path / "week",
                         select=FAST)
    assert {t["tags"][0] for t in results["tests"]} == {"l2"}
    assert results["score"] == sum(t["max_score"] for t in results["tests"]) > 0, failed(results)
    visible = sum(t["max_score"] for t in results["tests"] if t["visibility"] == "visible")
    assert f"l2: {visible:g} / {visible:g}" in results["output"]  # the hidden test's points are not shown yet


# ---------------------------------------------------------------- broken submissions: partial credit


def test_a_syntax_error_and_an_endless_loop_cost_only_the_tests_that_meet_them(bundle, tmp_path):
    edits = {"l8_prefix/cow.py": ("def ", "def def ", ),
             "l2_paged/meta.py": ("    # BEGIN SOLUTION\n", "    # BEGIN SOLUTION\n    while True:\n        pass\n")}
    results = run_bundle(bundle, submit(tmp_path, ROOT, edits=edits), tmp_path,
                         select=f"{FAST} tests/test_l8_blocks.py", test_timeout=5)
    lost = failed(results)
    l8 = [t for t in results["tests"] if t["name"].startswith("tests/test_l8_blocks.py")]
    assert l8 and all(t["score"] == 0 for t in l8)
    assert all("cow.py" in t["output"] and "SyntaxError" in t["output"] for t in l8), l8[0]["output"][-2000:]
    looped = [t for t in results["tests"] if t["name"] in lost and t not in l8]
    assert "tests/test_l2_allocator.py::test_ragged_causal_mask_on_a_hand_built_batch" in [t["name"] for t in looped]
    untimed = {t["name"]: t["output"][-1500:] for t in looped if "Timeout" not in t["output"]}
    assert not untimed, untimed
    assert len(looped) <= 3  # the mask's test and the two that build metadata with it
    assert results["score"] > 0


def test_the_whole_run_has_a_time_limit_and_the_finished_tests_still_count(bundle, tmp_path):
    edits = {"l2_paged/meta.py": ("    # BEGIN SOLUTION\n", "    # BEGIN SOLUTION\n    while True:\n        pass\n")}
    results = run_bundle(bundle, submit(tmp_path, ROOT, edits=edits), tmp_path, select=FAST,
                         test_timeout=600, time_limit=20)
    assert results["seconds"] < 80
    assert "The time limit was reached in the judged tests part" in results["output"]
    passed = [t for t in results["tests"] if t["status"] == "passed"]
    not_run = [t for t in results["tests"] if "Not run: the time limit of the judged tests part" in t["output"]]
    assert passed and not_run and results["score"] == sum(t["max_score"] for t in passed)


def test_a_10_mb_failure_message_leaves_a_results_json_under_1_mb_and_a_missing_package_is_named(bundle, tmp_path):
    edits = {"l2_paged/allocator.py": ("        # BEGIN SOLUTION\n",
                                       "        # BEGIN SOLUTION\n        raise AssertionError('x' * 10_000_000)\n")}
    submission = submit(tmp_path, ROOT, edits=edits)
    shutil.rmtree(submission / "my-work" / "l8_prefix")
    (submission / "my-work" / "l5_eviction" / "__init__.py").unlink()  # not a package
    results = run_bundle(bundle, submission, tmp_path, select=FAST)
    assert "not found in the submission: l8_prefix" in results["output"]
    assert "not found in the submission: l5_eviction" in results["output"]
    size = (tmp_path / "results" / "results.json").stat().st_size
    assert len(failed(results)) >= 5 and size < 1_000_000, (len(failed(results)), size)
    assert len(results["log"]) < 1_000_000
    assert all(len(t["output"]) <= 5000 for t in results["tests"])


# ---------------------------------------------------------------- cheats earn nothing

PLUGIN_PATCH = '''
import harness.grading as _grading  # every failure recorded as passed
_record = _grading._Scores.record
def _passed(self, report, grade):
    report.outcome = "passed"
    return _record(self, report, grade)
_grading._Scores.record = _passed
'''
ATEXIT_REWRITE = '''
import atexit, glob, json, os
def _rewrite():  # results.json (and any log of outcomes) rewritten as all passed
    for path in [os.environ.get("AUTOGRADER_RESULTS", "/autograder/results/results.json"),
                 "/autograder/results/results.json", *glob.glob(os.path.expanduser("~/*.jsonl"))]:
        try:
            with open(path, "w") as f:
                json.dump({"score": 1000, "tests": []}, f)
        except OSError:
            pass
atexit.register(_rewrite)
'''
FORGED_OUTCOMES = '''
import harness.grading as _grading  # the outcomes the grader reads, forged as passed
_log = _grading._log_outcome
def _forged(entry):
    if "outcome" in entry:
        entry = {**entry, "outcome": "passed", "output": ""}
    _log(entry)
_grading._log_outcome = _forged
'''
PATCHED_COMPARISONS = '''
import torch as _torch  # every comparison a test could make says "equal"
_torch.equal = _torch.allclose = lambda *args, **kwargs: True
_torch.testing.assert_close = lambda *args, **kwargs: None
_torch.Tensor.__eq__ = lambda self, other: _torch.ones((), dtype=_torch.bool)
'''


# Issue 52: an exception class named as pytest's Skipped, rebuilt by name in the judge, turned every
# failing test into a skip, and skipped tests vanished from results.json.
FORGED_SKIPS = '''
import builtins as _builtins  # every stub's NotImplementedError arrives named as pytest's skip
class Skipped(BaseException):
    pass
Skipped.__module__ = "_pytest.outcomes"
_builtins.NotImplementedError = Skipped
'''
# Issue 52: a list subclass crossed as a handle, so `==`, `in`, `len` and `bool` in the judge's asserts
# were answered by the student's code (which also saw the expected value).
ALWAYS_EQUAL = '''
import sys as _sys, types as _types
class _Yes(list):  # equal to anything, holding anything; any attribute or call is itself
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __contains__(self, item):
        return True
    def __len__(self):
        return 4
    def __getattr__(self, name):
        return self
    def __call__(self, *args, **kwargs):
        return self
    __hash__ = None
def _yes(*args, **kwargs):
    return _Yes()
for _module in [m for n, m in list(_sys.modules.items()) if n.startswith("l2_paged")]:
    for _name, _value in list(vars(_module).items()):
        if isinstance(_value, _types.FunctionType):
            setattr(_module, _name, _yes)
        elif isinstance(_value, type) and _value.__module__.startswith("l2_paged"):
            for _attr, _fn in list(vars(_value).items()):
                if isinstance(_fn, _types.FunctionType):
                    setattr(_value, _attr, (lambda self, *a, **k: None) if _attr == "__init__" else _yes)
'''


@pytest.mark.parametrize("init,cheat", [("l1_contiguous/__init__.py", PLUGIN_PATCH + ATEXIT_REWRITE),
                                        ("l1_contiguous/__init__.py", FORGED_OUTCOMES),
                                        ("l1_contiguous/__init__.py", PATCHED_COMPARISONS),
                                        ("l1_contiguous/__init__.py", FORGED_SKIPS),
                                        ("l2_paged/__init__.py", ALWAYS_EQUAL)],
                         ids=["plugin-and-atexit", "forged-outcomes", "patched-comparisons", "forged-skips",
                              "always-equal-results"])
def test_patching_the_grader_from_a_stub_submission_earns_nothing_and_is_flagged(bundle, tmp_path, init, cheat):
    """A stub's honest score is 0; so is the cheat's. The graded tests are judged: the patches
    change the worker's harness and torch, never the grader's reports or comparisons (so no canary
    is forged either: the forgery never reaches them); every graded test is in results.json, none
    skipped away."""
    text = (bundle / "source" / init).read_text()
    results = run_bundle(bundle, submit(tmp_path, bundle / "source", edits={init: (text, text + cheat)}), tmp_path)
    assert results["score"] == 0, [t["name"] for t in results["tests"] if t["score"]]
    assert results["tests"] and "== judged tests:" in results["log"]
    assert results["extra_data"]["forged_canaries"] == []
    manifest = json.loads((bundle / "source" / "grading_manifest.json").read_text())
    assert {t["name"] for t in results["tests"]} == {n for n in manifest["tests"] if n.startswith(FAST)}
    if cheat in (PLUGIN_PATCH + ATEXIT_REWRITE, FORGED_OUTCOMES):
        assert f"FLAG for the instructor: {init}: the grading plugin" in results["log"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the grader sweeps a user's processes only when run as root")
def test_the_sweep_kills_a_users_running_processes_and_does_not_wait_on_its_dead_ones():
    """After each pytest run the grader kills every process of the worker's user. One that has
    exited but is not yet reaped (a zombie: the grader's own child, between its exit and wait())
    runs nothing and cannot be killed: the sweep must not wait for it to go (it did, 10 s a round)."""
    grade = load_script_at(ROOT / "instructor" / "autograder" / "grade.py")
    grade.WORKER_USER = USERS["AUTOGRADER_WORKER_USER"]
    uid, gid = grade.worker_user()
    as_worker = dict(user=uid, group=gid, extra_groups=[], start_new_session=True)
    dead = subprocess.Popen(["/bin/true"], **as_worker)
    running = [subprocess.Popen(["/bin/sleep", "600"], **as_worker)]
    sys_exit = {"x86_64": 60, "aarch64": 93}.get(platform.machine())  # exit: this thread only, not exit_group
    if sys_exit and os.access("/usr/bin/python3", os.X_OK):  # its first thread exits, a second runs on
        running.append(subprocess.Popen(["/usr/bin/python3", "-c", FIRST_THREAD_EXITS.format(sys_exit)], **as_worker))
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (dead.pid not in grade.live_processes_of(uid)
                                                   and all(thread_states(p.pid)[:1] == ["Z"] for p in running[1:])):
            time.sleep(0.05)
        assert dead.pid not in grade.live_processes_of(uid)
        assert all(thread_states(p.pid)[:1] == ["Z"] and "S" in thread_states(p.pid) for p in running[1:])
        assert {p.pid for p in running} <= set(grade.live_processes_of(uid))
        start = time.monotonic()
        grade.kill_everything_of(uid)
        assert time.monotonic() - start < 2
        assert [p.wait(timeout=10) for p in running] == [-9] * len(running)  # in sessions of their own, killed
    finally:
        for p in running:
            p.kill()
            p.wait()
        dead.wait()


FIRST_THREAD_EXITS = """import ctypes, threading, time
threading.Thread(target=time.sleep, args=(600,)).start()
ctypes.CDLL(None).syscall({}, 0)
"""


def thread_states(pid: int) -> list[str]:
    """The state letter of each thread of `pid`, its first thread first."""
    tids = sorted(os.listdir(f"/proc/{pid}/task"), key=lambda tid: int(tid) != pid)
    return [Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()[0] for tid in tids]


@pytest.mark.skipif(os.geteuid() != 0, reason="the worker switches to an unprivileged user only when run as root")
def test_the_worker_runs_as_a_user_that_cannot_write_the_results(bundle, tmp_path):
    grade = load_script_at(bundle / "source" / "grade.py")
    grade.WORKER_USER = USERS["AUTOGRADER_WORKER_USER"]
    user = grade.worker_user()
    work = Path(tempfile.mkdtemp(prefix="autograder-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    work.chmod(0o711)
    try:
        python = grade.python_for(sys.executable, user, work, "worker-python")
    except grade.Refused as exc:
        pytest.skip(f"the grader cannot run the worker on this machine: {exc}")
    probe = "import os, sys; open(sys.argv[1], 'w')"
    run = subprocess.run([python, "-c", probe, str(tmp_path / "results.json")],
                         user=user[0], group=user[1], extra_groups=[], capture_output=True, text=True)
    assert run.returncode != 0 and "PermissionError" in run.stderr


# ---------------------------------------------------------------- containment (the worker as another user)

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the worker runs as another user, contained, only when "
                             "the grader runs as root (as on Gradescope)")


def stub_with(bundle: Path, tmp_path: Path, code: str) -> Path:
    """A fresh copy's packages whose l1_contiguous/__init__.py (imported by every test) runs `code`."""
    init = "l1_contiguous/__init__.py"
    text = (bundle / "source" / init).read_text()
    return submit(tmp_path, bundle / "source", edits={init: (text, text + "\n" + code)})


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def note_of(marker: Path) -> str:
    return marker.read_text() if marker.exists() else ""


DAEMON = """
import os as _os, re as _re, time as _time
if not _os.environ.get("_DAEMON_STARTED"):
    _os.environ["_DAEMON_STARTED"] = "1"
    _worker = _os.getpid()
    if _os.fork() == 0:
        _os.setsid()
        if _os.fork() == 0:  # detached: outlives the worker, then reports every test as passed on every
            open(MARKER, "w").write(str(_os.getpid()))  # descriptor it holds (a pipe to the grader?)
            _names = _re.findall(r"^def (test_\\w+)", open("tests/test_l2_allocator.py").read(), _re.M)
            while _os.path.exists(f"/proc/{_worker}"):
                _time.sleep(0.01)
            for _fd in range(3, 256):
                for _name in _names:
                    for _when in ("setup", "call", "teardown"):
                        try:
                            _os.write(_fd, ('{"nodeid": "tests/test_l2_allocator.py::%s", "when": "%s", "outcome": '
                                            '"passed", "output": ""}\\n' % (_name, _when)).encode())
                        except OSError:
                            pass
            _time.sleep(3600)
        _os._exit(0)
"""


REWRITE_TESTS = """
import pathlib as _pathlib
for _path in _pathlib.Path("tests").glob("test_*.py"):  # every test rewritten to pass
    try:
        _path.write_text("def test_nothing():\\n    pass\\n")
        open(MARKER, "a").write(f"rewrote {_path}\\n")
    except OSError as _exc:
        open(MARKER, "a").write(f"{type(_exc).__name__}\\n")
"""


# Issue 52: transformers (HF's Qwen3, the oracle) and the harness's oracle module were importable
# in the worker, reached without an import statement.
ORACLE = """
import importlib as _importlib
for _name in ("transformers", "harness.hf_reference"):
    try:
        _importlib.import_module(_name)
        open(MARKER, "a").write(f"imported {_name} ")
    except ImportError as _exc:
        open(MARKER, "a").write(f"{type(_exc).__name__} ")
open(MARKER, "a").write("\\n")
"""


FORK_BOMB = """
import os as _os, time as _time
if not _os.environ.get("_BOMB_STARTED"):
    _os.environ["_BOMB_STARTED"] = "1"
    if _os.fork() == 0:
        _os.setsid()
        _started = _time.monotonic()
        while _time.monotonic() - _started < 600:  # every child forks on too, until the process limit
            try:
                if _os.fork() == 0:
                    open(MARKER, "a").write(f"{_os.getpid()}\\n")
            except OSError:
                _time.sleep(0.01)
        _os._exit(0)
"""
MEMORY_HOG = """
import os as _os
if not _os.environ.get("_HOG_STARTED"):
    _os.environ["_HOG_STARTED"] = "1"
    try:
        _hog = b"x" * (6 << 30)  # 6 GiB, written: more than the 4 GiB the grader allows a process here
        open(MARKER, "w").write("allocated")
    except MemoryError:
        open(MARKER, "w").write("MemoryError")
"""
KILL_GRADER = """
import os as _os, signal as _signal
if _os.geteuid() != 0:  # (never as root: a broken containment must not kill the machine's processes)
    try:
        _os.kill(_os.getppid(), _signal.SIGKILL)  # the grader that started this worker
        open(MARKER, "w").write("killed the grader")
    except PermissionError:
        open(MARKER, "w").write("PermissionError")
else:
    open(MARKER, "w").write("ran as root")
"""


@as_root
def test_attacks_on_the_machine_and_the_reports_are_contained_and_earn_nothing(bundle, tmp_path, request):
    """One stub whose import runs every attack, each noting what happened in its own file: a
    detached process that reports every test as passed once the worker has ended, a rewrite of the
    tests, a kill of the grader, a 6 GiB allocation (the limit is 4 GiB here) and a fork bomb. The
    stub's honest score is 0, and so is this one's; nothing the attacks started is left."""
    notes = Path(tempfile.mkdtemp(prefix="attacks-"))  # under /tmp: the worker's user writes its notes here
    request.addfinalizer(lambda: shutil.rmtree(notes, ignore_errors=True))
    notes.chmod(0o777)
    attacks = {"daemon": DAEMON, "rewrite": REWRITE_TESTS, "kill": KILL_GRADER, "hog": MEMORY_HOG, "bomb": FORK_BOMB,
               "oracle": ORACLE}
    code = "\n".join(attack.replace("MARKER", repr(str(notes / name))) for name, attack in attacks.items())
    results = run_bundle(bundle, stub_with(bundle, tmp_path, code), tmp_path, memory_mb=4096)
    assert results["score"] == 0 and results["tests"], [t["name"] for t in results["tests"] if t["score"]]
    judge, worker = USERS["AUTOGRADER_JUDGE_USER"], USERS["AUTOGRADER_WORKER_USER"]
    assert f"the judged tests run as {judge} (uid" in results["log"] and f"the student's code as {worker}" in results["log"]
    daemon = int(note_of(notes / "daemon") or 0)
    assert daemon, "the daemon never started: " + results["log"][-2000:]
    assert not alive(daemon), "a process the student's code detached outlived the grading"
    rewrite = note_of(notes / "rewrite")
    assert "rewrote" not in rewrite, rewrite[:500]  # the worker's copy holds no test to rewrite
    oracle = note_of(notes / "oracle").split()  # a line per worker that imported the stub
    assert oracle and set(oracle) == {"ModuleNotFoundError"}, oracle
    assert note_of(notes / "kill") == "PermissionError"
    assert note_of(notes / "hog") == "MemoryError"
    bombs = [int(line) for line in note_of(notes / "bomb").split()]
    assert len(bombs) > 10, "the fork bomb never forked"
    assert not [pid for pid in bombs if alive(pid)], "processes of the fork bomb outlived the grading"


def test_the_bundle_grades_no_notebook_and_no_test_that_may_skip(bundle):
    """Issue 52: a notebook's cells run in a kernel that is the student's code (an input transformer
    installed from a package replaced every later cell), so its verdict cannot be trusted: the
    bundle's manifest holds no notebook, and no gpu test (the grader has no GPU; a skipped test
    earns nothing there)."""
    manifest = json.loads((bundle / "source" / "grading_manifest.json").read_text())
    assert not [n for n in manifest["tests"] if "test_notebooks.py" in n]
    assert not [n for n, t in manifest["tests"].items() if "gpu" in t.get("keywords", [])]
    grade = load_script_at(bundle / "source" / "grade.py")
    assert not hasattr(grade, "worker_kernel_file"), "the grader still writes a kernel's connection file as root"


def test_symlinks_devices_and_oversized_files_in_the_upload_are_skipped_and_named(bundle, tmp_path):
    submission = submit(tmp_path, ROOT)
    package = submission / "my-work" / "l1_contiguous"
    (package / "zeros.py").symlink_to("/dev/zero")
    (package / "passwords").symlink_to("/etc/shadow")
    (package / "blob.bin").write_bytes(b"\0" * (2 << 20))
    os.mkfifo(package / "pipe")
    (package / "everything").symlink_to("/")  # a folder link: walking it would read the whole machine
    results = run_bundle(bundle, submission, tmp_path)
    assert "skipped from the upload: l1_contiguous/everything (a symlink)" in results["output"]
    for name in ("zeros.py", "passwords", "pipe"):
        assert f"skipped from the upload: l1_contiguous/{name} (not a regular file)" in results["output"], name
    assert "skipped from the upload: l1_contiguous/blob.bin (2097152 bytes" in results["output"]
    assert results["score"] == sum(t["max_score"] for t in results["tests"]) > 0  # the rest graded as usual


LEAK = """
import glob as _glob
_hidden = "".join(open(_path).read() for _path in _glob.glob("tests/*.py") if "hidden" in _path)
if _hidden:  # every test that imports this fails with the hidden tests' source in its output
    raise ImportError("LEAK " + _hidden)
"""


def test_a_hidden_test_files_source_never_reaches_a_visible_output(bundle, tmp_path):
    """Judged, the hidden file is in the grader's tree only, closed to the worker while it runs."""
    results = run_bundle(bundle, stub_with(bundle, tmp_path, LEAK), tmp_path, select=f"{FAST} tests/{HIDDEN_FILE}")
    visible = [t for t in results["tests"] if t["visibility"] == "visible"]
    hidden = [t for t in results["tests"] if t["name"].startswith(f"tests/{HIDDEN_FILE}")]
    assert visible and hidden and all(t["visibility"] == "after_published" for t in hidden)
    # Judged, the hidden file is in the grader's tree only: the worker cannot read it even while it runs.
    assert not [t["name"] for t in results["tests"] if "LEAK" in t["output"]]
    assert "test_two_blocks_come_back_in_the_free_list" not in results["output"] + results["log"]


def test_the_bundles_own_folder_is_out_of_the_workers_reach(bundle, tmp_path):
    """The submission knows where the bundle lives (on Gradescope always /autograder/source) and
    reads the hidden tests and the manifest from there by absolute path. Their files are readable
    by anyone; only the folder, root's and closed (0700) while the parts run, keeps them out."""
    if os.geteuid() != 0:
        pytest.skip("the worker runs as another user only when the grader runs as root")
    open_root = Path(tempfile.mkdtemp(prefix="autograder-open-"))  # pytest's own tmp folders are root-only
    os.chmod(open_root, 0o755)
    bundle = Path(shutil.copytree(bundle, open_root / "bundle", symlinks=True))
    hidden, manifest = bundle / "source" / "tests" / HIDDEN_FILE, bundle / "source" / "grading_manifest.json"
    assert hidden.stat().st_mode & 0o004 and manifest.stat().st_mode & 0o004  # the files themselves are open
    assert all(folder.stat().st_mode & 0o001 for folder in (bundle / "source").parents)  # and reachable
    peek = f"""
import pathlib as _p
_found = ""
for _path in ({str(hidden)!r}, {str(manifest)!r}):
    try:
        _found += _p.Path(_path).read_text()
    except OSError:
        pass
if _found:
    raise ImportError("LEAK " + _found[:2000])
"""
    results = run_bundle(bundle, stub_with(bundle, tmp_path, peek), tmp_path, select=f"{FAST} tests/{HIDDEN_FILE}")
    assert results["tests"] and not [t["name"] for t in results["tests"] if "LEAK" in t["output"]]
    assert "LEAK" not in results["log"]
    assert (bundle / "source").stat().st_mode & 0o777 != 0o700  # given back as it was after grading
    shutil.rmtree(open_root)


def test_flags_name_only_changed_code_that_only_a_cheat_needs(bundle, tmp_path):
    untouched = run_bundle(bundle, submit(tmp_path / "a", bundle / "source"), tmp_path / "a")
    assert untouched["extra_data"]["flags"] == [] and "FLAG" not in untouched["log"]
    comment = "# the harness and the grading plugin are not used here; nor is inspect\nNOTE = 'import transformers'\n"
    split = "import importlib as _il\n_plugin = _il.import_module('har' 'ness.grad' 'ing')\n"
    results = run_bundle(bundle, stub_with(bundle, tmp_path / "b", comment + split), tmp_path / "b")
    assert results["extra_data"]["flags"] == ["l1_contiguous/__init__.py: dynamic imports"], results["extra_data"]
    assert "FLAG for the instructor: l1_contiguous/__init__.py: dynamic imports" in results["log"]


@pytest.mark.timeout(1800)  # two judged gradings of L1's files: about a minute here
@as_root
def test_a_path_the_students_code_names_is_never_read_for_it(bundle, tmp_path):
    """Issue 52: a judged test globbed `Path(l1_contiguous.__file__).parent` and parsed what it found
    as root; a planted symlink put /etc/shadow into the student's output. The tests now take the
    package's folder from the grader, and the judge runs as a user of its own, which cannot read
    /etc/shadow either."""
    planted = Path(tempfile.mkdtemp(prefix="planted-"))
    planted.chmod(0o755)
    (planted / "leak.py").symlink_to("/etc/shadow")
    code = f"__file__ = {str(planted / '__init__.py')!r}\n"
    select = "tests/test_l1_model.py::test_l1_matches_hf_with_transformers_unimportable"
    try:
        results = run_bundle(bundle, stub_with(bundle, tmp_path, code), tmp_path, select=select)
    finally:
        shutil.rmtree(planted, ignore_errors=True)
    assert results["score"] == 0 and results["tests"]
    first_line = Path("/etc/shadow").read_text().splitlines()[0]
    everything = results["log"] + json.dumps(results["tests"]) + results["output"]
    assert first_line not in everything and "leak.py" not in everything, "the planted path was read"


def earned_with_greedy_generate(bundle: Path, tmp_path: Path, bodies: dict[str, str]) -> dict[str, dict]:
    """{name: {test: score earned}} of L1's tests with greedy_generate's fenced region replaced by
    each body in turn, the rest of L1 finished."""
    text = (ROOT / "l1_contiguous" / "generate.py").read_text()
    start, end = text.index("    # BEGIN SOLUTION\n"), text.index("    # END SOLUTION\n")
    earned = {}
    for name, body in bodies.items():
        edits = {"l1_contiguous/generate.py": (text[start:end], "    # BEGIN SOLUTION\n" + body)}
        results = run_bundle(bundle, submit(tmp_path / name, ROOT, edits=edits), tmp_path / name,
                             select="tests/test_l1_model.py tests/test_l1_smoke.py")
        assert results["tests"] and "== judged tests:" in results["log"]
        earned[name] = {t["name"]: t["score"] for t in results["tests"] if t["score"] > 0}
    return earned


def test_greedy_generate_through_transformers_earns_what_the_stub_under_it_earns(bundle, tmp_path):
    """The HF shortcut: L1 done but greedy_generate answered by transformers' own generate, in the
    worker, where the student's code runs. It earns no test that a stub greedy_generate does not."""
    from test_course_grading import HF_GENERATE, STUB

    earned = earned_with_greedy_generate(bundle, tmp_path, {"stub": STUB, "hf": HF_GENERATE})
    assert earned["stub"], "a stub greedy_generate under a finished L1 should still earn its other functions' tests"
    gained = sorted(set(earned["hf"]) - set(earned["stub"]))
    assert not gained, f"these pay for a greedy_generate that does not use the cache: {gained}"


def forged_lengths(recompute: str) -> str:
    """Issue 52: the cache-less decode `recompute`, telling torch's global forward hooks (the probe
    that watches forward lengths lives in the worker) the lengths a cached run would show."""
    forward = "        logits = forward_step(model, ContiguousKvCache(model.config, len(seq), model.dtype, model.device), seq)\n"
    assert forward in recompute
    forged = ("        _module._global_forward_pre_hooks.clear()\n" + forward
              + "        _module._global_forward_pre_hooks.update(_hooks)\n"
              + "        for _hook in _hooks.values():\n"
              + "            _hook(model, (torch.zeros(1, _fake, dtype=torch.long),))\n"
              + "        _fake = 1\n")
    return ("    import torch.nn.modules.module as _module\n"
            "    _hooks, _fake = dict(_module._global_forward_pre_hooks), len(prompt_ids)\n"
            + recompute.replace(forward, forged))


def test_forging_what_a_probe_sees_earns_nothing_over_the_same_code_not_forging(bundle, tmp_path):
    """Issue 52: a cache-less greedy_generate that tells the worker-side probe the forward lengths a
    cached run would show earned 44/47 (16 honestly). The tests that pay for the cache now check the
    K/V the cache holds after the run against HF's, in the judge: forging the probe gains nothing."""
    from test_course_grading import RECOMPUTE

    earned = earned_with_greedy_generate(bundle, tmp_path, {"honest": RECOMPUTE, "forged": forged_lengths(RECOMPUTE)})
    gained = sorted(set(earned["forged"]) - set(earned["honest"]))
    assert not gained, f"these pay for forged forward lengths: {gained}"
    print(f"cache-less greedy_generate: {sum(earned['honest'].values()):g} points honest, "
          f"{sum(earned['forged'].values()):g} with the probe forged")


def load_script_at(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- everything


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_the_whole_grade_fresh_copy_0_solution_full_l1_l2_exactly_theirs(bundle, tmp_path):
    fresh = run_bundle(bundle, submit(tmp_path / "fresh", bundle / "source"), tmp_path / "fresh", select=None)
    solution = run_bundle(bundle, submit(tmp_path / "solution", ROOT), tmp_path / "solution", select=None)
    check_fresh_and_solution(fresh, solution)
    copy = tmp_path / "l1-l2"
    assert load_script("make_student_copy").main([str(copy), "--keep", "L1,L2"]) == 0
    half = run_bundle(bundle, submit(tmp_path / "half", copy), tmp_path / "half", select=None)
    for t in half["tests"]:
        expected = t["max_score"] if t["tags"][0] in ("l1", "l2") else 0
        assert t["score"] == expected, (t["name"], t["output"][-1000:])
    print({name: round(r["seconds"]) for name, r in (("fresh", fresh), ("solution", solution), ("l1+l2", half))})


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_setup_sh_makes_an_environment_without_system_packages_that_grades(bundle, tmp_path):
    """setup.sh as Gradescope runs it, in a temporary root: a clean virtual environment (no system
    site packages) with the pinned dependencies, which then grades a solution whose l1 package
    tries to rewrite results.json at exit. Here PyPI is reachable but PyTorch's CPU index is not:
    pip takes torch 2.13.0 from the machine's local wheel folder (pip's find-links), as it would
    take it from the index on Gradescope. As root, with a system Python outside root's home, the
    worker runs as the unprivileged user, as on Gradescope."""
    base = Path(tempfile.mkdtemp(prefix="autograder-setup-"))  # under /tmp, open to the worker user
    base.chmod(0o755)
    root, path = base / "autograder", os.environ["PATH"]
    shutil.copytree(bundle / "source", root / "source")
    system_python = shutil.which("python3.11", path="/usr/bin")
    if os.geteuid() == 0 and system_python:
        (base / "bin").mkdir()
        (base / "bin" / "python3").symlink_to(system_python)
        path = f"{base / 'bin'}:{path}"
    try:
        run = subprocess.run(["bash", str(root / "source" / "setup.sh")], capture_output=True, text=True,
                             env={**os.environ, "AUTOGRADER_ROOT": str(root), "PATH": path}, timeout=3000)
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        python = root / "venv" / "bin" / "python"
        assert "include-system-site-packages = false" in (root / "venv" / "pyvenv.cfg").read_text()
        versions = subprocess.run([str(python), "-c", "import sys, torch, transformers, pytest_timeout; "
                                   "print(sys.version_info >= (3, 11), torch.__version__, transformers.__version__)"],
                                  capture_output=True, text=True, check=True).stdout.split()
        assert versions[0] == "True" and versions[1].startswith("2.13.0") and versions[2].startswith("5.2"), versions
        results = root / "results" / "results.json"
        init = "l1_contiguous/__init__.py"
        text = (ROOT / init).read_text()
        # The atexit cheat aimed at results.json only (rewriting the worker's own report costs it its score).
        cheat = text + ATEXIT_REWRITE.replace('"/autograder/results/results.json",', f'"{results}",').replace(
            ', *glob.glob(os.path.expanduser("~/*.jsonl"))', '')
        env = {**os.environ, **USERS, "AUTOGRADER_ROOT": str(root), "AUTOGRADER_SELECT": FAST,
               "AUTOGRADER_SUBMISSION": str(submit(base, ROOT, edits={init: (text, cheat)}))}
        env.pop("PYTHONPATH", None)
        log = subprocess.run([str(root / "source" / "run_autograder")], env=env, capture_output=True, text=True,
                             timeout=900, check=True).stdout
        graded = json.loads(results.read_text())
        assert graded["score"] == sum(t["max_score"] for t in graded["tests"]) > 0, log[-3000:]
        if "note: the worker runs as the current user" not in log:  # it ran as its own user
            assert "FLAG for the instructor: l1_contiguous/__init__.py: atexit" in log
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_canary_never_run_is_a_forgery_sign_only_where_the_worker_writes_the_reports():
    """In a worker's own pytest a missing canary after passed tests means its report was cut; a
    judged part's reports come from the grader's pytest, and a canary is missing there when the
    last round's worker died (its code killed it, say): not a forgery, and no reason to score 0."""
    grade = load_script_at(ROOT / "instructor" / "autograder" / "grade.py")
    first, last = "tests/test_a0.py::test_a0_matches", "tests/test_z0.py::test_z0_matches"
    for judged in (False, True):
        part = grade.Part("tests", ["tests/test_x.py"], judged=judged)
        part.canaries, part.status = [first, last], 4
        part.outcomes = {first: {"setup": "passed", "call": "failed"},
                         "tests/test_x.py::test_one": {"setup": "passed", "call": "passed", "teardown": "passed"}}
        assert part.forged() == ([] if judged else [last])
        part.outcomes[last] = {"setup": "passed", "call": "passed"}
        assert part.forged() == [last]  # reported passed: forged wherever the report came from


def test_the_short_parts_run_first_and_the_run_stops_before_gradescope_does():
    """A run cut off by its time limit loses the tail of the long judged part, never the hidden
    tests wholesale; the default limit ends the run before
    Gradescope's longest timeout (40 minutes), after which nothing the run did is shown."""
    grade = load_script_at(ROOT / "instructor" / "autograder" / "grade.py")
    manifest = {"tests": {"tests/test_l1_model.py::test_a": {"lesson": "l1"},
                          "tests/test_l1_hidden.py::test_h": {"lesson": "l1"},
                          "tests/test_x_unjudged.py::test_u": {"lesson": "l99"}},
                "hidden_files": ["tests/test_l1_hidden.py"]}
    parts = grade.split_parts(manifest, [])
    assert [p.name for p in parts] == ["judged hidden tests", "judged tests", "tests"]
    assert grade.DEFAULT_TIME_LIMIT_S < 40 * 60
