"""Grade one submission on Gradescope: the parent process that run_autograder starts.

It never imports the student's code (only the standard library is used here) and it alone writes
results.json:

1. The lesson packages are found in the upload (a few folders down, the shallowest match, never
   under `__MACOSX/` or a hidden folder, only folders with an `__init__.py`) and replace the stubs
   in a scratch copy of the bundle. Only regular files up to MAX_UPLOAD_FILE bytes are copied:
   symlinks, devices, pipes and bigger files are skipped, never followed, and named. Which
   packages were graded, which were not found and which files were skipped goes into results.json's
   top-level `output`, which the student sees.
2. The tests run in parts, the short ones first: the hidden test files (instructor/hidden_tests/),
   which are in a scratch tree only during their own part, so no visible output can carry their
   source, then the judged tests and the other visible tests. No notebook is graded (the manifest
   leaves them out): a notebook's verdict would come from a kernel that runs the student's code.
   Each part has two planted canary tests with random names, which must fail. A part runs until
   its tests end or the whole run's time limit is reached; a run cut off by it loses only the
   tests not yet run (the tail of the long part), each reported as not run and why.
3. Judged parts (the lessons in JUDGED_LESSONS): pytest runs as the judge's own user
   (AUTOGRADER_JUDGE_USER, never root), in a tree of the bundle's own files that the worker cannot
   read (hidden tests included), with KVCOURSE_JUDGE set (harness/judge.py): it never imports the
   student's packages. They run in a worker this file starts for each pytest run, as the worker's
   user, in the scratch copy of the upload, on two pipes the judge inherits; the worker answers
   with plain data only, and every assertion, every comparison, the HF oracle and the reports stay
   with the judge. A test stopped by its time limit while the student's code ran stops that
   pytest and this file stops its worker; the tests not yet run go on with a new pair.
4. Other parts: pytest itself runs in the worker, as the unprivileged user, tests and student code
   in one process (the lessons not in JUDGED_LESSONS; today none).
5. The worker runs as the unprivileged user (always, when this runs as root, as on Gradescope:
   if that is impossible nothing is run and the instructor is told), in its own session, with
   limits on memory, processes, file size and core dumps, and with a python of its own
   (`worker_environment`): only the lessons' dependencies, never transformers. The scratch copy
   (lesson packages, the harness's helpers, the tests' probes; no test, no oracle) is the
   grader's and read-only to the worker, which writes only in its own home folder. When the part
   ends, every process of that user is killed, wherever it moved. Root itself acts only on
   folders it made, in a scratch folder of its own, and on the bundle.
6. Outcomes come test by test through a pipe (the grading plugin's `--outcomes-log`); the first
   report of each test phase counts, so nothing written later can change it. Points come from the
   manifest collected from the bundle's own copy when it was built, never from the worker. A canary
   reported as passed means the reports were forged: the submission gets 0 and is flagged.
7. Each test's time limit is AUTOGRADER_TEST_TIMEOUT times the machine's measured slowdown (a fixed
   workload timed before grading, against its time on an idle machine), so a loaded machine does
   not fail tests that an idle one passes.
8. Flags for the instructor (results.json's `extra_data`, and the log): in submitted files that
   differ from the handout, uses of what only code working against the grader needs, counted in
   the code with comments and strings removed, beyond what the handout's file already has.

What this does not stop: in the parts that are not judged, code that runs in the worker can forge
that worker's reports of anything but the canaries, patch comparisons, or read a test's source;
the flags and a look at flagged submissions are the defence there. In judged parts it can change
only what its own functions return.

Settings (environment): AUTOGRADER_ROOT (/autograder), AUTOGRADER_SOURCE ($ROOT/source),
AUTOGRADER_SUBMISSION ($ROOT/submission), AUTOGRADER_RESULTS ($ROOT/results/results.json),
AUTOGRADER_PYTHON (the python that runs pytest, as the judge's user: `python_for` gives that user
a system python over its packages where it cannot run it, as under /root; the worker's own is
made from it by `worker_environment`), AUTOGRADER_TIME_LIMIT (seconds for all parts
together, default 2280: below Gradescope's longest assignment timeout, 40 minutes, so that what
finished is written before the platform stops the run), AUTOGRADER_TEST_TIMEOUT (seconds per
test on an idle machine, default 180), AUTOGRADER_MEMORY_MB (address space per worker process,
default 8192), AUTOGRADER_WORKER_PYTHON (a worker environment `worker_environment` made before, for
this worker user: reused instead of made again; the instructor's setting, never the student's),
AUTOGRADER_JUDGE_PYTHON (likewise the judge's python, as `python_for` made it for this judge user),
AUTOGRADER_SELECT (node-id prefixes: grade only those tests, to try the bundle on
a part), AUTOGRADER_PYTEST_ARGS,
AUTOGRADER_WORKER_USER (default autograder-student) and AUTOGRADER_JUDGE_USER (default
autograder-judge); when not run as root both run as the current user, without that separation,
which is only for trying the bundle locally.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import resource
import shlex
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tokenize
from pathlib import Path

WORKER_USER = os.environ.get("AUTOGRADER_WORKER_USER", "autograder-student")
JUDGE_USER = os.environ.get("AUTOGRADER_JUDGE_USER", "autograder-judge")
LOG_CAP = 20_000  # characters of the worker's output kept at each end
OUTPUT_CAP = 4_000  # characters of one test's output in results.json, at both ends together
MAX_OUTCOME_LINES = 100_000  # a worker that floods the pipe is cut off here
SEARCH_DEPTH = 4  # folders below the upload's root searched for a lesson package
MAX_UPLOAD_FILE = 1 << 20  # bytes: a lesson package holds source files, far smaller than this
MAX_PROCESSES = 512  # the worker user's processes and threads together (torch starts one per core)
MAX_FILE_BYTES = 1 << 30  # the largest file a worker process may write
# The calibration workload and its median time on an idle 2-core machine of the course's kind.
CALIBRATION_REFERENCE_S = 0.11
MAX_SLOWDOWN = 8.0
# Gradescope stops an assignment's run after its timeout, at most 40 minutes, and then shows nothing:
# the runner stops two minutes before, so the tests that finished still count.
DEFAULT_TIME_LIMIT_S = 38 * 60
# Lessons whose graded tests run judged (harness/judge.py): pytest, the tests and the HF oracle in
# the grader's own process and a tree the worker cannot read; the student's code in a worker
# process, as the unprivileged user, answering with plain data.
JUDGED_LESSONS = ("l1", "l2", "l3", "l4", "l5", "l8", "l10", "l11", "l12", "l13", "l14")
MAX_JUDGED_ROUNDS = 50  # a judged part restarted after a test its time limit stopped, at most this often
# Only code that works against the grader needs these in a lesson package.
SUSPICIOUS = {
    "transformers": r"\b(import|from)\s+transformers\b",
    "the grading plugin": r"\bgrading\b|\bharness\b",
    "pytest internals": r"\b_?pytest\b",
    "atexit": r"\batexit\b",
    "inspect": r"\binspect\b",
    "frame access": r"_getframe|\bf_back\b|\bf_locals\b|\bf_globals\b|\bsettrace\b|\bsetprofile\b|get_referrers",
    "dynamic imports": r"\b__import__\b|\bimportlib\b|\bsys\s*\.\s*modules\b",
    "exec or eval": r"\bexec\b|\beval\b|\bcompile\s*\(",
    "new processes": r"\bsubprocess\b|\bfork\b|\bsetsid\b|\bsystem\s*\(|\bmultiprocessing\b|\bPopen\b",
    "builtins": r"\bbuiltins\b|__builtins__",
}


class Refused(Exception):
    """The student's code cannot be run safely here: nothing is graded, the instructor is told."""


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


