"""Building csrc/paged_attention.cu two ways (for the GPU with nvcc, and for the CPU emulation),
and csrc/paged_attention_cpu.cpp, the same algorithm written for a CPU's cores.

- `load_extension()`: torch's cpp_extension (nvcc + ninja) builds binding.cpp and the kernel for
  the current GPU's architecture; the build directory is keyed by that architecture.
- `load_emulation()`: the host C++ compiler builds the same kernel source against
  csrc/cuda_emulation.h (no CUDA toolkit) into a shared library, cached under a directory keyed
  by the sources' hash, and called through ctypes.
- `load_cpu_kernel()`: the host C++ compiler builds paged_attention_cpu.cpp the same way.

Each build runs at most once per process: a failure is remembered and raised again, one line,
without rebuilding (an engine would otherwise retry a minute-long build on every decode step).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from l1_contiguous.errors import InputError

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
KERNEL_SOURCE = CSRC_DIR / "paged_attention.cu"  # plain CUDA, compiles with `nvcc -c` alone
BINDING_SOURCE = CSRC_DIR / "binding.cpp"
EMULATION_HEADER = CSRC_DIR / "cuda_emulation.h"
LAUNCH_HEADER = CSRC_DIR / "cuda_launch.h"  # the launch macro and warp width, shared with L4's kernel
EMULATION_BINDING = CSRC_DIR / "emulation_binding.cpp"
EMULATION_SHIMS = CSRC_DIR / "emulation"  # cuda_runtime.h, cuda_fp16.h, cuda_bf16.h -> cuda_emulation.h
EXTENSION_NAME = "l3_paged_attention"
# -fno-strict-aliasing: the kernel reads rows through reinterpret_cast<Vec*>, fine for nvcc,
# undefined for g++'s optimiser. -U_FORTIFY_SOURCE: the fibers switch stacks with _longjmp, which
# the fortified longjmp refuses.
EMULATION_FLAGS = ("-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing",
                   "-U_FORTIFY_SOURCE", "-Wall", "-Wno-unknown-pragmas")
CPU_KERNEL_SOURCE = CSRC_DIR / "paged_attention_cpu.cpp"
KV_CODES_HEADER = CSRC_DIR / "kv_codes.h"  # L12's one-byte codes on a CPU, shared with L4's CPU kernel
OPENMP_HEADER = CSRC_DIR / "openmp_threads.h"  # shared with L4's CPU kernel too


def _torch_runs_on_gnu_openmp() -> bool:
    """Whether this process's torch takes its intra-op threads from GNU OpenMP loaded as
    libgomp.so.1 (as Linux wheels do). A library built with -fopenmp asks for libgomp.so.1, and the
    loader hands it the one already loaded, so it shares torch's threads. Where that name differs
    (a renamed copy), or with another OpenMP (macOS's, Intel's), it would start a second set of
    threads competing with torch's: the kernel is then built without OpenMP."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return False
    return any(line.endswith("/libgomp.so.1") for line in maps.splitlines())


def _cpu_has_avx2_fma() -> bool:
    """Whether this CPU has AVX2 and FMA (x86 from 2013 on): 8 floats per instruction, not 4."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:  # not Linux
        return False
    return "avx2" in flags and "fma" in flags


# -O3 for the vectoriser. -mavx2 -mfma only where this CPU has them (decode attention ~20% faster
# than SSE2's 4-wide; not -march=native, which would tie the library to one CPU model): the flags
# are part of the cache key, so a machine without them builds its own. -fopenmp is optional: a
# compiler without GNU OpenMP (clang without libomp, say) builds a kernel that runs on the calling
# thread alone.
CPU_KERNEL_FLAGS = ("-std=c++17", "-O3", "-shared", "-fPIC", "-Wall",
                    *(("-mavx2", "-mfma") if _cpu_has_avx2_fma() else ()))
CPU_KERNEL_OPTIONAL_FLAGS = ("-fopenmp",) if _torch_runs_on_gnu_openmp() else ()


class BuildOnce:
    """Calls `build` the first time, then returns its result, or raises its error again. Thread-safe:
    a second caller waits for the build in progress (a server's threads, a build started early in
    the background) instead of starting its own."""

    def __init__(self, build):
        self._build = build
        self._result = None
        self._error: InputError | None = None
        self._lock = threading.Lock()

    def __call__(self):
        result = self._result  # built: no lock (a hot path calls this once per operation)
        if result is not None:
            return result
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._result is None:
                try:
                    self._result = self._build()
                except InputError as exc:
                    self._error = exc
                    raise
            return self._result

    def cache_clear(self) -> None:
        with self._lock:
            self._result, self._error = None, None


# ---------------------------------------------------------------- the CUDA extension


def _nvcc_version() -> str | None:
    """The CUDA release of the nvcc that cpp_extension will use ("12.8"), or None without one."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = str(Path(home) / "bin" / "nvcc") if home else shutil.which("nvcc")
    if nvcc is None or not Path(nvcc).exists():
        return None
    found = re.search(r"release (\d+\.\d+)", subprocess.run([nvcc, "--version"], capture_output=True,
                                                             text=True).stdout)
    return found.group(1) if found else None


