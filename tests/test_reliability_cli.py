"""Reliability of the smoke scripts and tools, second round: every exit code true, no data lost.

The contract (COURSE.md): 0 every request equals HF, 1 a mismatch and only that, 2 bad input or
environment with one line saying what to fix, 3 a bug with its traceback. Each case here is one
the first round missed: a closed pipe, a full disk, an invalid UTF-8 prompt, a failed large
allocation, an unwritable or corrupt emulation cache, Ctrl-C while importing, a typo'd local
model path, a silent hub, a model folder holding more weights files than HF reads, and a student
copy aimed at the repository itself. Most run in-process (the same `run_smoke` a script's
`__main__` calls); the few subprocesses need no model. Provided code only: no points.
"""

from __future__ import annotations

import ast
import errno
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import harness.smoke
from harness.smoke import DEFAULT_MODEL, resolve_model_dir
from l1_contiguous import InputError
from l3_block_kernel import kernel_build
from helpers import load_script
from test_bad_input_cli import ROOT, SCRIPTS, assert_one_line_error, run_in_process

pytestmark = [pytest.mark.course, pytest.mark.usefixtures("one_torch_thread")]

SHORT = ["--max-new-tokens", "2", "--prompt-ids", "5,6,7"]


class _FailingStdout(io.TextIOBase):
    """A stdout whose every write fails as a closed pipe or a full disk makes it fail."""

    def __init__(self, exc: OSError):
        self.exc = exc

    def write(self, text):
        raise self.exc

    def flush(self):
        raise self.exc