def copy_package(folder: Path, dest: Path) -> list[str]:
    """Copy the regular files of an uploaded package, each at most MAX_UPLOAD_FILE bytes; return
    what was skipped (symlinks, devices, pipes, bigger files), which is never opened or followed."""
    skipped = []
    for here, subfolders, files in os.walk(folder):  # os.walk never follows a symlinked folder
        rel = Path(here).relative_to(folder)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in subfolders:
            if Path(here, name).is_symlink():
                skipped.append(f"{folder.name}/{rel / name} (a symlink)")
        subfolders[:] = [d for d in subfolders if d != "__pycache__" and not Path(here, d).is_symlink()]
        for name in files:
            source = Path(here, name)
            info = source.lstat()
            if not stat.S_ISREG(info.st_mode):
                skipped.append(f"{folder.name}/{rel / name} (not a regular file)")
            elif info.st_size > MAX_UPLOAD_FILE:
                skipped.append(f"{folder.name}/{rel / name} ({info.st_size} bytes; at most {MAX_UPLOAD_FILE})")
            else:
                with open(source, "rb") as src, open(dest / rel / name, "wb") as out:
                    shutil.copyfileobj(src, out)
    return skipped


def code_of(text: str) -> str:
    """Python source without comments and string literals (what flags are matched against)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return text
    kept = [t.string for t in tokens if t.type not in (tokenize.COMMENT, tokenize.STRING)
            and t.type != getattr(tokenize, "FSTRING_MIDDLE", -1)]
    return " ".join(kept)


def flags_of(packages: list[str], copy: Path, handout: Path) -> list[str]:
    """`file: what it uses` for each submitted file (as copied: regular files only) that differs from
    the handout's and uses, more often than the handout's own file, something only code working
    against the grader needs."""
    flags = []
    for package in packages:
        folder = copy / package
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            code = code_of(path.read_text(encoding="utf-8", errors="replace"))
            original = handout / package / rel
            before = code_of(original.read_text(encoding="utf-8")) if original.is_file() else ""
            if code == before:
                continue
            used = [what for what, pattern in SUSPICIOUS.items()
                    if len(re.findall(pattern, code)) > len(re.findall(pattern, before))]
            if used:
                flags.append(f"{package}/{rel}: {', '.join(used)}")
    return flags


def plant_canaries(tests_dir: Path, lesson: str) -> list[str]:
    """Two tests that must fail, with random names: one collected first, one last."""
    rng = random.SystemRandom()
    nodeids = []
    for prefix in ("test_a", "test_z"):
        name = f"{prefix}{rng.randrange(16**10):010x}"
        value = rng.randrange(10**6)
        fd = os.open(tests_dir / f"{name}.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as canary:
            canary.write("import pytest\n\n\n"
                         f"@pytest.mark.{lesson}\n@pytest.mark.points(1)\n"
                         f"def {name}_matches():\n    value = {value}\n    assert value == {value + 1}\n")
        nodeids.append(f"tests/{name}.py::{name}_matches")
    return nodeids


def unprivileged_user(name: str, setting: str) -> tuple[int, int] | None:
    """(uid, gid) of the unprivileged user `name`, created if needed; None when this process is not
    root (a local try: everything runs as the current user). As root, Refused when there is no such
    user: neither the student's code nor the judge ever runs as root."""
    if os.geteuid() != 0:
        return None
    if not name or name == "root":
        raise Refused(f"{setting} names no unprivileged user; as root the grader runs the tests only as one "
                      "(leave it unset for the default)")
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise Refused(f"cannot create the user {name}: {made.stderr.strip()}") from None
        entry = pwd.getpwnam(name)
    if entry.pw_uid == 0:
        raise Refused(f"{name} has uid 0; {setting} needs an unprivileged user")
    return entry.pw_uid, entry.pw_gid