def check_cuda_toolchain() -> None:
    """One-line InputError unless torch has CUDA and nvcc's CUDA major version matches torch's."""
    if torch.version.cuda is None:
        raise InputError("the course's CUDA kernels (L3, L4) need a CUDA build of torch (this one is CPU-only); "
                         "install one from https://pytorch.org/get-started/locally/")
    nvcc = _nvcc_version()
    if nvcc is None:
        raise InputError(f"the CUDA kernels (L3, L4) need nvcc: install the CUDA {torch.version.cuda} toolkit "
                         "and set CUDA_HOME to it")
    if nvcc.split(".")[0] != torch.version.cuda.split(".")[0]:
        raise InputError(f"nvcc is CUDA {nvcc} but torch was built with CUDA {torch.version.cuda}: install "
                         f"the CUDA {torch.version.cuda.split('.')[0]}.x toolkit and point CUDA_HOME at it, "
                         f"or a torch built for CUDA {nvcc.split('.')[0]}")
    if shutil.which("ninja") is None:
        raise InputError("torch's cpp_extension needs ninja: pip install ninja")


def cuda_arch() -> str:
    """The current GPU's compute capability as nvcc writes it, e.g. "90" for an H100."""
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def build_cuda_extension(name: str, sources: list[Path], what: str):
    """torch's cpp_extension build of `sources` for the current GPU, as module `name`_sm<arch>;
    a failure becomes a one-line InputError naming `what`."""
    from torch.utils import cpp_extension

    check_cuda_toolchain()
    arch = cuda_arch()
    try:
        # The name picks the build directory under TORCH_EXTENSIONS_DIR: one per architecture,
        # so a shared cache never hands an sm_80 binary to an sm_90 GPU. An explicit -gencode
        # also stops torch from adding flags for every architecture it knows.
        # NOTE: -O3 without --use_fast_math: fast math would flush denormals and turn the final
        # division into an approximation, and the kernel is memory-bound, so it would gain nothing.
        return cpp_extension.load(name=f"{name}_sm{arch}", sources=[str(path) for path in sources],
                                  extra_cflags=["-O3"],
                                  extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"])
    except Exception as exc:  # a compiler error, most often
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"cannot build {what} for sm_{arch} ({first_line}); "
                         "use backend='reference' or 'emulated' meanwhile") from exc


load_extension = BuildOnce(lambda: build_cuda_extension(EXTENSION_NAME, [BINDING_SOURCE, KERNEL_SOURCE],
                                                         "the L3 CUDA extension"))
load_extension.__doc__ = """Builds the CUDA extension on first use (a minute or so), then returns the module.

torch keeps the build under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) and rebuilds
only when a source changes, so a later process loads it in about a second."""


# ---------------------------------------------------------------- libraries built by the host compiler


@dataclass(frozen=True)
class HostBuild:
    """A shared library the host C++ compiler builds from csrc, cached under a folder keyed by the
    hash of the compiler, the flags and the sources, and called through ctypes. A compiler that
    refuses `optional_flags` gets a second try without them."""

    what: str                    # for messages: "the CPU emulation of the L3 kernel"
    backend: str                 # the paged_attention backend it serves
    standard: str                # the C++ standard the sources need, for messages
    flags: tuple[str, ...]
    sources: tuple[Path, ...]    # every file whose bytes go into the cache key
    inputs: tuple[str, ...]      # the compiler's include and source arguments
    filename: str
    bind: Callable[[ctypes.CDLL], ctypes.CDLL]
    optional_flags: tuple[str, ...] = ()

    def library(self, compiler: str) -> Path:
        digest = hashlib.sha256(" ".join((compiler, *self.flags, *self.optional_flags)).encode())
        for path in self.sources:
            digest.update(path.read_bytes())
        return host_cache_dir() / f"{Path(self.filename).stem}-{digest.hexdigest()[:16]}" / self.filename


