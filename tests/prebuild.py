"""Compiles that tests wait for, started when the session starts instead of inside the first test
that needs them. The tests run one torch thread each (mostly), so on a 2-core machine a compiler
running beside them costs little wall time: g++ builds L3's and L4's CPU kernels and their emulations
(cached on disk, then reused by every later process), and nvcc compile-checks the CUDA source for
`test_kernel_compiles_for_the_oldest_supported_arch`, which then only collects the result.
Only what the selected tests need is started: a student's `make check-l1` starts nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from l3_block_kernel.kernel_build import KERNEL_SOURCE, load_cpu_kernel, load_emulation

NVCC_CHECK = "tests/test_l3_kernel.py::test_kernel_compiles_for_the_oldest_supported_arch"
# Files whose tests run the kernel's emulation; and every engine lesson's, which decode on the CPU kernel.
EMULATION_USERS = ("tests/test_l3_", "tests/test_l12_kernel.py", "tests/test_reliability_cli.py")
L4_EMULATION_USERS = ("tests/test_l4_", "tests/test_l12_")
CPU_KERNEL_USERS = ("tests/test_l4_", "tests/test_l5_", "tests/test_l8_", "tests/test_l10_", "tests/test_l11_",
                    "tests/test_l12_", "tests/test_l13_", "tests/test_l14_", "tests/test_bench", "tests/test_bf16")

_nvcc: tuple[subprocess.Popen, Path] | None = None


def nvcc_command(out: Path, archs: list[str], *flags: str, code: str = "sm",
                 source: Path = KERNEL_SOURCE) -> list[str] | None:
    """The compile check's nvcc call (None without nvcc), of L3's kernel unless `source` says another.
    code "sm": down to each arch's machine code (ptxas included); "compute": to PTX only, what the
    front end checks (templates, intrinsics)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    gencode = [f"-gencode=arch=compute_{a},code={code}_{a}" for a in archs]
    return [nvcc, "-c", "-std=c++17", "-O3", "--threads", "0", *flags, str(source), "-o", str(out), *gencode]


# make test's check: sm_75 to PTX, head_dim 128 only (16 s instead of 125 s on 2 cores).
OLDEST_ARCH_CHECK = dict(archs=["75"], flags=("-DPAGED_ATTENTION_COMPILE_CHECK",), code="compute")


def start(nodeids: list[str]) -> None:
    global _nvcc
    files = {n.split("::")[0] for n in nodeids}
    builds = []
    if any(f.startswith(EMULATION_USERS) for f in files):
        builds.append(load_emulation)
    l4_users = any(f.startswith(L4_EMULATION_USERS + CPU_KERNEL_USERS) for f in files)
    if l4_users:  # imported only here: a copy with L1 to L3 alone never needs it
        from l4_paged_prefill import kernel_build as l4_build
    if any(f.startswith(L4_EMULATION_USERS) for f in files):
        builds.append(l4_build.load_emulation)
    if builds or l4_users:
        builds[:0] = [l4_build.load_cpu_kernel, load_cpu_kernel] if l4_users else [load_cpu_kernel]
    if builds:
        threading.Thread(target=_build_all, args=(builds,), daemon=True, name="prebuild").start()
    # Under pytest-xdist every worker collects every test, and which one runs the check is not known
    # yet: the test then compiles itself, once, in its own worker.
    if NVCC_CHECK in nodeids and not os.environ.get("PYTEST_XDIST_WORKER"):
        out = Path(tempfile.mkdtemp(prefix="nvcc-check-")) / "paged_attention.o"
        check = OLDEST_ARCH_CHECK
        command = nvcc_command(out, check["archs"], *check["flags"], code=check["code"])
        if command is not None:
            _nvcc = (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)


def _build_all(builds) -> None:
    for build in builds:
        try:
            build()
        except Exception:  # the test that needs it calls it again and gets the same error (BuildOnce)
            pass


def take_nvcc_check() -> subprocess.Popen | None:
    """The oldest-arch compile check started at the session's start, if any (once)."""
    global _nvcc
    started, _nvcc = _nvcc, None
    return None if started is None else started[0]
