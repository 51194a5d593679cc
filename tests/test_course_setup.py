"""The set-up's torch step (scripts/install_torch.py, run by `make setup` and the autograder's
setup.sh) on a machine that reaches PyPI but not PyTorch's CPU index: it must still succeed, say
so in one line, and never wait on pip's retries. The full set-up, as the README prints it and
without the system's site-packages, is what `.ci/run` itself does."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path

import pytest

from helpers import load_script

pytestmark = [pytest.mark.course]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "install_torch.py"


def unused_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connecting to it is refused


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A new environment with pip and nothing else, the system's site-packages left out."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(where)
    return where / "bin" / "python"


def test_an_unreachable_cpu_index_falls_back_to_the_default_index(bare_venv):
    """Resolved for real (pip --dry-run) into an environment without torch: exit 0, torch 2.13.0
    chosen from the default index, one line naming the unreachable index; in seconds."""
    index = f"http://127.0.0.1:{unused_loopback_port()}/whl/cpu"
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(SCRIPT), "--python", str(bare_venv), "--build", "cpu",
                          "--cpu-index", index, "--dry-run"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    notes = [line for line in run.stdout.splitlines() if line.startswith("install_torch:")]
    assert len(notes) == 1 and index in notes[0] and "cannot be reached" in notes[0], run.stdout[-2000:]
    report = json.loads(run.stdout[run.stdout.index("{"):])
    chosen = {item["metadata"]["name"]: item["metadata"]["version"] for item in report["install"]}
    assert chosen["torch"].startswith("2.13.0"), chosen
    assert time.monotonic() - started < 300


def test_a_reachable_cpu_index_is_added_beside_the_default_one():
    """With the CPU index answering, it is an extra index: torch's dependencies still come from
    the default index (an --index-url would have lost PyPI, the bug this replaces)."""

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html></html>")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        tool = load_script("install_torch")
        command = tool.pip_command(tool.parse_args(["--python", sys.executable, "--build", "cpu",
                                                    "--cpu-index", index]))
        assert command[command.index("--extra-index-url") + 1] == index
        assert "--index-url" not in command
        assert tool.index_unreachable_reason(index) is None
    finally:
        server.shutdown()


def test_a_silent_index_costs_the_probe_timeout_only():
    """A host that accepts the connection and never answers: the probe gives up after its timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        tool = load_script("install_torch")
        started = time.monotonic()
        reason = tool.index_unreachable_reason(f"http://127.0.0.1:{listener.getsockname()[1]}/cpu", timeout=1.0)
        assert reason is not None and time.monotonic() - started < 10


def test_an_importable_torch_is_kept():
    run = subprocess.run([sys.executable, str(SCRIPT), "--python", sys.executable], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "already importable: kept" in run.stdout, run.stdout + run.stderr


def readme_commands() -> list[str]:
    """The commands of the README's getting-started and grading blocks, comments cut."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Getting started")
    block = readme[readme.index("```", start) + 3:]
    block = block[:block.index("```")]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_set_up_paths_call_the_installer():
    """The Makefile and the autograder's setup.sh both go through the installer; CI runs the
    README's commands exactly as printed, then a second environment without the system's
    site-packages."""
    makefile = (ROOT / "Makefile").read_text()
    assert "scripts/install_torch.py" in makefile and "--index-url" not in makefile
    setup_sh = (ROOT / "instructor" / "autograder" / "setup.sh").read_text()
    assert "scripts/install_torch.py" in setup_sh and "--index-url" not in setup_sh
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = readme_commands()
    assert commands[:2] == ["make setup", "source .venv/bin/activate"], commands
    for command in [*commands, "make test"]:
        assert command in ci, f"{command!r} (the README's) is not a line of .ci/run"
    assert ci.index("make setup") < ci.index("make test")
    assert "make run VENV=.venv-isolated ISOLATED=1" in ci


def test_make_run_runs_the_smoke_scripts_in_lesson_order():
    """`make run` went l10, l11, ..., l14, l1, l2 (the shell's sort); lesson order is numeric."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = next(line for line in makefile.splitlines() if "scripts/l*_smoke.py" in line and "for s in" in line)
    listing = recipe.split("$$(", 1)[1].split(")", 1)[0]  # the command that lists the scripts
    run = subprocess.run(["sh", "-c", listing], cwd=ROOT, capture_output=True, text=True, check=True)
    lessons = [int(Path(p).name[1:].split("_")[0]) for p in run.stdout.split()]
    assert lessons == sorted(lessons) and len(lessons) >= 10, lessons
