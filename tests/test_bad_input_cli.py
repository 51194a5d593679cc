"""Every smoke script turns bad input into one line on stderr and exit status 2, never a traceback.

Each case runs a smoke script in-process (the same `run_smoke` its `__main__` calls) with one bad
option or one broken model folder, made from the embedded model in a temporary folder. Exit 1 is
kept for "ids differ from HF" and 3 for a bug: two subprocess cases check the real exit codes.
Provided code (the scripts and the harness): no points.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.smoke import DEFAULT_MODEL, run_smoke
from helpers import load_script

pytestmark = [pytest.mark.course, pytest.mark.usefixtures("one_torch_thread")]

ROOT = Path(__file__).resolve().parent.parent
# Every lesson's smoke script, in lesson order: a new lesson's script is checked as soon as it exists.
SCRIPTS = tuple(sorted((p.stem for p in (ROOT / "scripts").glob("l*_smoke.py")), key=lambda s: int(s[1:].split("_")[0])))
SHORT = ["--max-new-tokens", "2", "--prompt-ids", "5,6,7"]  # fast where a run gets that far
LONG = ["--max-new-tokens", "2", "--prompt-ids", ",".join(map(str, range(1, 41)))]  # 3 blocks of 16

# (script, argv): each one bad option; the model is the embedded one.
OPTION_CASES = [
    *[(s, ["--model", "no/such/folder/here"]) for s in SCRIPTS],
    *[(s, ["--max-new-tokens", "0"]) for s in SCRIPTS],
    *[(s, ["--prompt-ids", "1,x,3"]) for s in SCRIPTS],
    *[(s, ["--prompt-ids", "99999"]) for s in SCRIPTS],
    *[(s, ["--prompt-ids", "-1,2"]) for s in ("l1_smoke", "l5_smoke")],
    ("l2_smoke", ["--prompt-ids=-1,2"]),
    ("l2_smoke", ["--prompt-ids", ","]),
    ("l1_smoke", ["--prompt", "   "]),
    ("l3_smoke", ["--device", "cuda"] if not shutil.which("nvidia-smi") else ["--device", "tpu"]),
    ("l2_smoke", ["--dtype", "float64"]),
    ("l5_smoke", ["--no-such-option"]),
    ("l8_smoke", ["--max-new-tokens", "abc"]),
    ("l1_smoke", ["--max-new-tokens=-3"]),
    ("l2_smoke", ["--max-new-tokens", "100000"]),
    ("l1_smoke", ["--cache-len", "0", *SHORT]),
    ("l1_smoke", ["--cache-len", "3", *SHORT]),
    ("l1_smoke", ["--cache-len=-5", *SHORT]),
    ("l2_smoke", ["--block-size", "0", *SHORT]),
    ("l2_smoke", ["--block-size=-4", *SHORT]),
    ("l2_smoke", ["--num-blocks", "0", *SHORT]),
    ("l2_smoke", ["--num-blocks", "1", *LONG]),
    ("l2_smoke", ["--kv-memory", "abc", *SHORT]),
    ("l2_smoke", ["--kv-memory", "1B", *SHORT]),
    ("l2_smoke", ["--kv-memory", "1000000TiB", *SHORT]),
    ("l2_smoke", ["--num-blocks", "1000000000000", *SHORT]),
    ("l3_smoke", ["--backend", "bogus", *SHORT]),
    ("l3_smoke", ["--block-size", "0", *SHORT]),
    ("l3_smoke", ["--num-blocks", "1", *LONG]),
    ("l5_smoke", ["--num-blocks", "1000000000000", *SHORT]),
    ("l5_smoke", ["--num-blocks", "0", *SHORT]),
    ("l5_smoke", ["--num-blocks", "1", *LONG]),
    ("l5_smoke", ["--block-size", "0", *SHORT]),
    ("l5_smoke", ["--prefill-chunk", "0", *SHORT]),
    ("l5_smoke", ["--prefill-chunk=-1", *SHORT]),
    ("l5_smoke", ["--policy", "fifo", *SHORT]),
    ("l5_smoke", ["--preempt", "kill", *SHORT]),
    ("l8_smoke", ["--num-blocks", "1000000000000", *SHORT]),
    ("l8_smoke", ["--num-blocks", "1", *LONG]),
    ("l8_smoke", ["--n", "0", *SHORT]),
    ("l8_smoke", ["--n=-2", *SHORT]),
    ("l8_smoke", ["--n", "1000000", *SHORT]),  # a pool of 2 million blocks: more than the memory
    ("l8_smoke", ["--prefill-chunk", "0", *SHORT]),
    ("l8_smoke", ["--prefix-sharing", "maybe", *SHORT]),
    ("l8_smoke", ["--arrivals", "never", *SHORT]),
    ("l8_smoke", ["--block-size", "0", *SHORT]),
]


def _write(folder: Path, name: str, text: str) -> None:
    (folder / name).unlink(missing_ok=True)
    (folder / name).write_text(text)


def _config(folder: Path, **changes) -> None:
    raw = json.loads((DEFAULT_MODEL / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    _write(folder, "config.json", json.dumps(raw))


_DROP = object()

# name: how to break a copy of the embedded model (every file a symlink until it is replaced).
BROKEN_FOLDERS = {
    "config not JSON": lambda f: _write(f, "config.json", "{ this is not json"),
    "config a list": lambda f: _write(f, "config.json", "[1, 2, 3]"),
    "config field of the wrong type": lambda f: _config(f, hidden_size="256"),
    "config field null": lambda f: _config(f, vocab_size=None),
    "config field negative": lambda f: _config(f, num_hidden_layers=-1),
    "config field missing": lambda f: _config(f, intermediate_size=_DROP),
    "config another architecture": lambda f: _config(f, model_type="llama", architectures=["LlamaForCausalLM"]),
    "config heads not a multiple of kv heads": lambda f: _config(f, num_key_value_heads=3),
    "config head_dim that does not fit": lambda f: _config(f, head_dim=_DROP, hidden_size=250),
    "config shapes unlike the weights": lambda f: _config(f, intermediate_size=512),
    "config a broken symlink": lambda f: ((f / "config.json").unlink(), (f / "config.json").symlink_to(f / "gone")),
    "config a folder": lambda f: ((f / "config.json").unlink(), (f / "config.json").mkdir()),
    "config missing": lambda f: (f / "config.json").unlink(),
    "generation_config not JSON": lambda f: _write(f, "generation_config.json", "nope"),
    "generation_config eos not an id": lambda f: _write(f, "generation_config.json", '{"eos_token_id": "x"}'),
    "tokenizer.json not JSON": lambda f: _write(f, "tokenizer.json", "{broken"),
    "weights corrupt": lambda f: _write(f, "model.safetensors", "garbage" * 100),
    "weights truncated": lambda f: ((f / "model.safetensors").unlink(), (f / "model.safetensors").write_bytes(
        (DEFAULT_MODEL / "model.safetensors").read_bytes()[:100_000])),
    "weights missing": lambda f: (f / "model.safetensors").unlink(),
    "weights a folder": lambda f: ((f / "model.safetensors").unlink(), (f / "model.safetensors").mkdir()),
    # An index is read only without model.safetensors (as HF reads a folder): the single file goes.
    "index without weight_map": lambda f: ((f / "model.safetensors").unlink(),
                                           _write(f, "model.safetensors.index.json", '{"metadata": {}}')),
    "index naming a missing shard": lambda f: ((f / "model.safetensors").unlink(), _write(
        f, "model.safetensors.index.json", '{"weight_map": {"model.norm.weight": "shard-9.safetensors"}}')),
    "weights under another name only": lambda f: (f / "model.safetensors").rename(f / "weights.safetensors"),
    # shards named outside the folder are refused, not followed (the target exists: it would load)
    "index naming a shard up the tree": lambda f: ((f / "model.safetensors").rename(f.parent / "w.safetensors"), _write(
        f, "model.safetensors.index.json", '{"weight_map": {"model.norm.weight": "../w.safetensors"}}')),
    "index naming an absolute shard": lambda f: ((f / "model.safetensors").rename(f.parent / "w.safetensors"), _write(
        f, "model.safetensors.index.json", '{"weight_map": {"model.norm.weight": "%s"}}' % (f.parent / "w.safetensors"))),
}


def broken_copy(tmp_path: Path, breakage: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for src in DEFAULT_MODEL.iterdir():
        (folder / src.name).symlink_to(src)
    BROKEN_FOLDERS[breakage](folder)
    return folder


def run_in_process(script: str, argv: list[str], capsys) -> tuple[int, str]:
    module = load_script(script)
    try:
        status = run_smoke(module.LESSON, module.__doc__, module.run, getattr(module, "add_options", None),
                           argv=argv)
    except SystemExit as exc:  # argparse's errors
        status = exc.code
    return status, capsys.readouterr().err


def assert_one_line_error(status: int, err: str, what) -> None:
    assert status == 2, f"{what}: exit {status}, stderr: {err[-2000:]}"
    assert "Traceback" not in err, f"{what}: {err[-2000:]}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) > 20, (what, err)


@pytest.mark.parametrize("script,argv", OPTION_CASES, ids=[f"{s}:{' '.join(a)}" for s, a in OPTION_CASES])
def test_a_bad_option_is_one_line_and_exit_2(script, argv, capsys):
    status, err = run_in_process(script, argv, capsys)
    assert_one_line_error(status, err, (script, argv))


@pytest.mark.parametrize("script", ["l1_smoke", "l5_smoke"])
@pytest.mark.parametrize("breakage", list(BROKEN_FOLDERS))
def test_a_broken_model_folder_is_one_line_and_exit_2(breakage, script, tmp_path, capsys):
    folder = broken_copy(tmp_path, breakage)
    status, err = run_in_process(script, ["--model", str(folder), "--max-new-tokens", "2"], capsys)
    assert_one_line_error(status, err, breakage)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_config_says_permission_denied(tmp_path, capsys):
    folder = broken_copy(tmp_path, "config field negative")
    _config(folder)
    (folder / "config.json").chmod(0)
    status, err = run_in_process("l1_smoke", ["--model", str(folder)], capsys)
    assert_one_line_error(status, err, "unreadable")
    assert "permission" in err


def test_the_real_exit_codes_in_a_subprocess():
    """2 for bad input, 3 with a traceback for an internal error (never 1, which means 'ids differ')."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run([sys.executable, "scripts/l2_smoke.py", "--model", "no/such/dir/x"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    bug = ("import sys\nfrom harness.smoke import run_smoke\n"
           "def run(args, setup):\n    raise ZeroDivisionError('a bug')\n"
           "sys.exit(run_smoke('LX', 'a lesson with a bug', run, argv=['--max-new-tokens', '1']))\n")
    crash = subprocess.run([sys.executable, "-c", bug], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env=env)
    assert crash.returncode == 3, crash.stderr[-2000:]
    assert "Traceback" in crash.stderr and "ZeroDivisionError: a bug" in crash.stderr


