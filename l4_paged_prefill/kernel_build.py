"""Building L4's kernel three ways, with L3's build machinery (kernel_build.py there):

- `load_extension()`: csrc/paged_prefill.cu and csrc/binding.cpp for the current GPU (nvcc, ninja).
- `load_emulation()`: the same .cu file on the CPU, against L3's csrc/cuda_emulation.h.
- `load_cpu_kernel()`: csrc/paged_prefill_cpu.cpp, the algorithm written for a CPU's cores.

Each builds at most once per process, into L3's cache folder, keyed by the sources' hash.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from l3_block_kernel.kernel_build import (CPU_KERNEL_FLAGS, CPU_KERNEL_OPTIONAL_FLAGS, CSRC_DIR as L3_CSRC_DIR,
                                          EMULATION_FLAGS, EMULATION_HEADER, EMULATION_SHIMS, KV_CODES_HEADER,
                                          LAUNCH_HEADER, OPENMP_HEADER, BuildOnce, HostBuild, build_cuda_extension,
                                          build_host)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
KERNEL_SOURCE = CSRC_DIR / "paged_prefill.cu"
HEADER = CSRC_DIR / "paged_prefill.h"
CPU_KERNEL_SOURCE = CSRC_DIR / "paged_prefill_cpu.cpp"
EMULATION_BINDING = CSRC_DIR / "emulation_binding.cpp"

load_extension = BuildOnce(lambda: build_cuda_extension("l4_paged_prefill", [CSRC_DIR / "binding.cpp", KERNEL_SOURCE],
                                                        "the L4 CUDA extension"))
load_extension.__doc__ = "Builds the CUDA extension on first use (a minute or so), then returns the module."

# out, lse, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables; num_seqs ... max_query_len;
# scale; window, key_begin, causal, and the dtype (emulation) or the thread count (CPU kernel).
_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 9 + [ctypes.c_float] + [ctypes.c_int] * 4
# The CPU kernel's last three: cache_format, k_scales, v_scales (L12's codes).
_CPU_ARGTYPES = [*_ARGTYPES, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]


def _bind(symbol: str, argtypes: list):
    def bind(library: ctypes.CDLL) -> ctypes.CDLL:
        fn = getattr(library, symbol)
        fn.restype, fn.argtypes = ctypes.c_char_p, argtypes
        return library
    return bind


EMULATION_BUILD = HostBuild(
    what="the CPU emulation of the L4 kernel", backend="emulated", standard="C++20", flags=EMULATION_FLAGS,
    sources=(KERNEL_SOURCE, HEADER, LAUNCH_HEADER, EMULATION_BINDING, EMULATION_HEADER,
             *sorted(EMULATION_SHIMS.glob("*.h"))),
    inputs=(f"-I{EMULATION_SHIMS}", f"-I{L3_CSRC_DIR}", f"-I{CSRC_DIR}", "-x", "c++", str(KERNEL_SOURCE),
            "-x", "c++", str(EMULATION_BINDING)),
    filename="paged_prefill_emulated.so", bind=_bind("l4_emulated_paged_prefill", _ARGTYPES))

# Without it GCC keeps the softmax's exp loop scalar (std::floor might raise a floating-point
# exception the program could observe; nothing here does): the loop is most of a decode row's softmax.
NO_TRAPS = ("-fno-trapping-math",)

CPU_KERNEL_BUILD = HostBuild(
    what="the L4 CPU kernel", backend="cpu", standard="C++17", flags=(*CPU_KERNEL_FLAGS, "-fopenmp-simd", *NO_TRAPS),
    sources=(CPU_KERNEL_SOURCE, HEADER, KV_CODES_HEADER, OPENMP_HEADER),
    inputs=(f"-I{CSRC_DIR}", f"-I{L3_CSRC_DIR}", "-x", "c++", str(CPU_KERNEL_SOURCE)),
    filename="paged_prefill_cpu.so", bind=_bind("l4_cpu_paged_prefill", _CPU_ARGTYPES),
    optional_flags=CPU_KERNEL_OPTIONAL_FLAGS)

load_emulation = BuildOnce(lambda: build_host(EMULATION_BUILD))
load_emulation.__doc__ = "Builds the kernel's CPU emulation on first use (~30 s), then returns the ctypes library."
load_cpu_kernel = BuildOnce(lambda: build_host(CPU_KERNEL_BUILD))
load_cpu_kernel.__doc__ = "Builds csrc/paged_prefill_cpu.cpp on first use (~2 s), then returns the ctypes library."
