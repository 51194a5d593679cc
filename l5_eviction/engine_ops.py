"""The engine's fused CPU operations: q/k norm and rotary in one call, RMSNorm in one (csrc/engine_ops.cpp).

Between a layer's q/k/v product and its attention, PyTorch runs about fifteen small operations
(fused.py's `fused_project_qkv`), and inside a step, among a hundred others, each costs about ten
microseconds whatever its size: for one decoding request that is most of the layer's time. On a
CPU in float32, with a C++ compiler, the engine does them as one call into the library below
(built like L4's CPU kernel, with L3's build machinery, cached); elsewhere (CUDA, bf16, no
compiler) it keeps the PyTorch operations. The same holds for every RMSNorm: torch's F.rms_norm
on a CPU is itself a composite of several operations. The arithmetic is L1's (float32 RMSNorm,
each head its own weight, rotate-half rotary from the step's cos/sin tables), so the logits move
by float rounding at most. Measured before and after: scripts/bench_overhead.py ("qk fused",
"norms").
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from l1_contiguous import InputError
from l3_block_kernel.kernel_build import CPU_KERNEL_FLAGS, BuildOnce, HostBuild, build_host

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC_DIR / "engine_ops.cpp"


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    qk, norm, silu = library.l5_qk_norm_rope, library.l5_rms_norm, library.l5_silu_mul
    qk.restype = norm.restype = silu.restype = None
    # qkv, row_stride, num_rows, num_heads, head_dim, weight, eps, cos, sin, out
    qk.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    # x, row_stride, num_rows, dim, weight, eps, out
    norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                     ctypes.c_void_p]
    silu.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]  # gate_up, num_rows, width, out
    return library


BUILD = HostBuild(what="the engine's fused CPU operations", backend="cpu", standard="C++17",
                  flags=(*CPU_KERNEL_FLAGS, "-fopenmp-simd"),
                  sources=(SOURCE,), inputs=("-x", "c++", str(SOURCE)), filename="engine_ops.so", bind=_bind)
load_engine_ops = BuildOnce(lambda: build_host(BUILD))
load_engine_ops.__doc__ = "Builds csrc/engine_ops.cpp on first use (~1 s), then returns the ctypes library."


@functools.cache
def engine_ops_build() -> bool:
    """Whether the library builds here (once per process)."""
    try:
        load_engine_ops()
    except InputError:
        return False
    return True


def host_op_applies(x: torch.Tensor) -> bool:
    """A C++ call serves float32 tensors on a CPU whose rows are contiguous, where it builds."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 and engine_ops_build()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] (rows contiguous) -> [..., dim]: x / sqrt(mean(x^2) + eps) * weight, float32."""
    rows = x.reshape(-1, x.shape[-1])  # a view for the rows of a step's hidden states
    out = torch.empty(x.shape)
    load_engine_ops().l5_rms_norm(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1],
                                  weight.data_ptr(), eps, out.data_ptr())
    return out


# silu_mul's loop calls exp once per element, unvectorised: past a few decode rows torch's
# vectorised F.silu wins, so larger products keep the three torch operations.
SILU_MUL_MAX_ELEMENTS = 8192


def silu_mul_applies(gate_up: torch.Tensor) -> bool:
    return gate_up.numel() <= 2 * SILU_MUL_MAX_ELEMENTS and gate_up.is_contiguous() and host_op_applies(gate_up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (contiguous) -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
    width = gate_up.shape[-1] // 2
    out = torch.empty(gate_up.shape[0], width)
    load_engine_ops().l5_silu_mul(gate_up.data_ptr(), gate_up.shape[0], width, out.data_ptr())
    return out


def fused_qk_applies(qkv: torch.Tensor, cos: torch.Tensor) -> bool:
    """`qk_norm_rope` serves these (and the step's cos/sin tables, float32 and contiguous)."""
    return host_op_applies(qkv) and cos.dtype == torch.float32 and cos.is_contiguous()


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, head_dim: int, weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qkv [T, >= num_heads * head_dim] (the first num_heads heads are read) -> [T, num_heads, head_dim]:
    each head RMS-normalised, times its row of weight [num_heads, head_dim], rotated by cos/sin [T, D]."""
    out = torch.empty(qkv.shape[0], num_heads, head_dim)
    load_engine_ops().l5_qk_norm_rope(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, head_dim,
                                      weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out