def worker_user() -> tuple[int, int] | None:
    """The user the student's code runs as."""
    return unprivileged_user(WORKER_USER, "AUTOGRADER_WORKER_USER")


def judge_user() -> tuple[int, int] | None:
    """The user the judged tests' pytest (the HF oracle, every assertion) runs as: neither root nor
    the worker, so that a path the student's code names or plants is never opened with more rights
    than a user who may read the bundle has."""
    return unprivileged_user(JUDGE_USER, "AUTOGRADER_JUDGE_USER")


def can_run_as(user: tuple[int, int], python: str, code: str = "import pytest, torch") -> bool:
    try:
        probe = subprocess.run([python, "-c", code], user=user[0], group=user[1],
                               extra_groups=[], capture_output=True, cwd="/", timeout=300)
    except (OSError, subprocess.TimeoutExpired):  # e.g. the python lies under a folder only root may enter
        return False
    return probe.returncode == 0


def runnable_interpreter(user, candidates: list[str], version: str) -> str:
    """The first of `candidates` (then the system's python `version`) that `user` can run; Refused
    when none is (a python under /root, where pyenv and conda put root's: mode 0700)."""
    system = [f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    found = next((c for c in [*candidates, *system] if user is None or can_run_as(user, c, "import venv")), None)
    if found is None:
        raise Refused(f"the user {user[0]} cannot run {candidates[0]} (it lies in a folder that user cannot enter, "
                      f"such as /root), and there is no /usr/bin/python{version} it can run in its place; give "
                      "AUTOGRADER_PYTHON a python outside /root (setup.sh's /autograder/venv is one)")
    return found


def python_for(python: str, user, work: Path, name: str) -> str:
    """The python `user` runs: `python` where that user can run it. Otherwise (as root with a python
    under /root, where pyenv and conda put root's: mode 0700) a venv made in `work` from a system
    python of the same version that the user can run, which sees `python`'s packages through a
    .pth file. Refused when the user cannot read those packages either."""
    if user is None or can_run_as(user, python):
        return python
    facts = json.loads(subprocess.run(
        [python, "-I", "-c", "import json, sys; print(json.dumps([f'{sys.version_info[0]}.{sys.version_info[1]}', "
                             "[p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]]))"],
        capture_output=True, text=True, check=True).stdout)
    version, site_dirs = facts[0], [d for d in facts[1] if os.path.isdir(d)]
    system = runnable_interpreter(user, [], version)
    env = work / name
    subprocess.run([system, "-m", "venv", "--without-pip", str(env)], check=True, capture_output=True)
    (site_packages,) = env.glob("lib/python*/site-packages")
    (site_packages / "course_env.pth").write_text("".join(f"{d}\n" for d in site_dirs))
    for here, _, files in os.walk(env):
        os.chmod(here, 0o755)
    readable = f"import os; [os.listdir(d) for d in {site_dirs!r}]; import pytest, torch"
    if not can_run_as(user, str(env / "bin" / "python"), readable):
        raise Refused(f"the user {user[0]} cannot run {python}, and it cannot read that python's packages ({', '.join(site_dirs)}) either; make "
                      "the environment where other users can read it (`make setup` makes a self-contained .venv "
                      "unless the system's python has torch already)")
    return str(env / "bin" / "python")


# What the student's code may import in the worker: the lessons' own dependencies and theirs, never
# the oracle (transformers, which holds HF's Qwen3) nor the grader's tools. Each is linked into the
# worker's own environment from the grader's, whose folder the worker never needs to read.
WORKER_DISTRIBUTIONS = ("torch", "numpy", "safetensors", "tokenizers", "jinja2", "starlette", "uvicorn",
                        "prometheus_client")
NEVER_IN_THE_WORKER = ("transformers",)
_DISTRIBUTION_FILES = """
import importlib.metadata as m, json, re, sys
wanted, never, files, seen = sys.argv[1].split(","), set(sys.argv[2].split(",")), [], set()
def name(requirement):
    return re.split(r"[ ;<>=!~\\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
while wanted:
    dist_name = wanted.pop().lower().replace("_", "-")
    if dist_name in seen or dist_name in never:
        continue
    seen.add(dist_name)
    try:
        dist = m.distribution(dist_name)
    except m.PackageNotFoundError:
        continue
    wanted += [name(r) for r in dist.requires or [] if "extra ==" not in r]
    files += [str(dist.locate_file(f)) for f in dist.files or []]
print(json.dumps({"version": f"{sys.version_info[0]}.{sys.version_info[1]}", "files": files,
                  "site": [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]}))
"""


def worker_environment(python: str, user, work: Path) -> str:
    """The python the student's code runs: a venv of its own in `work`, made from `python`'s
    interpreter (or, where the worker's user cannot run that, as under /root, a system python of
    the same version), holding only WORKER_DISTRIBUTIONS and what they require, hard-linked (or
    copied) from `python`'s environment. So transformers, and with it HF's Qwen3, is nowhere on
    the worker's path: the worker cannot compute the oracle's answers, whatever it imports."""
    facts = json.loads(subprocess.run(
        [python, "-I", "-c", _DISTRIBUTION_FILES, ",".join(WORKER_DISTRIBUTIONS), ",".join(NEVER_IN_THE_WORKER)],
        capture_output=True, text=True, check=True).stdout)
    base = subprocess.run([python, "-I", "-c", "import sys; print(getattr(sys, '_base_executable', sys.executable))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    interpreter = runnable_interpreter(user, [base], facts["version"])
    env = work / "worker-python"
    subprocess.run([interpreter, "-m", "venv", "--without-pip", str(env)], check=True, capture_output=True)
    (site_packages,) = env.glob("lib/python*/site-packages")
    homes = tuple(os.path.join(s, "") for s in facts["site"])
    made = set()
    for source in facts["files"]:
        home = next((h for h in homes if source.startswith(h)), None)
        if home is None or not os.path.isfile(source):  # a script in bin/, say: not needed to import
            continue
        target = os.path.join(site_packages, source[len(home):])
        folder = os.path.dirname(target)
        if folder not in made:
            os.makedirs(folder, exist_ok=True)
            made.add(folder)
        try:
            os.link(source, target)
        except FileExistsError:  # two distributions that list one file
            pass
        except OSError:  # another file system
            shutil.copy2(source, target)
    for here, _, files in os.walk(env):
        os.chmod(here, 0o755)
    worker_python = str(env / "bin" / "python")
    if user is not None and not can_run_as(user, worker_python, "import torch, safetensors"):
        raise Refused(f"the worker's user cannot import torch from its environment ({env})")
    return worker_python


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


class OutcomeLines:
    """The worker's outcome reports, one JSON line each, read from a pipe as they come."""

    def __init__(self, fd: int):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(fd,), daemon=True)
        self.thread.start()

    def _read(self, fd: int):
        with open(fd, encoding="utf-8", errors="replace") as stream:
            for line in iter(lambda: stream.readline(4 * OUTPUT_CAP), ""):
                if len(self.lines) < MAX_OUTCOME_LINES:
                    self.lines.append(line)

    def read(self) -> list[str]:
        self.thread.join(timeout=10)
        return list(self.lines)


def limit_worker(memory_mb: int, own_user: bool):
    """The limits a worker process starts under (inherited by everything it starts)."""

    def apply():
        memory = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if own_user:  # counts every process of the user: only meaningful for the worker's own user
            resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))

    return apply


