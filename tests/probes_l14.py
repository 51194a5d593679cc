"""L14's probes (see probes.py: under the judge, imported in the worker, beside the code they
drive). They build the stand-ins L14's tests hand to the student's functions, watch a connector
from inside, and start the two-process runs, whose processes must run where the student's code
runs. They record and return plain data and judge nothing: every check is the test's."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from l14_kv_transfer import KvConnector, OffloadConnector, read_block

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "scripts" / "l14_smoke.py"


def fake_request(tokens: list[int], request_id: int = 0, cur_len: int = 0, blocks=None):
    """What the connector's scheduler side reads of a request, and nothing more."""
    return SimpleNamespace(tokens=list(tokens), request_id=request_id, cur_len=cur_len, blocks=list(blocks or []))


def scratch_folder() -> str:
    """A new folder the student's code may write (under the judge: made by the worker, as its user;
    removed when the process ends)."""
    folder = tempfile.mkdtemp(prefix="l14-test-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def write_file(path, data: bytes) -> None:
    """Written by the student's side (under the judge: the worker, as its user): the judge never
    opens a path the worker names."""
    Path(path).write_bytes(data)


def cut_file(path, cut: int) -> None:
    """The file at `path` without its last `cut` bytes (a write the disk did not finish)."""
    Path(path).write_bytes(Path(path).read_bytes()[:-cut])


def file_exists(path) -> bool:
    return Path(path).exists()


def connector_state(connector) -> dict:
    """The connector and its store as plain data: what a side-effect-free call must leave alone."""
    store = connector.store
    return {"pending": sorted(connector.pending_loads), "counters": dict(vars(connector.counters)),
            "tiers": [(list(t.order), t.bytes_read, t.bytes_written) for t in store.tiers],
            "loads_by_tier": list(store.loads_by_tier), "dropped": store.dropped}


class HoldingConnector(KvConnector):
    """Keeps every finished request's blocks until the test has moved them (as a send would), and
    reports the ids in `released` as done."""

    def __init__(self):
        super().__init__()
        self.held, self.released = [], set()

    def request_finished(self, req) -> bool:
        self.held.append(req)
        return True

    def get_finished(self) -> set[int]:
        return set(self.released)


class RecordingConnector(OffloadConnector):
    """Compares each block right after it is loaded with what the store holds, byte for byte, and
    counts the blocks checked and the ones that differed."""

    checked = differed = 0

    def start_load_kv(self, meta, pool):
        super().start_load_kv(meta, pool)
        for job in meta.loads:
            for block, key in zip(job.blocks, job.keys):
                stored = next(t for t in self.store.tiers if key in t)._read(key)
                self.checked += 1
                self.differed += not torch.equal(read_block(pool, block).view(torch.uint8), stored.view(torch.uint8))


def use_connector(engine, connector) -> None:
    engine.connector = connector


def fail_next_forward(engine) -> None:
    """The engine's next forward raises RuntimeError("injected"); the ones after it run."""
    forward = engine.runner.forward_logits
    state = {"failed": False}

    def once(*args, **kwargs):
        if not state["failed"]:
            state["failed"] = True
            raise RuntimeError("injected")
        return forward(*args, **kwargs)

    engine.runner.forward_logits = once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def torchrun_smoke(argv: list[str], timeout: float = 240, script=SMOKE) -> dict:
    """`torchrun --nproc-per-node 2 scripts/l14_smoke.py ARGV`: its exit status and output."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script), *argv],
                          capture_output=True, text=True, timeout=timeout, env=_env())
    return {"status": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def signal_rank(argv: list[str], rank: int, signum: int, after: str, timeout: float = 120) -> dict:
    """Start both ranks by hand (torchrun would stop the other rank as soon as one ends), send
    `signum` to `rank` once rank 0 prints a line starting with `after`, and let both end. Each
    rank's exit status and output; `seconds_after` is how long the last one took after the signal."""
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    command = [sys.executable, str(SMOKE), *argv]
    decode = subprocess.Popen(command, env={**env, "RANK": "1", "LOCAL_RANK": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    prefill = subprocess.Popen(command, env={**env, "RANK": "0", "LOCAL_RANK": "0"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    seen, signalled_at = [], None
    try:
        for line in prefill.stdout:
            seen.append(line)
            if line.startswith(after) and signalled_at is None:
                (prefill, decode)[rank].send_signal(signum)
                signalled_at = time.monotonic()
        out, err = decode.communicate(timeout=timeout)
        prefill.wait(timeout=timeout)
        waited = time.monotonic() - signalled_at if signalled_at is not None else None
    finally:
        for proc in (prefill, decode):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return {"prefill_lines": seen, "signalled": signalled_at is not None, "seconds_after": waited,
            "prefill_status": prefill.returncode, "status": decode.returncode, "stdout": out, "stderr": err}