@pytest.mark.parametrize("script", ["l1_smoke", "l5_smoke"])
def test_a_closed_pipe_ends_quietly_with_the_verdict(script, monkeypatch, capsys):
    """`l1_smoke.py --json | head -c 10`: the reader left; the ids still equal HF's, so exit 0."""
    monkeypatch.setattr(sys, "stdout", _FailingStdout(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    status, err = run_in_process(script, [*SHORT, "--json"], capsys)
    assert status == 0 and err == "", err


def test_a_full_disk_under_stdout_is_exit_2_and_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _FailingStdout(OSError(errno.ENOSPC, "No space left on device")))
    status, err = run_in_process("l1_smoke", SHORT, capsys)
    assert_one_line_error(status, err, "full disk")
    assert "No space left" in err


def test_a_full_disk_during_the_run_is_exit_2_and_one_line(monkeypatch, capsys):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/somewhere/cache")

    monkeypatch.setattr(harness.smoke, "compare_with_hf", full)
    status, err = run_in_process("l2_smoke", SHORT, capsys)
    assert_one_line_error(status, err, "full disk")
    assert "No space left" in err and "/somewhere/cache" in err


def test_an_invalid_utf8_prompt_is_exit_2(capsys):
    """Bytes that are not UTF-8 reach sys.argv as lone surrogates (b'\\xff' -> '\\udcff')."""
    status, err = run_in_process("l1_smoke", ["--prompt", b"caf\xff".decode("utf-8", "surrogateescape"),
                                              "--max-new-tokens", "2"], capsys)
    assert_one_line_error(status, err, "invalid UTF-8")
    assert "UTF-8" in err


def test_a_failed_large_allocation_is_exit_2(capsys):
    """torch's CPU allocator raises a plain RuntimeError when malloc fails: the user's request."""
    status, err = run_in_process("l1_smoke", ["--cache-len", "3000000000", *SHORT], capsys)
    assert_one_line_error(status, err, "huge cache")
    assert "out of memory" in err


def test_a_mismatch_is_still_exit_1_and_a_bug_still_exit_3(monkeypatch, capsys):
    """The new mappings take nothing from 1 and 3: an OSError that is not the machine's is a bug."""
    real = harness.smoke.compare_with_hf

    def differ(setup, result, *args):
        for r in result.requests:
            r.ids = [(i + 1) % setup.cfg.vocab_size for i in r.ids]
        return real(setup, result, *args)

    monkeypatch.setattr(harness.smoke, "compare_with_hf", differ)
    status, _ = run_in_process("l1_smoke", SHORT, capsys)
    assert status == 1

    def bug(*args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/a/bug")

    monkeypatch.setattr(harness.smoke, "compare_with_hf", bug)
    status, err = run_in_process("l1_smoke", SHORT, capsys)
    assert status == 3 and "Traceback" in err


# ---------------------------------------------------------------- the model folder

def test_a_typo_in_a_local_model_path_is_no_such_folder(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    status, err = run_in_process("l1_smoke", ["--model", "assets/tiny-qwen3-kjvv"], capsys)
    assert_one_line_error(status, err, "typo")
    assert "no such folder" in err and "hub" not in err.split(";")[0]


@pytest.mark.parametrize("arg,hub", [("Qwen/Qwen3-0.6B", True), ("assets/tiny-qwen3-kjvv", False),
                                     ("./Qwen/Qwen3-0.6B", False), ("~/models/qwen", False),
                                     ("/models/qwen", False), ("a/b/c", False)])
def test_what_counts_as_a_hub_id(arg, hub, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert harness.smoke.looks_like_hub_id(arg) is hub


def test_a_silent_hub_times_out(monkeypatch):
    """A server that accepts the connection and never answers: the download gives up, one line."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted = []

    def accept_and_stay_silent():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:  # closed at the end of the test
                return

    threading.Thread(target=accept_and_stay_silent, daemon=True).start()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(harness.smoke, "HUB_READ_TIMEOUT_S", 0.5)
    started = time.perf_counter()
    try:
        with pytest.raises(InputError, match="could not fetch nobody/nothing") as exc_info:
            resolve_model_dir("nobody/nothing")
    finally:
        server.close()
        for conn in accepted:
            conn.close()
    assert "\n" not in str(exc_info.value)
    assert accepted, "the hub client never connected: the timeout was not exercised"
    assert time.perf_counter() - started < 60


def _perturbed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t + 0.5 if t.is_floating_point() else t for name, t in tensors.items()}


def _model_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    for src in DEFAULT_MODEL.iterdir():
        (folder / src.name).symlink_to(src)
    return folder


def test_a_folder_with_a_single_file_and_an_index_loads_the_single_file_as_hf_does(tmp_path, capsys):
    folder = _model_copy(tmp_path)
    tensors = load_file(DEFAULT_MODEL / "model.safetensors")
    save_file(_perturbed(tensors), folder / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in tensors}}
    (folder / "model.safetensors.index.json").write_text(__import__("json").dumps(index))
    with pytest.warns(UserWarning, match="loading model.safetensors, as transformers does"):
        status, err = run_in_process("l1_smoke", ["--model", str(folder), *SHORT], capsys)
    assert status == 0, err


def test_a_stray_safetensors_file_is_not_merged_in(tmp_path, capsys):
    folder = _model_copy(tmp_path)
    save_file(_perturbed(load_file(DEFAULT_MODEL / "model.safetensors")), folder / "zz-extra.safetensors")
    status, err = run_in_process("l1_smoke", ["--model", str(folder), *SHORT], capsys)
    assert status == 0, err


# ---------------------------------------------------------------- the L3 emulation cache

def test_an_unwritable_emulation_cache_is_exit_2(monkeypatch, capsys):
    if kernel_build.host_compiler() is None:
        pytest.skip("backend 'emulated' needs a C++20 compiler")
    monkeypatch.setenv("L3_EMULATION_CACHE", "/dev/null/cache")  # under a file: no folder can be made
    kernel_build.load_emulation.cache_clear()
    try:
        status, err = run_in_process("l3_smoke", ["--backend", "emulated", *SHORT], capsys)
    finally:
        kernel_build.load_emulation.cache_clear()
    assert_one_line_error(status, err, "unwritable cache")
    assert "L3_EMULATION_CACHE" in err


def test_a_corrupt_cached_emulation_library_is_rebuilt(tmp_path, monkeypatch):
    """A library cut short (a full disk, a killed copy) must not fail every later run: it is built
    again. The build itself is replaced by a stand-in that counts calls and writes a library that
    loads (compiling the kernel takes tens of seconds; test_l3_smoke does it for real)."""
    compiler = kernel_build.host_compiler()
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    monkeypatch.setenv("L3_EMULATION_CACHE", str(tmp_path))
    library = kernel_build.EMULATION_BUILD.library(compiler)
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF cut short")
    stand_in = tmp_path / "stand_in.c"
    stand_in.write_text("".join(f"void {name}(void) {{}}\n" for name in
                                ("l3_emulated_paged_attention", "l3_emulated_to_16bit", "l3_emulated_from_16bit")))
    builds = []

    def compile_into(build, compiler, target):
        builds.append(target)
        subprocess.run([compiler, "-x", "c", "-shared", "-fPIC", str(stand_in), "-o", str(target)], check=True)

    monkeypatch.setattr(kernel_build, "_compile_into", compile_into)
    kernel_build.load_emulation.cache_clear()
    try:
        lib = kernel_build.load_emulation()
    finally:
        kernel_build.load_emulation.cache_clear()
    assert builds == [library] and lib.l3_emulated_paged_attention is not None


# ---------------------------------------------------------------- Ctrl-C while starting

def test_ctrl_c_while_importing_is_one_line_and_exit_2():
    """The guard every smoke script puts around its imports, hit by a real SIGINT."""
    code = ("import os, signal, sys, time\nsys.path.insert(0, %r)\nfrom harness.cli import starting\n"
            "with starting():\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n" % str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == ["error: interrupted (Ctrl-C) while starting; nothing was run"]


def test_ctrl_c_through_exec_built_code_still_exits_2(tmp_path):
    """CPython marks a KeyboardInterrupt that leaves code run by `exec` from a string (how dataclasses
    build their methods, during a lazy import) and, at exit, kills itself with SIGINT (-2) even though
    the exception was caught: run_main must exit 2 anyway. Run as `python -m`, as the server is."""
    (tmp_path / "interrupted_mod.py").write_text(
        "import os, signal, sys\nsys.path.insert(0, %r)\nfrom harness.cli import run_main\n"
        "def main():\n    exec('import os, signal\\nos.kill(os.getpid(), signal.SIGINT)\\nx = 1\\n')\n"
        "sys.exit(run_main(main))\n" % str(ROOT))
    done = subprocess.run([sys.executable, "-m", "interrupted_mod"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 2, (done.returncode, done.stderr[-500:])
    assert done.stderr.strip().splitlines() == ["error: interrupted (Ctrl-C); nothing was written"]


SWALLOWING_MAIN = (
    "def main(*_):\n"
    "    try:\n"
    "        os.kill(os.getpid(), signal.SIGINT)\n"
    "        time.sleep(30)\n"
    "    except KeyboardInterrupt:\n"
    "        pass\n"
    "    raise %s(\"could not determine the shape of object type 'torch.storage.UntypedStorage'\")\n")


@pytest.mark.parametrize("entry", ["run_main", "run_smoke"])
@pytest.mark.parametrize("raised", ["ValueError", "ModelLoadError"])
def test_an_error_that_c_code_raised_in_place_of_a_ctrl_c_is_still_the_ctrl_c(entry, raised):
    """Seen in CI: a SIGINT while safetensors built a tensor came back as torch's "could not determine
    the shape" with no KeyboardInterrupt in its chain, then as "not a readable safetensors file;
    re-download it". After a Ctrl-C, whatever error follows is the Ctrl-C: one line, exit 2."""
    call = ("sys.exit(run_main(main))" if entry == "run_main"
            else "sys.exit(run_smoke('L1', 'x', main, argv=['--model', %r]))" % str(ROOT / "assets" / "tiny-qwen3-kjv"))
    code = ("import os, signal, sys, time\nsys.path.insert(0, %r)\nfrom harness.cli import run_main\n"
            "from harness.smoke import run_smoke\nfrom l1_contiguous.errors import ModelLoadError\n" % str(ROOT)
            + SWALLOWING_MAIN % raised + call + "\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 2, (done.returncode, done.stderr[-1500:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted (Ctrl-C)"), done.stderr[-1500:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_smoke_script_imports_torch_and_the_lessons_under_the_guard(script):
    tree = ast.parse((ROOT / "scripts" / f"{script}.py").read_text())
    guarded = [node for node in tree.body if isinstance(node, ast.With)
               and ast.unparse(node.items[0].context_expr) == "starting()"]
    assert len(guarded) == 1, "wrap the heavy imports in `with starting():`"
    heavy = re.compile(r"\b(torch|harness\.smoke|l\d+_\w+)\b")  # torch, and whatever imports it
    heavy = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
             and heavy.search(ast.unparse(node))]
    assert not heavy, f"imported outside the guard: {[ast.unparse(n) for n in heavy]}"


# ---------------------------------------------------------------- the student copy

def _student_copy(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/make_student_copy.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("dest", ["lessons", "l2_paged", ".git", "tests/copy", "."])
def test_make_student_copy_refuses_a_destination_inside_the_repository(dest):
    before = sorted(p.name for p in (ROOT / "lessons").iterdir())
    done = _student_copy(dest, "--force")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert "repository" in done.stderr
    assert sorted(p.name for p in (ROOT / "lessons").iterdir()) == before
    assert not (ROOT / "tests" / "copy").exists()


def test_make_student_copy_force_deletes_only_a_copy_it_made(tmp_path):
    mine = tmp_path / "someone-else"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    done = _student_copy(str(mine), "--force")
    assert done.returncode == 2 and "not a student copy" in done.stderr and done.stderr.count("\n") == 1
    assert (mine / "thesis.tex").read_text() == "years of work"


def test_make_student_copy_force_updates_in_place_keeping_git_and_the_instructors_files(tmp_path):
    """A copy turned into a repository, with files the instructor added: --force (what `make
    student-copy` always passes) replaces only the files it wrote, and says what it kept."""
    copy = tmp_path / "copy"
    assert _student_copy(str(copy)).returncode == 0
    subprocess.run(["git", "init", "-q", str(copy)], check=True)
    (copy / "NOTES-for-TAs.md").write_text("week 3: grade L2 by hand")
    (copy / "lessons" / "L2-paged.md").write_text("edited by hand")  # a file the script wrote
    (copy / "old-file-the-script-wrote.txt").write_text("x")
    marker = copy / ".student-copy"
    marker.write_text(marker.read_text() + "old-file-the-script-wrote.txt\n")
    done = _student_copy(str(copy), "--force")
    assert done.returncode == 0, done.stderr
    assert (copy / ".git" / "HEAD").is_file()
    assert (copy / "NOTES-for-TAs.md").read_text() == "week 3: grade L2 by hand"
    assert (copy / "lessons" / "L2-paged.md").read_text() == (ROOT / "lessons" / "L2-paged.md").read_text()
    assert not (copy / "old-file-the-script-wrote.txt").exists()
    assert "updated" in done.stdout and "NOTES-for-TAs.md" in done.stdout and ".git kept" in done.stdout
    assert not list(tmp_path.glob(".copy.partial-*"))


def test_make_student_copy_refuses_to_overwrite_a_file_it_did_not_write(tmp_path):
    copy = tmp_path / "copy"
    assert _student_copy(str(copy)).returncode == 0
    marker = copy / ".student-copy"
    lines = marker.read_text().splitlines()
    marker.write_text("\n".join(line for line in lines if line.split("  ")[-1] != "README.md") + "\n")  # now foreign
    (copy / "README.md").write_text("the instructor's own README")
    done = _student_copy(str(copy), "--force")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "README.md" in done.stderr
    assert (copy / "README.md").read_text() == "the instructor's own README"


def test_make_student_copy_interrupted_leaves_no_half_copy(tmp_path):
    """SIGTERM (as Ctrl-C) while copying: no OUT_DIR, no temporary folder left, exit 2; a full disk
    the same. The copy is built beside OUT_DIR and renamed into place only when whole."""
    copy = tmp_path / "copy"
    code = ("import os, signal, shutil, sys, runpy\n"
            "real = shutil.copy2\ncount = [0]\n"
            "def slow(*a, **k):\n"
            "    count[0] += 1\n"
            "    if count[0] == 20: os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return real(*a, **k)\n"
            "shutil.copy2 = slow\n"
            f"sys.argv = ['make_student_copy.py', {str(copy)!r}]\n"
            "runpy.run_path('scripts/make_student_copy.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "interrupted" in done.stderr
    assert not copy.exists() and list(tmp_path.iterdir()) == []
    full = ("import errno, shutil, sys, runpy\n"
            "def full(*a, **k): raise OSError(errno.ENOSPC, 'No space left on device', a[1])\n"
            "shutil.copy2 = full\n"
            f"sys.argv = ['make_student_copy.py', {str(copy)!r}]\n"
            "runpy.run_path('scripts/make_student_copy.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", full], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "No space left" in done.stderr
    assert not copy.exists() and list(tmp_path.iterdir()) == []
    assert _student_copy(str(copy), "--force").returncode == 0 and (copy / ".student-copy").is_file()


def test_make_student_copy_default_destination_from_a_fresh_clone(tmp_path):
    """`make student-copy`'s command in a fresh clone: student-copy/ does not exist yet, and git
    must still see it as ignored."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    for rel in ("scripts/make_student_copy.py", ".gitignore"):  # this tree's versions, committed or not
        (clone / rel).write_text((ROOT / rel).read_text())
    done = subprocess.run([sys.executable, "scripts/make_student_copy.py", "student-copy", "--force"], cwd=clone,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (clone / "student-copy" / ".student-copy").is_file()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert "student-copy" not in status, status


@pytest.mark.parametrize("entry", ["absolute", "up", "through a link", "its .git"])
def test_make_student_copy_force_deletes_nothing_outside_the_copy(entry, tmp_path):
    """A marker is a file anyone can edit: a line naming a path outside the copy (or its .git) must
    not become a delete. Refused, one line, before anything changes."""
    copy, victim = tmp_path / "copy", tmp_path / "victim.txt"
    assert _student_copy(str(copy)).returncode == 0
    victim.write_text("not the copy's")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim.txt").write_text("not the copy's")
    (copy / "link").symlink_to(tmp_path / "outside")
    subprocess.run(["git", "init", "-q", str(copy)], check=True)
    line = {"absolute": str(victim), "up": "../victim.txt", "through a link": "link/victim.txt",
            "its .git": ".git/HEAD"}[entry]
    marker = copy / ".student-copy"
    marker.write_text(marker.read_text() + line + "\n")
    done = _student_copy(str(copy), "--force")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "outside" in done.stderr, done.stderr
    assert victim.is_file() and (tmp_path / "outside" / "victim.txt").is_file() and (copy / ".git" / "HEAD").is_file()


def test_make_student_copy_force_keeps_a_hand_edit_and_says_so(tmp_path):
    """A file the script wrote, edited since (a TA fixed a typo in the copy): --force keeps the edit
    as FILE.orig-edited, names it in one line, and writes the new version. A second edit is kept
    beside the first."""
    copy = tmp_path / "copy"
    assert _student_copy(str(copy)).returncode == 0
    lesson = copy / "lessons" / "L2-paged.md"
    lesson.write_text("the TA's fix")
    done = _student_copy(str(copy), "--force")
    assert done.returncode == 0, done.stderr
    assert (copy / "lessons" / "L2-paged.md.orig-edited").read_text() == "the TA's fix"
    assert lesson.read_text() == (ROOT / "lessons" / "L2-paged.md").read_text()
    named = [line for line in done.stdout.splitlines() if line.startswith("kept your edit")]
    assert len(named) == 1 and "lessons/L2-paged.md.orig-edited" in named[0], done.stdout
    lesson.write_text("a second fix")
    done = _student_copy(str(copy), "--force")
    assert done.returncode == 0 and (copy / "lessons" / "L2-paged.md.orig-edited-2").read_text() == "a second fix"
    assert (copy / "lessons" / "L2-paged.md.orig-edited").read_text() == "the TA's fix"
    again = _student_copy(str(copy), "--force")  # nothing edited: nothing kept, nothing named
    assert again.returncode == 0 and "kept your edit" not in again.stdout
    assert "orig-edited" in _student_copy("--help").stdout  # the choice is stated where --force is


def test_make_student_copy_removes_what_a_killed_run_left_and_only_that(tmp_path):
    """kill -9 mid-copy leaves `.copy.partial-<pid>-XXXXXXXX` beside the target (no handler runs):
    the next run removes it, and the leftovers of older versions (no pid), but not a live run's,
    another target's, or a folder that only looks alike."""
    copy = tmp_path / "copy"
    code = ("import os, signal, shutil, sys, runpy\n"
            "real = shutil.copy2\ncount = [0]\n"
            "def killed(*a, **k):\n"
            "    count[0] += 1\n"
            "    if count[0] == 20: os.kill(os.getpid(), signal.SIGKILL)\n"
            "    return real(*a, **k)\n"
            "shutil.copy2 = killed\n"
            f"sys.argv = ['make_student_copy.py', {str(copy)!r}]\n"
            "runpy.run_path('scripts/make_student_copy.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    left = list(tmp_path.glob(".copy.partial-*"))
    assert len(left) == 1 and not copy.exists()
    old = tmp_path / ".copy.partial-ab_cd123"  # an older version's name: no pid
    live = tmp_path / f".copy.partial-{os.getpid()}-abcd1234"  # a run still going
    others = [tmp_path / ".other.partial-abcd1234", tmp_path / ".copy.partial-notes", live]
    for folder in [old, *others]:
        folder.mkdir()
        (folder / "x").write_text("x")
    done = _student_copy(str(copy))
    assert done.returncode == 0, done.stderr
    assert not left[0].exists() and not old.exists() and all(f.is_dir() for f in others)
    assert done.stdout.count("an interrupted run left behind") == 2, done.stdout


def test_make_student_copy_takes_only_what_git_tracks_and_names_the_rest(tmp_path):
    """An untracked draft at the root (`week3_solution.md`) must not reach the students unseen: the
    copy takes the files git tracks and names the ones it left out. Run in a clone, so this
    repository's own working tree is not touched."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    for rel in ("scripts/make_student_copy.py", ".gitignore"):  # this tree's versions, committed or not
        (clone / rel).write_text((ROOT / rel).read_text())
    (clone / "week3_solution.md").write_text("the answers")
    (clone / "l2_paged" / "draft.py").write_text("ANSWER = 42\n")
    done = subprocess.run([sys.executable, "scripts/make_student_copy.py", str(tmp_path / "copy")], cwd=clone,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "copy" / "week3_solution.md").exists()
    assert not (tmp_path / "copy" / "l2_paged" / "draft.py").exists()
    assert (tmp_path / "copy" / "l2_paged" / "__init__.py").is_file()
    named = [line for line in done.stdout.splitlines() if "git does not track" in line]
    assert len(named) == 1 and "week3_solution.md" in named[0] and "l2_paged/draft.py" in named[0], done.stdout


@pytest.mark.parametrize("case", ["hidden folder missing", "bundle in a lesson package", "bundle deeper in one"])
def test_make_autograder_refuses_a_missing_hidden_folder_and_a_bundle_inside_a_lesson_package(case, tmp_path,
                                                                                                capsys):
    """`--hidden-tests-dir /nope` built a bundle without the hidden tests (exit 0), and a bundle could
    be written into a lesson package. One line, exit 2, and no build (a stand-in: nothing is written)."""
    tool = load_script("make_autograder")
    builds = []
    tool.build = lambda *args: builds.append(args) or {"tests": {}, "packages": []}
    argv = {"hidden folder missing": [str(tmp_path / "a.zip"), "--hidden-tests-dir", str(tmp_path / "nope")],
            "bundle in a lesson package": [str(ROOT / "l2_paged" / "a.zip")],
            "bundle deeper in one": [str(ROOT / "l13_sliding_window" / "sub" / ".." / "a.zip")]}[case]
    status = tool.main(argv)
    err = capsys.readouterr().err
    assert status == 2 and not builds, err
    assert err.count("\n") == 1 and err.startswith("error: ") and ("nope" in err or "lesson package" in err), err


# ---------------------------------------------------------------- the benches' door

BENCH_BAD = [
    ("bench_l10", ["--k", "0"]), ("bench_l10", ["--batch", "0"]), ("bench_l10", ["--max-new-tokens", "0"]),
    ("bench_l10", ["--repeat", "0"]), ("bench_l10", ["--threads", "0"]),
    ("bench_l5", ["--skip-0.6b", "--only-0.6b"]), ("bench_l5", ["--json", "/no/such/folder/x.json"]),
    ("bench_l5", ["--json", "."]), ("bench_l10", ["--markdown", "/dev/full"]), ("bench_l8", ["--layers-0.6b", "40"]),
    ("bench_l1", ["--max-new-tokens", "1"]), ("bench_serve", ["--rounds", "0"]), ("bench_head", ["--repeat", "0"]),
    ("bench_l2", ["--requests", "0"]), ("bench_l3_kernel", ["--peak-gbps", "-1"]), ("bench_bf16", ["--layers", "0"]),
    ("make_autograder", ["/no/such/folder/a.zip"]), ("make_autograder", ["/dev/full"]),
    # L12-L14: a model folder that is not there, a GPU that is not there (or a device the bench
    # would ignore), counts out of bounds. Each was a traceback and 3, or a run that went on regardless.
    *[(bench, ["--model", "/nope"]) for bench in ("bench_l12", "bench_l13", "bench_l14")],
    *[(bench, ["--device", "cuda"]) for bench in ("bench_l12", "bench_l13", "bench_l14")],
    ("bench_l13", ["--shape-0.6b", "--device", "cuda" if not torch.cuda.is_available() else "tpu"]),
    ("bench_l13", ["--dtype", "bfloat16"]), ("bench_l14", ["--dtype", "bfloat16"]),
    ("bench_l12", ["--repeat", "1000000000"]), ("bench_l14", ["--repeat", "1000000000"]),
    ("bench_l14", ["--repeat", "0"]), ("bench_l12", ["--threads", "100000"]), ("bench_l12", ["--threads", "0"]),
    ("bench_l12", ["--block-size", "100000000"]), ("bench_l13", ["--block-size", "100000000"]),
    ("bench_l13", ["--block-size", "0"]), ("bench_l12", ["--budget-fraction", "nan"]),
    ("bench_l12", ["--budget-fraction", "0"]),
]


@pytest.mark.parametrize("script,argv", BENCH_BAD, ids=[f"{s} {' '.join(a)}" for s, a in BENCH_BAD])
def test_benches_refuse_bad_options_at_the_door(script, argv, capsys):
    """One line, exit 2, before any work (the whole run used to go first, then a traceback). In
    process (the scripts' imports are this process's already); `python scripts/bench_l10.py --k 0`
    from a shell prints the same line, as the Ctrl-C test's subprocesses show for the entry points."""
    started = time.monotonic()
    bench = load_script(script)
    with pytest.raises(SystemExit) as refused:
        bench.main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2, err[-2000:]
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert time.monotonic() - started < 30


def test_an_input_error_raised_during_the_work_is_one_line_and_exit_2():
    """What the door cannot see (a folder whose config breaks an hour in, a tier that refuses a
    write) raises InputError deep in the work: run_main, every bench's entry, says it in one line
    and exits 2, as run_smoke does, not a traceback and 3. After a Ctrl-C it is still the Ctrl-C."""
    code = ("import sys\nsys.path.insert(0, %r)\nfrom harness.cli import run_main\n"
            "from l1_contiguous.errors import ModelLoadError\n"
            "def main():\n    raise ModelLoadError('/m/config.json lacks hidden_size; fix or re-download it')\n"
            "sys.exit(run_main(main))\n" % str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr == "error: /m/config.json lacks hidden_size; fix or re-download it\n"


def test_a_section_rewrite_never_leaves_a_cut_file(tmp_path, monkeypatch):
    """--markdown FILE on a full disk: the old file stays whole and no temporary file is left."""
    from harness import benchmark

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept text\n")
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:10])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(benchmark.os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))
    with pytest.raises(OSError):
        benchmark.replace_section(str(doc), "bench_x", "| a | b |")
    assert doc.read_text() == "# Benchmarks\n\nkept text\n" and [p.name for p in tmp_path.iterdir()] == [doc.name]
    monkeypatch.undo()
    benchmark.replace_section(str(doc), "bench_x", "| a | b |")
    assert "kept text" in doc.read_text() and "| a | b |" in doc.read_text()
    with pytest.raises(OSError, match="not a regular file"):
        benchmark.replace_section("/dev/full", "bench_x", "x")  # never read endlessly


@pytest.mark.parametrize("target", ["check-L2", "check-l6", "smoke-l6"])
def test_make_names_the_lessons_for_an_unknown_one(target):
    done = subprocess.run(["make", "-s", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "No rule" not in done.stderr
    assert "no lesson" in done.stderr and "l1" in done.stderr and "l11" in done.stderr


# ---------------------------------------------------------------- streams and paths a user can break


def _smoke(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/l1_smoke.py", *argv], cwd=ROOT, capture_output=True,
                          timeout=300, **kwargs)


def test_a_closed_stdout_still_gives_the_verdict_as_the_exit_status():
    done = subprocess.run(f"{sys.executable} scripts/l1_smoke.py --max-new-tokens 2 >&-", shell=True, cwd=ROOT,
                          capture_output=False, stderr=subprocess.PIPE, timeout=300)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr[-2000:]


def test_an_ascii_terminal_gets_escapes_not_a_traceback():
    done = _smoke(["--max-new-tokens", "2"], env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr[-2000:]
    assert b"\\xb7" in done.stdout  # the report's middle dot, escaped


def test_stderr_on_a_full_disk_still_exits_2():
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "scripts/l1_smoke.py", "--max-new-tokens", "0"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=full, timeout=300)
    assert done.returncode == 2


def test_a_model_folder_whose_name_is_not_utf8_is_named_as_such(tmp_path):
    folder = os.path.join(os.fsencode(tmp_path), b"model-\xff")
    shutil.copytree(os.fsencode(DEFAULT_MODEL), folder)
    done = subprocess.run([sys.executable.encode(), b"scripts/l1_smoke.py", b"--model", folder], cwd=ROOT,
                          capture_output=True, timeout=300)
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2 and err.count("\n") == 1 and "not UTF-8" in err and "tokenizer" not in err, err


@pytest.mark.parametrize("argv,delay", [(["-m", "l11_serve", "--port", "0"], 1.5), (["-m", "l11_serve", "--port", "0"], 5.0),
                                        (["scripts/bench_l5.py", "--skip-0.6b"], 1.5),
                                        (["scripts/make_autograder.py", "autograder-test.zip"], 3.0)],
                         ids=["serve-importing", "serve-building", "bench-importing", "autograder-building"])
def test_ctrl_c_at_any_time_is_one_line_and_exit_2(argv, delay, tmp_path):
    """A real SIGINT while the entry point imports torch, builds its model or its bundle."""
    argv = [str(ROOT / a) if a.startswith("scripts/") else a for a in argv]
    proc = subprocess.Popen([sys.executable, *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err[-2000:]
    if "Uvicorn running" in err:  # a fast machine: the server was serving already, Ctrl-C stops it cleanly
        assert proc.returncode == 0 and "Finished server process" in err, err[-500:]
    else:
        assert proc.returncode == 2 and err.strip().splitlines()[-1].startswith("error: interrupted"), err[-500:]
    assert not list(tmp_path.iterdir())  # the bundle: nothing half-written


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if text in cmdline and proc.name != str(os.getpid()):
            found.append(cmdline[:200])
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the compiler")
def test_sigterm_during_the_emulation_build_leaves_no_compiler_and_no_temporary_file(tmp_path):
    cache = tmp_path / "l3-cache"
    proc = subprocess.Popen([sys.executable, "scripts/l3_smoke.py", "--backend", "emulated", "--max-new-tokens", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "L3_EMULATION_CACHE": str(cache)})
    deadline = time.monotonic() + 120
    while not list(cache.glob("*/building-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert list(cache.glob("*/building-*")), "the build never started"
    time.sleep(0.3)  # the compiler is running now
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err[-2000:]
    time.sleep(0.5)
    assert not list(cache.glob("*/building-*")) and not list(cache.glob("**/*.so"))
    assert not _processes_mentioning(str(cache)), _processes_mentioning(str(cache))


# ---------------------------------------------------------------- pool sizes, windows, messages (issue 53)

def _has_option(script: str, option: str) -> bool:
    module = load_script(script)
    parser = harness.smoke.make_parser(module.LESSON, "")
    getattr(module, "add_options", lambda p: None)(parser)
    return option in parser._option_string_actions


POOL_SCRIPTS = [s for s in SCRIPTS if _has_option(s, "--num-blocks")]
POOL_CASES = [(s, v) for s in POOL_SCRIPTS for v in ("0", "-3")]


@pytest.mark.parametrize("script,value", POOL_CASES)
def test_no_smoke_script_takes_a_pool_of_no_blocks_for_the_default(script, value, capsys):
    """L13 and L14 read `--num-blocks 0` as "not given" (`or`) and ran the default pool to a PASS.
    Every script with a pool: 0 or less is one line naming --num-blocks, exit 2; leaving the
    option out is what asks for the default."""
    assert len(POOL_SCRIPTS) >= 7 and {"l13_smoke", "l14_smoke"} <= set(POOL_SCRIPTS)
    status, err = run_in_process(script, [f"--num-blocks={value}", *SHORT], capsys)
    assert_one_line_error(status, err, (script, value))
    assert "--num-blocks" in err or "num_blocks" in err, err


def _hybrid_config(folder: Path, window: int) -> None:
    raw = __import__("json").loads((DEFAULT_MODEL / "config.json").read_text())
    raw.update(use_sliding_window=True, sliding_window=window, layer_types=["sliding_attention", "full_attention"] * 2)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(__import__("json").dumps(raw))


@pytest.mark.parametrize("script,how", [("l13_smoke", "--window 1"), ("l13_smoke", "config"), ("l1_smoke", "config")])
def test_a_window_of_1_is_refused_with_the_reason(script, how, tmp_path, capsys):
    """HF's sliding cache keeps `[-sliding_window + 1:]`, every key for a window of 1, so a window
    of 1 FAILed (exit 1) against an oracle that does not slide. Refused at the door: one line, exit 2,
    naming why; a window of 2 still loads."""
    if how == "config":
        folder = _model_copy(tmp_path)
        _hybrid_config(folder, 1)
        argv = ["--model", str(folder), *SHORT]
    else:
        argv = ["--window", "1", *SHORT]
    status, err = run_in_process(script, argv, capsys)
    assert_one_line_error(status, err, (script, how))
    assert "window of 1" in err and "[0:]" in err, err
    from l1_contiguous import load_config

    two = _model_copy(tmp_path / "two")
    _hybrid_config(two, 2)
    assert load_config(two).sliding_window == 2


def test_l13_names_the_users_weights_file_not_its_temporary_copy(tmp_path, capsys):
    """L13 runs a full-attention model as a hybrid through a temporary folder of links: weights cut
    short must be named as the user's file, the one to fix."""
    folder = _model_copy(tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").write_bytes((DEFAULT_MODEL / "model.safetensors").read_bytes()[:100_000])
    status, err = run_in_process("l13_smoke", ["--model", str(folder), *SHORT], capsys)
    assert_one_line_error(status, err, "weights cut short")
    assert f"{folder}/model.safetensors" in err and "l13-hybrid-" not in err, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("tier_dir", ["/proc/self", "file"])
def test_l14_refuses_a_tier_folder_it_cannot_write_at_the_door(tier_dir, tmp_path, capsys):
    """/proc/self is a folder that refuses every file (to root too): the first block saved was a
    traceback and 3. One line naming --tier-dir, exit 2."""
    if tier_dir == "file":
        tier_dir = str(tmp_path / "a-file")
        Path(tier_dir).write_text("x")
    status, err = run_in_process("l14_smoke", ["--tier-dir", tier_dir, *SHORT], capsys)
    assert_one_line_error(status, err, tier_dir)
    assert "--tier-dir" in err, err


def test_out_of_memory_names_the_scripts_own_options(capsys):
    """`l12_smoke.py --block-size 100000000` runs out of memory, and the message named --kv-memory
    and --cache-len, options of L2 and L1 that L12 does not have. It names the script's own."""
    status, err = run_in_process("l12_smoke", ["--block-size", str(10**12), "--no-accuracy", *SHORT], capsys)
    assert_one_line_error(status, err, "blocks of 10**12 tokens")
    assert "out of memory" in err and "--block-size" in err and "--num-blocks" in err, err
    assert "--kv-memory" not in err and "--cache-len" not in err, err