def kill_everything_of(uid: int) -> None:
    """SIGKILL every process of `uid`, again until none is left (a fork bomb is bounded by
    RLIMIT_NPROC, so this ends)."""
    for _ in range(200):
        pids = live_processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def live_processes_of(uid: int) -> list[int]:
    """The pids of `uid`'s processes that still run a thread. A zombie (every thread exited, not
    yet reaped by its parent) is left out: it runs nothing and cannot be killed, and waiting for
    it to go kept the sweep above spinning its whole 10 s (a parent that never reaps). A process
    whose first thread exited while others run shows that thread as a zombie too: it is counted."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid and runs_a_thread(entry):
                    pids.append(int(entry))
            except OSError:  # gone meanwhile
                continue
    return pids


def runs_a_thread(pid: str) -> bool:
    """Whether some thread of process `pid` is neither a zombie nor dead (its state in
    /proc/<pid>/task/<tid>/stat, after "tid (name)", a name that may hold spaces and parentheses)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if fields and fields[0] not in (b"Z", b"X"):
            return True
    return False


def start_as(cmd: list[str], cwd: Path, env: dict, user, memory_mb: int, pass_fds: tuple = ()) -> subprocess.Popen:
    """`cmd` as `user` (this process's user when None), in a session of its own, under the
    worker's limits, its output (stdout and stderr) on one pipe."""
    ids = dict(user=user[0], group=user[1], extra_groups=[]) if user else {}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True,
                            pass_fds=pass_fds, preexec_fn=limit_worker(memory_mb, user is not None), **ids)


def run_worker(cmd: list[str], cwd: Path, env: dict, user, time_limit: float, memory_mb: int, worker_uid=None,
               pass_fds: tuple = ()):
    """Run pytest (as `user`, or as this process's user when None); return (its capped output, its
    outcome lines, its exit status or None when stopped by the time limit). Whatever it started is
    killed when it ends, every process of `worker_uid` too (a judged run's worker)."""
    read_end, write_end = os.pipe()
    cmd = [*cmd, "--outcomes-log", f"/dev/fd/{write_end}"]
    try:
        proc = start_as(cmd, cwd, env, user, memory_mb, (write_end, *pass_fds))
    finally:
        os.close(write_end)
    log, outcomes = CappedLog(proc.stdout), OutcomeLines(read_end)
    try:
        status = proc.wait(timeout=time_limit)
    except subprocess.TimeoutExpired:
        status = None
    try:  # the worker's whole session, whether it finished or not
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for uid in {user[0] if user else None, worker_uid} - {None}:  # and whatever left the session
        kill_everything_of(uid)
    return log.text(), outcomes.read(), status


