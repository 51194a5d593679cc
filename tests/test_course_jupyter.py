"""`make lab` works: a real Jupyter server, started as `make lab` starts it, lists every
notebook through its REST API, and is shut down within a bounded time whatever happens."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.course]

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S, STOP_TIMEOUT_S = 90, 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def stop(server: subprocess.Popen) -> None:
    """SIGINT twice is Jupyter's own shutdown; SIGKILL if it does not stop in time."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        time.sleep(0.5)
        server.send_signal(signal.SIGINT)  # the second one skips the "Shut down? (y/n)" prompt
        try:
            server.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(STOP_TIMEOUT_S)


def test_jupyterlab_serves_every_notebook(tmp_path):
    pytest.importorskip("jupyterlab", reason="JupyterLab is installed by `make setup`")
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}  # no user config, no stray server files
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={ROOT / 'notebooks'}"] + (["--allow-root"] if os.geteuid() == 0 else [])
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "server.log", "w"))
    try:
        url = f"http://127.0.0.1:{port}/api/contents?token={token}"
        deadline = time.monotonic() + START_TIMEOUT_S
        listing = None
        while listing is None and time.monotonic() < deadline and server.poll() is None:
            try:
                listing = get_json(url)
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        log = (tmp_path / "server.log").read_text()[-2000:]
        assert listing is not None, f"no answer from Jupyter on port {port}:\n{log}"
        notebooks = sorted(item["name"] for item in listing["content"] if item["type"] == "notebook")
        assert notebooks == sorted(p.name for p in (ROOT / "notebooks").glob("L*_*.ipynb"))
        assert len(notebooks) >= 5  # L1, L2, L3, L5, L8 and the lessons after them
        specs = get_json(f"http://127.0.0.1:{port}/api/kernelspecs?token={token}")
        assert "python3" in specs["kernelspecs"]  # the kernel the notebooks name, from this environment
    finally:
        stop(server)
    assert server.returncode is not None
