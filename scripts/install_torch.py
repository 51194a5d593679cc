#!/usr/bin/env python3
"""Install torch into an environment that cannot import one yet; the first step of `make setup`.

    python3 scripts/install_torch.py --python .venv/bin/python [--torch torch==2.13.0]
                                     [--build auto|cpu|cuda] [--cpu-index URL] [--dry-run]

Standard library only: it runs before anything is installed.

- An importable torch (CPU or CUDA, installed by hand or by the system) is kept: nothing is done.
- On Linux without an NVIDIA GPU (or with --build cpu) the CPU build is wanted: PyPI's Linux
  wheel is the CUDA build, a 0.5 GB wheel plus several GB of CUDA libraries. PyTorch's CPU index
  is added as an *extra* index, so torch's own dependencies still come from the default index
  (PyPI or whatever pip is configured with); `2.13.0+cpu` sorts above PyPI's `2.13.0`, so pip
  takes the CPU build.
- Where the CPU index cannot be reached (a firewalled lab or CI machine that reaches PyPI only),
  one line says so and torch comes from the default index: set-up never fails for that reason.
  The reachability check is one request with a short timeout, so an unreachable index costs
  seconds, not pip's minutes of retries.

Environment variables TORCH, TORCH_BUILD and TORCH_CPU_INDEX give the defaults (the Makefile
passes its own variables through them). Exit status: pip's, or 2 on a bad option.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

DEFAULT_TORCH = "torch==2.13.0"
DEFAULT_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 10.0


def has_nvidia_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def wants_cpu_build(build: str) -> bool:
    """macOS and Windows wheels on PyPI are CPU builds already; only Linux needs the CPU index."""
    if build == "cpu":
        return True
    if build == "cuda":
        return False
    return platform.system() == "Linux" and not has_nvidia_gpu()


def index_unreachable_reason(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the index answers; otherwise why not, in a few words."""
    probe = url.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(probe, timeout=timeout) as response:
            return None if response.status < 400 else f"HTTP {response.status}"
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return str(reason) or type(err).__name__


def torch_version_in(python: str) -> str | None:
    probe = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def pip_command(args: argparse.Namespace) -> list[str]:
    command = [args.python, "-m", "pip", "install", args.torch]
    if wants_cpu_build(args.build):
        reason = index_unreachable_reason(args.cpu_index)
        if reason is None:
            command += ["--extra-index-url", args.cpu_index]
        else:
            print(f"install_torch: PyTorch's CPU index {args.cpu_index} cannot be reached ({reason}); "
                  f"installing {args.torch} from the default index instead (on Linux that may be the "
                  f"CUDA build, several GB)", flush=True)
    if args.dry_run:
        command += ["--dry-run", "--quiet", "--report", "-"]
    return command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the environment's interpreter (default: this one)")
    parser.add_argument("--torch", default=os.environ.get("TORCH") or DEFAULT_TORCH,
                        help=f"the requirement to install (default {DEFAULT_TORCH})")
    parser.add_argument("--build", default=os.environ.get("TORCH_BUILD") or "auto",
                        choices=["auto", "cpu", "cuda"],
                        help="auto: the CPU build on Linux without an NVIDIA GPU")
    parser.add_argument("--cpu-index", default=os.environ.get("TORCH_CPU_INDEX") or DEFAULT_CPU_INDEX,
                        help="PyTorch's CPU wheel index")
    parser.add_argument("--dry-run", action="store_true",
                        help="resolve and report what pip would install; install nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.access(args.python, os.X_OK):
        print(f"install_torch: {args.python} is not an executable Python; give --python "
              f".venv/bin/python", file=sys.stderr)
        return 2
    if not args.dry_run:
        version = torch_version_in(args.python)
        if version is not None:
            print(f"install_torch: torch {version} is already importable: kept")
            return 0
    try:
        return subprocess.run(pip_command(args)).returncode
    except KeyboardInterrupt:
        print("install_torch: interrupted; run `make setup` again to finish", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