def read_outcomes(lines: list[str]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """({nodeid: {phase: outcome}} with "output" for the first failure, {file: collection error}).
    The first report of a test phase counts; a later one for the same phase is ignored."""
    outcomes: dict[str, dict[str, str]] = {}
    errors: dict[str, str] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut at the cap, or not ours
        if not isinstance(entry, dict):
            continue
        if "collect_error" in entry:
            errors.setdefault(str(entry["collect_error"]), cap(str(entry.get("output", ""))))
        elif "nodeid" in entry:
            phases = outcomes.setdefault(str(entry["nodeid"]), {})
            when = str(entry.get("when"))
            if when in phases:
                continue
            phases[when] = str(entry.get("outcome"))
            if entry.get("outcome") == "failed" and "output" not in phases:
                phases["output"] = cap(str(entry.get("output", "")))
    return outcomes, errors


def status_of(phases: dict[str, str]) -> str:
    if "failed" in (phases.get("setup"), phases.get("call"), phases.get("teardown")):
        return "failed"
    if "skipped" in (phases.get("setup"), phases.get("call")):
        return "skipped"
    return "passed" if phases.get("call") == "passed" else "missing"


class Part:
    """One worker run: some test files, their canaries, and what came back."""

    def __init__(self, name: str, files: list[str], judged: bool = False):
        self.name, self.files, self.judged = name, files, judged
        self.canaries: list[str] = []
        self.log, self.status, self.seconds, self.time_limit = "", None, 0.0, 0.0
        self.outcomes: dict[str, dict[str, str]] = {}
        self.errors: dict[str, str] = {}

    def forged(self) -> list[str]:
        """Canaries reported as anything but failed, when this part's report says a test passed.
        Judged, the reports come from the grader's own pytest, which no submission can reach: only a
        canary reported passed counts there. One never run is not a sign (the last round's worker
        may die before the last canary, e.g. a student's code that kills its process)."""
        anything_passed = any(status_of(p) == "passed" for n, p in self.outcomes.items() if n not in self.canaries)
        missing_counts = anything_passed and self.status is not None and not self.judged
        return [c for c in self.canaries if status_of(self.outcomes.get(c, {})) == "passed"
                or (missing_counts and status_of(self.outcomes.get(c, {})) != "failed")]

    def why_not_run(self, nodeid: str) -> str:
        module = nodeid.split("::")[0]
        if module in self.errors:
            return f"{module} could not be collected (so none of its tests ran):\n{self.errors[module]}"
        if self.status is None:
            return (f"Not run: the time limit of the {self.name} part ({self.time_limit:.0f} s) was reached "
                    "before this test.")
        return (f"Not run: the test run stopped early (pytest exit status {self.status}). Its output ends:\n"
                f"{cap(self.log, 2000)}")


def split_parts(manifest: dict, select: list[str]) -> list[Part]:
    """Hidden test files, then visible tests: the files of each, in the order they run."""
    tests = {n: t for n, t in manifest["tests"].items() if not select or n.startswith(tuple(select))}
    files: dict[str, list[dict]] = {}
    for nodeid, test in tests.items():
        files.setdefault(nodeid.split("::")[0], []).append(test)
    hidden_files = set(manifest.get("hidden_files", []))
    # Short parts first: a run cut off by the time limit loses the tail of the long part, never
    # the hidden tests wholesale.
    parts = {name: Part(name, [], judged=name.startswith("judged"))
             for name in ("judged hidden tests", "hidden tests", "judged tests", "tests")}
    for file, its_tests in sorted(files.items()):
        judged = all(t["lesson"] in JUDGED_LESSONS for t in its_tests)
        name = "hidden tests" if file in hidden_files else "tests"
        parts[f"judged {name}" if judged else name].files.append(file)
    return [part for part in parts.values() if part.files]


def grade(manifest: dict, select: list[str], parts: list[Part]) -> list[dict]:
    where = {file: part for part in parts for file in part.files}
    rows = []
    for nodeid, test in manifest["tests"].items():
        part = where.get(nodeid.split("::")[0])
        if part is None or (select and not nodeid.startswith(tuple(select))):
            continue
        phases = part.outcomes.get(nodeid, {})
        result = status_of(phases)
        # Every test in the manifest was collected to run here (no gpu test carries points): one
        # that comes back skipped was skipped by something its run did, which the worker can forge
        # (an exception named as pytest's Skipped): it earns nothing.
        output = (phases.get("output", "") if result == "failed" else part.why_not_run(nodeid) if result == "missing"
                  else "Skipped, which a graded test never is on the grader: it earns no points.")
        rows.append({"name": nodeid, "score": test["points"] if result == "passed" else 0.0,
                     "max_score": test["points"], "status": "passed" if result == "passed" else "failed",
                     "output": output, "visibility": "after_published" if test["hidden"] else "visible",
                     "tags": [test["lesson"]]})
    return rows


def lesson_totals(rows: list[dict]) -> str:
    """Points per lesson over the visible tests (what the student may see now)."""
    totals: dict[str, list[float]] = {}
    for row in rows:
        if row["visibility"] != "visible":
            continue
        total = totals.setdefault(row["tags"][0], [0.0, 0.0])
        total[0] += row["score"]
        total[1] += row["max_score"]
    lines = [f"{lesson}: {got:g} / {out_of:g}" for lesson, (got, out_of) in totals.items()]
    hidden = [row for row in rows if row["visibility"] != "visible"]
    if hidden:
        lines.append(f"and {len(hidden)} hidden tests ({sum(r['max_score'] for r in hidden):g} points), "
                     "shown when grades are published")
    return "\n".join(lines)


def calibrate() -> float:
    """How much slower than an idle reference machine this one runs now: the median of five timings
    of a fixed pure-Python workload over its idle time, between 1 and MAX_SLOWDOWN."""
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i * i % 7
        timings.append(time.perf_counter() - start)
    return min(MAX_SLOWDOWN, max(1.0, statistics.median(timings) / CALIBRATION_REFERENCE_S))


# In a judged run the worker imports the lesson packages, the harness's helpers and the tests' probes
# (and reads the models in assets/); the tests, the oracles and the instructor's files are the judge's.
NOT_FOR_THE_WORKER = ("harness/hf_reference.py", "harness/quantized_cache.py", "harness/grading.py",
                      "tests/conftest.py", "tests/helpers.py", "tests/test_*.py", "lessons", "notebooks",
                      "instructor", "docs")


def keep_only_what_the_worker_runs(copy: Path) -> None:
    for pattern in NOT_FOR_THE_WORKER:
        for path in copy.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def make_read_only(tree: Path) -> None:
    """The scratch copy belongs to the grader: readable by the worker, not writable by it."""
    for here, _, files in os.walk(tree):
        os.chmod(here, 0o755)
        for name in files:
            os.chmod(Path(here, name), 0o644)


def worker_home(work: Path, part: Part, user, prefix: str = "home") -> Path:
    """A fresh folder `user` may write in (HOME, TMPDIR, pytest's temporary folders)."""
    home = work / f"{prefix}-{part.name.replace(' ', '-')}"
    home.mkdir(mode=0o700)
    if user is not None:
        os.chown(home, *user)
    return home


def pytest_command(python: str, test_timeout: float, basetemp: Path, manifest: dict, targets: list[str]) -> list[str]:
    return [python, "-m", "pytest", "--graded-only", "--continue-on-collection-errors", "--color=no", "-q",
            "-p", "no:cacheprovider", "--hypothesis-profile=grading", f"--timeout={test_timeout:.0f}",
            f"--basetemp={basetemp}", "-m", " or ".join(manifest["lessons"]), *targets,
            *shlex.split(os.environ.get("AUTOGRADER_PYTEST_ARGS", ""))]


def environment(home: Path, tree: Path) -> dict:
    """A test run's environment: this one's, less the grader's settings, writing only in `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGRADER_") and k != "KVCOURSE_JUDGE"}
    env.update(HOME=str(home), TMPDIR=str(home), PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1",
               PYTHONNOUSERSITE="1", XDG_CACHE_HOME=str(home / ".cache"))
    return env


def run_part(part: Part, copy: Path, work: Path, manifest: dict, python: str, user, time_limit: float,
             test_timeout: float, memory_mb: int) -> None:
    """pytest in the worker: the tests and the student's code in one process, as `user`."""
    part.canaries = plant_canaries(copy / "tests", manifest["lessons"][0])
    for canary in part.canaries:
        os.chmod(copy / canary.split("::")[0], 0o644)
    home = worker_home(work, part, user)
    targets = [part.canaries[0].split("::")[0], *part.files, part.canaries[1].split("::")[0]]
    start = time.monotonic()
    part.time_limit = time_limit
    part.log, lines, part.status = run_worker(pytest_command(python, test_timeout, home / "pytest", manifest, targets),
                                              copy, environment(home, copy), user, time_limit, memory_mb)
    part.seconds = time.monotonic() - start
    part.outcomes, part.errors = read_outcomes(lines)
    for canary in part.canaries:
        (copy / canary.split("::")[0]).unlink(missing_ok=True)


def start_judged_worker(settings: dict) -> tuple[subprocess.Popen, CappedLog, int, int]:
    """The worker of one judged pytest run: `python -m harness.judge` as the worker's user, in the
    student's tree, serving requests on two pipes. Returns it, its output, and the judge's ends of
    the pipes (read, write), which the judge's pytest inherits."""
    to_worker_r, to_worker_w = os.pipe()
    from_worker_r, from_worker_w = os.pipe()
    try:
        worker = start_as([settings["python"], "-m", "harness.judge", str(to_worker_r), str(from_worker_w)],
                          Path(settings["tree"]), settings["env"], settings["user"], settings["memory_mb"],
                          (to_worker_r, from_worker_w))
    finally:
        os.close(to_worker_r)
        os.close(from_worker_w)
    return worker, CappedLog(worker.stdout), from_worker_r, to_worker_w


def stop_judged_worker(worker: subprocess.Popen, fds: tuple[int, int], user) -> None:
    for fd in fds:
        os.close(fd)
    try:  # its whole session; as root, every process of its user too (run_worker's worker_uid)
        os.killpg(worker.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    worker.wait()
    if user is not None:
        kill_everything_of(user[0])


def run_judged_part(part: Part, judge_tree: Path, copy: Path, work: Path, manifest: dict, python: str,
                    worker_py: str, user, judge, time_limit: float, test_timeout: float, memory_mb: int) -> None:
    """pytest as the judge (harness/judge.py): in `judge_tree`, as the `judge` user, the student's
    code in a worker this file starts for each pytest run as `user` in `copy`, on two pipes the
    judge inherits. A test stopped by its time limit while the student's code ran stops that pytest
    (and this file stops the worker); the tests not yet run go on in a new pair, so a loop costs the
    tests that meet it. Neither side runs as root."""
    part.canaries = plant_canaries(judge_tree / "tests", manifest["lessons"][0])
    for canary in part.canaries:
        for_the_judge_only(judge_tree / canary.split("::")[0], judge)
    home = worker_home(work, part, user)
    judge_home = worker_home(work, part, judge, prefix="judge-home")
    judge_home.chmod(0o711)  # the worker reads what tests make for it here (models), by path only
    # KVCOURSE_NO_ORACLE: a smoke script the worker runs prints its ids; the judge compares them.
    settings = {"python": worker_py, "tree": str(copy), "user": user, "memory_mb": memory_mb,
                "env": {**environment(home, copy), "KVCOURSE_NO_ORACLE": "1"}}
    env = {**environment(judge_home, judge_tree), "KVCOURSE_STUDENT_TREE": str(copy)}
    nodeids = [part.canaries[0], *(n for n in manifest["tests"] if n.split("::")[0] in part.files), part.canaries[1]]
    targets = [part.canaries[0].split("::")[0], *part.files, part.canaries[1].split("::")[0]]
    start, logs = time.monotonic(), []
    part.time_limit = time_limit
    for round_ in range(MAX_JUDGED_ROUNDS):
        left = time_limit - (time.monotonic() - start)
        if left < 1:
            part.status = None
            break
        ran_before = len(part.outcomes)
        worker, worker_log, *fds = start_judged_worker(settings)
        env["KVCOURSE_JUDGE"] = json.dumps({"fds": fds})
        try:
            log, lines, part.status = run_worker(
                pytest_command(python, test_timeout, judge_home / f"pytest-{round_}", manifest, targets), judge_tree,
                env, judge, left, memory_mb, pass_fds=tuple(fds))
        finally:
            stop_judged_worker(worker, tuple(fds), user)
        logs.append(log + (f"\n[the worker's output]\n{worker_log.text()}" if worker_log.text().strip() else ""))
        outcomes, errors = read_outcomes(lines)
        for nodeid, phases in outcomes.items():  # the first report of a phase counts, as in one run
            for phase, outcome in phases.items():
                part.outcomes.setdefault(nodeid, {}).setdefault(phase, outcome)
        for module, error in errors.items():
            part.errors.setdefault(module, error)
        # Named by node id, a test of a file that failed to collect stops the whole pytest run
        # (exit status 4, before any test): such files are not asked for again.
        targets = [n for n in nodeids if n not in part.outcomes and n.split("::")[0] not in part.errors]
        if part.status is None or not targets or len(part.outcomes) == ran_before:
            break
    part.log = cap("\n".join(logs), 2 * LOG_CAP)
    part.seconds = time.monotonic() - start
    for canary in part.canaries:
        (judge_tree / canary.split("::")[0]).unlink(missing_ok=True)


def for_the_judge_only(path: Path, judge) -> None:
    """A file of the judge's tree (root's: made by this process) that the judge's user may read and
    the worker may not: a hidden test, a canary."""
    if judge is not None:
        os.chown(path, 0, judge[1], follow_symlinks=False)
    os.chmod(path, 0o640 if judge is not None else 0o600)


def main() -> int:
    root = Path(os.environ.get("AUTOGRADER_ROOT", "/autograder"))
    source = Path(os.environ.get("AUTOGRADER_SOURCE", root / "source"))
    submission = Path(os.environ.get("AUTOGRADER_SUBMISSION", root / "submission"))
    results = Path(os.environ.get("AUTOGRADER_RESULTS", root / "results" / "results.json"))
    python = os.environ.get("AUTOGRADER_PYTHON", str(root / "venv" / "bin" / "python"))
    time_limit = float(os.environ.get("AUTOGRADER_TIME_LIMIT", DEFAULT_TIME_LIMIT_S))
    base_timeout = float(os.environ.get("AUTOGRADER_TEST_TIMEOUT", 180))
    memory_mb = int(os.environ.get("AUTOGRADER_MEMORY_MB", 8192))
    select = os.environ.get("AUTOGRADER_SELECT", "").split()
    manifest = json.loads((source / "grading_manifest.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="autograder-"))
    os.chmod(work, 0o711)  # the worker enters it (its python, its home, the copy), never lists or writes it
    try:
        user, judge = worker_user(), judge_user()
        worker_py = os.environ.get("AUTOGRADER_WORKER_PYTHON") or worker_environment(python, user, work)
        judge_py = os.environ.get("AUTOGRADER_JUDGE_PYTHON") or python_for(python, judge, work, "judge-python")
    except Refused as exc:
        print(f"FLAG for the instructor: nothing was graded: {exc}")
        write_results(results, [], "The grader could not run your code safely (a set-up problem, not your code); "
                      "your instructor has been told.", {"refused": str(exc)})
        shutil.rmtree(work, ignore_errors=True)
        return 0
    slowdown = calibrate()
    test_timeout = base_timeout * slowdown

    copy, hidden_store = work / "source", work / "hidden"
    hidden_files = set(manifest.get("hidden_files", []))
    # What the tests do not need stays out of the worker's reach: which tests are hidden, the points.
    shutil.copytree(source, copy, symlinks=True, ignore=shutil.ignore_patterns(
        "grading_manifest.json", "hidden_tests.txt", "grade.py", "setup.sh", "run_autograder", "__pycache__"))
    hidden_store.mkdir(mode=0o700)
    for file in hidden_files:  # back in the copy only while the hidden part runs
        if (copy / file).exists():
            shutil.move(copy / file, hidden_store / Path(file).name)
    found, missing = find_packages(submission, manifest["packages"])
    skipped = []
    for package, folder in found.items():
        shutil.rmtree(copy / package)
        skipped += copy_package(folder, copy / package)
    parts = split_parts(manifest, select)
    if all(part.judged for part in parts):
        keep_only_what_the_worker_runs(copy)
    make_read_only(copy)
    # The judged parts' pytest runs here: the bundle's own files (no upload). The worker may read
    # its files by path (the model in assets/ that a test names), never list its top folder, and
    # never read a hidden test file (0600, the grader's) or write anything.
    judge_tree = work / "judge"
    shutil.copytree(source, judge_tree, symlinks=True, ignore=shutil.ignore_patterns(
        "grading_manifest.json", "hidden_tests.txt", "grade.py", "setup.sh", "run_autograder", "__pycache__"))
    for file in hidden_files:
        (judge_tree / file).unlink(missing_ok=True)
    make_read_only(judge_tree)
    # Root's: the judge's user lists and reads it through its group, the worker only opens a file in
    # it by path (the model in assets/ a test names), never lists its top folder or writes in it.
    if judge is not None:
        os.chown(judge_tree, 0, judge[1])
    os.chmod(judge_tree, 0o751)
    notes = [f"graded: {p} (from {found[p].relative_to(submission)})" for p in found]
    notes += [f"not found in the submission: {p} (the handout's stub is graded in its place)" for p in missing]
    notes += [f"skipped from the upload: {s}" for s in skipped]
    print("\n".join(notes))
    flags = flags_of(list(found), copy, source)
    for flag in flags:
        print(f"FLAG for the instructor: {flag}")
    if user is None:
        print("note: the worker runs as the current user, with no privilege separation")
    else:
        print(f"the judged tests run as {JUDGE_USER} (uid {judge[0]}), the student's code as {WORKER_USER} "
              f"(uid {user[0]}), neither as root")
    print(f"calibration: this machine runs {slowdown:.2f}x slower than the idle reference; "
          f"each test may take {test_timeout:.0f} s")

    deadline = time.monotonic() + time_limit
    source_mode = source.stat().st_mode & 0o777
    os.chmod(source, 0o700)  # the bundle itself (manifest, hidden tests) out of the worker's reach
    try:
        for part in parts:
            hidden = part.name.endswith("hidden tests")
            if hidden:  # in the judge's tree (closed to the worker) when judged, else the worker's
                for file in part.files:
                    shutil.copy(hidden_store / Path(file).name, (judge_tree if part.judged else copy) / file)
                    if part.judged:
                        for_the_judge_only(judge_tree / file, judge)
                    else:
                        os.chmod(copy / file, 0o644)
            remaining = max(1.0, deadline - time.monotonic())
            if part.judged:
                run_judged_part(part, judge_tree, copy, work, manifest, judge_py, worker_py, user, judge, remaining,
                                test_timeout, memory_mb)
            else:
                run_part(part, copy, work, manifest, worker_py, user, remaining, test_timeout, memory_mb)
            print(f"== {part.name}: {len(part.files)} files, {part.seconds:.0f} s, pytest exit status {part.status}")
            print(part.log if not hidden else "(the hidden tests' output is not shown)")
            if hidden:  # gone before the visible parts run, which must not read them
                for file in part.files:
                    ((judge_tree if part.judged else copy) / file).unlink(missing_ok=True)
    finally:
        os.chmod(source, source_mode)

    rows = grade(manifest, select, parts)
    output = "\n".join(notes)
    forged = [c for part in parts for c in part.forged()]
    if forged:
        print(f"FLAG for the instructor: canary tests that must fail were reported as passed: {forged}; "
              "the test reports were tampered with, the score is 0")
        for row in rows:
            row["score"], row["status"] = 0.0, "failed"
            row["output"] = "Not scored: the grader could not trust this run's reports; your instructor will review it."
        output += "\nThis submission's test reports could not be trusted; your instructor will review it."
    for part in parts:
        if part.status is None:
            output += (f"\nThe time limit was reached in the {part.name} part: its tests that had not run "
                       "score 0.")
    output += "\n" + lesson_totals(rows)
    extra = {"flags": flags, "forged_canaries": forged, "skipped_upload_files": skipped,
             "slowdown": round(slowdown, 2), "test_timeout_s": round(test_timeout),
             "parts": {p.name: {"files": len(p.files), "seconds": round(p.seconds), "exit_status": p.status}
                       for p in parts}}
    write_results(results, rows, output, extra)
    print(f"wrote {results}\n{lesson_totals(rows)}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def write_results(results: Path, rows: list[dict], output: str, extra: dict) -> None:
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({"score": sum(r["score"] for r in rows), "output": output, "extra_data": extra,
                                   "tests": rows}, indent=1))


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