def host_compiler() -> str | None:
    """$CXX, else g++, else clang++ (any of them must speak C++20)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def host_cache_dir() -> Path:
    """$L3_EMULATION_CACHE, else $XDG_CACHE_HOME/l3_block_kernel, else ~/.cache/l3_block_kernel."""
    if os.environ.get("L3_EMULATION_CACHE"):
        return Path(os.environ["L3_EMULATION_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "l3_block_kernel"


def build_host(build: HostBuild) -> ctypes.CDLL:
    compiler = host_compiler()
    if compiler is None:
        raise InputError(f"backend={build.backend!r} needs a {build.standard} compiler: install g++ or clang++ "
                         "(or set CXX)")
    library = build.library(compiler)
    if library.exists():
        try:
            return build.bind(ctypes.CDLL(str(library)))
        except (OSError, AttributeError):  # a cut or corrupt file (a full disk, a killed copy): rebuild it
            pass
    try:
        _compile_into(build, compiler, library)
    except OSError as exc:  # the cache folder cannot be written: permissions, a full disk, read-only
        raise InputError(f"cannot write the L3 build cache {library.parent} ({exc.strerror or exc}); "
                         f"set L3_EMULATION_CACHE to a writable folder") from None
    return build.bind(ctypes.CDLL(str(library)))


STALE_BUILD_S = 600  # a temporary build folder older than this belongs to a process that died


def _compile_into(build: HostBuild, compiler: str, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(library.parent)
    # Compile to a temporary name, then rename: two processes building at once never load half a file.
    with tempfile.TemporaryDirectory(dir=library.parent, prefix="building-") as tmp:
        partial = Path(tmp) / library.name

        def compile_with(flags):
            return _run_compiler([compiler, *flags, *build.inputs, "-o", str(partial)])

        result = compile_with((*build.flags, *build.optional_flags))
        if result.returncode != 0 and build.optional_flags:
            result = compile_with(build.flags)
        if result.returncode != 0:
            first = next((line for line in result.stderr.splitlines() if "error" in line),
                         result.stderr.strip() or f"exit status {result.returncode}, no message")
            raise InputError(f"cannot build {build.what} with {compiler} (it needs {build.standard}): {first[:300]}")
        os.replace(partial, library)


def _run_compiler(command: list[str]) -> subprocess.CompletedProcess:
    """The compiler in a process group of its own: if we are interrupted (Ctrl-C, or SIGTERM,
    which the entry points turn into the same exception), the whole group (the driver and the
    cc1plus/as/ld it started) is killed before the temporary folder goes, so none is orphaned."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _remove_stale_builds(folder: Path) -> None:
    """Temporary build folders left by a process killed outright (SIGKILL cannot be cleaned up after)."""
    now = time.time()
    for old in folder.glob("building-*"):
        try:
            if now - old.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


# ---------------------------------------------------------------- the CPU emulation of the kernel


def _bind_emulation(library: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn = library.l3_emulated_paged_attention
    fn.restype = ctypes.c_char_p
    # ..., scale, dtype, cache_format, k_scales, v_scales, partition_size, partial_ml, partial_acc, window_starts
    fn.argtypes = [ptr] * 6 + [i32] * 6 + [ctypes.c_float, i32, i32, ptr, ptr, i32, ptr, ptr, ptr]
    for name in ("l3_emulated_to_16bit", "l3_emulated_from_16bit"):
        getattr(library, name).argtypes = [ptr, ptr, ctypes.c_int64, i32]
    return library


EMULATION_BUILD = HostBuild(
    what="the CPU emulation of the L3 kernel", backend="emulated", standard="C++20", flags=EMULATION_FLAGS,
    sources=(KERNEL_SOURCE, CSRC_DIR / "paged_attention.h", LAUNCH_HEADER, EMULATION_HEADER, EMULATION_BINDING,
             *sorted(EMULATION_SHIMS.glob("*.h"))),
    inputs=(f"-I{EMULATION_SHIMS}", f"-I{CSRC_DIR}", "-x", "c++", str(KERNEL_SOURCE), "-x", "c++", str(EMULATION_BINDING)),
    filename="paged_attention_emulated.so", bind=_bind_emulation)

load_emulation = BuildOnce(lambda: build_host(EMULATION_BUILD))
load_emulation.__doc__ = """Builds the kernel's CPU emulation on first use (~30 s), then returns the ctypes library."""


# ---------------------------------------------------------------- the kernel's algorithm for a CPU


def _bind_cpu_kernel(library: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn = library.l3_cpu_paged_attention
    fn.restype = ctypes.c_char_p
    # ..., scale, num_threads, cache_format, k_scales, v_scales, window_starts
    fn.argtypes = [ptr] * 6 + [i32] * 7 + [ctypes.c_float, i32, i32, ptr, ptr, ptr]
    return library


CPU_KERNEL_BUILD = HostBuild(
    what="the L3 CPU kernel", backend="cpu", standard="C++17", flags=CPU_KERNEL_FLAGS,
    sources=(CPU_KERNEL_SOURCE, KV_CODES_HEADER, OPENMP_HEADER),
    inputs=("-x", "c++", str(CPU_KERNEL_SOURCE)), filename="paged_attention_cpu.so", bind=_bind_cpu_kernel,
    optional_flags=CPU_KERNEL_OPTIONAL_FLAGS)

load_cpu_kernel = BuildOnce(lambda: build_host(CPU_KERNEL_BUILD))
load_cpu_kernel.__doc__ = """Builds csrc/paged_attention_cpu.cpp on first use (~1 s), then returns the ctypes library."""