def test_a_ctrl_c_that_python_wrapped_in_another_error_is_still_one_line_and_exit_2():
    """A KeyboardInterrupt inside a class body's __set_name__ (torch's import) reaches run_main as a
    RuntimeError caused by it; a plain RuntimeError is still a bug: traceback and 3."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ("import sys\nfrom harness.cli import run_main\n"
              "def main():\n    try:\n        raise KeyboardInterrupt\n"
              "    except KeyboardInterrupt as exc:\n        raise RuntimeError('{}') from exc\n"
              "sys.exit(run_main(main))\n")
    wrapped = subprocess.run([sys.executable, "-c", script.format("set_name")], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=env)
    assert wrapped.returncode == 2 and "Traceback" not in wrapped.stderr, wrapped.stderr[-2000:]
    assert wrapped.stderr.count("\n") == 1 and "interrupted" in wrapped.stderr
    plain = script.replace("raise KeyboardInterrupt", "raise ValueError").replace("except KeyboardInterrupt", "except ValueError")
    bug = subprocess.run([sys.executable, "-c", plain.format("a bug")], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert bug.returncode == 3 and "RuntimeError: a bug" in bug.stderr, bug.stderr[-2000:]


def test_an_unreadable_file_is_reported_as_unreadable(tmp_path, monkeypatch, capsys):
    """Root reads any file, so the permission error is raised the way the OS would raise it."""
    folder = broken_copy(tmp_path, "config field negative")
    _config(folder)
    real = Path.read_text

    def read_text(self, *args, **kwargs):
        if self.name == "config.json" and self.parent == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    status, err = run_in_process("l1_smoke", ["--model", str(folder)], capsys)
    assert_one_line_error(status, err, "unreadable")
    assert "permission denied" in err and "No such file" not in err
