"""The engine's fused CPU operations: q/k norm, rotary and K/V write in one call, RMSNorm in one (csrc/engine_ops.cpp).

Between a layer's q/k/v product and its attention, PyTorch runs about fifteen small operations
(fused.py's `fused_project_qkv`), and inside a step, among a hundred others, each costs about ten
microseconds whatever its size: for one decoding request that is most of the layer's time. On a
CPU in float32, with a C++ compiler, the engine does them as one call into the library below
(built like L4's CPU kernel, with L3's build machinery, cached); elsewhere (CUDA, bf16, no
compiler) it keeps the PyTorch operations. The same holds for every RMSNorm: torch's F.rms_norm
on a CPU is itself a composite of several operations. Two calls take a neighbour's work too: the
q/k call writes the step's K and V into the pool's slots (`qk_norm_rope_write`, where the pool's
write is L2's plain one), and a norm adds the residual first (`add_rms_norm`). The arithmetic is
L1's (float32 RMSNorm, each head its own weight, rotate-half rotary from the step's cos/sin
tables), so the logits move by float rounding at most. Measured before and after:
scripts/bench_overhead.py ("qk fused", "norms", "add+norm", "kv in q/k", "host calls").
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


def _bind_engine_ops(library: ctypes.CDLL) -> ctypes.CDLL:
    qk, norm, add_norm, silu = (library.l5_qk_norm_rope, library.l5_rms_norm, library.l5_add_rms_norm,
                                library.l5_silu_mul)
    qk.restype = norm.restype = add_norm.restype = silu.restype = None
    pointer, int64, int32, float32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    # qkv, row_stride, num_rows, num_heads, head_dim, weight, eps, cos, sin, out
    qk.argtypes = [pointer, int64, int32, int32, int32, pointer, float32, pointer, pointer, pointer]
    norm.argtypes = [pointer, int64, int32, int32, pointer, float32, pointer]  # x, row_stride, num_rows, dim, weight, eps, out
    # x, x_stride, residual, num_rows, dim, weight, eps, out
    add_norm.argtypes = [pointer, int64, pointer, int32, int32, pointer, float32, pointer]
    silu.argtypes = [pointer, int32, int32, pointer]  # gate_up, num_rows, width, out
    write = library.l5_qk_norm_rope_write
    write.restype = ctypes.c_char_p  # None, or what was wrong
    # qkv, row_stride, num_rows, num_heads, num_kv_heads, head_dim, weight, eps, cos, sin, q_out, k_cache,
    # v_cache, slot_mapping, num_slots
    write.argtypes = [pointer, int64, int32, int32, int32, int32, pointer, float32, pointer, pointer, pointer,
                      pointer, pointer, pointer, int64]
    return library


BUILD = HostBuild(what="the engine's fused CPU operations", backend="cpu", standard="C++17",
                  flags=(*CPU_KERNEL_FLAGS, "-fopenmp-simd"),
                  sources=(SOURCE,), inputs=("-x", "c++", str(SOURCE)), filename="engine_ops.so", bind=_bind_engine_ops)
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


# Each wrapper below is one C++ call plus what it cannot avoid (an output tensor, the pointers):
# a step calls them a few dozen times, so they read each size once and reshape only when they must.

def host_op_applies(x: torch.Tensor) -> bool:
    """A C++ call serves float32 tensors on a CPU whose rows are contiguous, where it builds."""
    return x.is_cpu and x.dtype == torch.float32 and x.stride(-1) == 1 and engine_ops_build()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] (rows contiguous) -> [..., dim]: x / sqrt(mean(x^2) + eps) * weight, float32."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a step's hidden states are 2-D already
    num_rows, dim = rows.shape
    out = torch.empty(num_rows, dim)
    load_engine_ops().l5_rms_norm(rows.data_ptr(), rows.stride(0), num_rows, dim, weight.data_ptr(), eps,
                                  out.data_ptr())
    return out if rows is x else out.view(x.shape)


def add_rms_norm_applies(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """`add_rms_norm` serves 2-D float32 rows on a CPU, the residual contiguous (it is written)."""
    return x.dim() == 2 and residual.shape == x.shape and residual.is_contiguous() and host_op_applies(x) \
        and host_op_applies(residual)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, residual [T, dim]: residual += x (in place), then -> rms_norm(residual, weight, eps) [T, dim]."""
    num_rows, dim = x.shape
    out = torch.empty(num_rows, dim)
    load_engine_ops().l5_add_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), num_rows, dim,
                                      weight.data_ptr(), eps, out.data_ptr())
    return out


# silu_mul's loop calls exp once per element, unvectorised: past a few decode rows torch's
# vectorised F.silu wins, so larger products keep the three torch operations.
SILU_MUL_MAX_ELEMENTS = 8192


def silu_mul_applies(gate_up: torch.Tensor) -> bool:
    return gate_up.numel() <= 2 * SILU_MUL_MAX_ELEMENTS and gate_up.is_contiguous() and host_op_applies(gate_up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (contiguous) -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, width)
    load_engine_ops().l5_silu_mul(gate_up.data_ptr(), num_rows, width, out.data_ptr())
    return out


def fused_qk_applies(qkv: torch.Tensor, cos: torch.Tensor) -> bool:
    """`qk_norm_rope` serves these (and the step's cos/sin tables, float32 and contiguous)."""
    return host_op_applies(qkv) and cos.dtype == torch.float32 and cos.is_contiguous()


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, head_dim: int, weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qkv [T, >= num_heads * head_dim] (the first num_heads heads are read) -> [T, num_heads, head_dim]:
    each head RMS-normalised, times its row of weight [num_heads, head_dim], rotated by cos/sin [T, D]."""
    num_rows = qkv.shape[0]
    out = torch.empty(num_rows, num_heads, head_dim)
    load_engine_ops().l5_qk_norm_rope(qkv.data_ptr(), qkv.stride(0), num_rows, num_heads, head_dim,
                                      weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


def qk_norm_rope_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, weight: torch.Tensor,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                       slot_mapping: torch.Tensor) -> torch.Tensor:
    """`qk_norm_rope` and the cache step's write in one call: qkv [T, (H + 2 H_kv) D] -> q [T, H, D],
    normed and rotated; row t's k (normed, rotated) and v written to slot slot_mapping[t] (int64
    [T], contiguous) of k_slots, v_slots [num_slots, H_kv, D] (float32, contiguous), in place.
    A slot outside them: InputError, nothing written."""
    num_rows = qkv.shape[0]
    q = torch.empty(num_rows, num_heads, head_dim)
    error = load_engine_ops().l5_qk_norm_rope_write(
        qkv.data_ptr(), qkv.stride(0), num_rows, num_heads, num_kv_heads, head_dim, weight.data_ptr(), eps,
        cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), slot_mapping.data_ptr(),
        k_slots.shape[0])
    if error is not None:
        raise InputError(f"{error.decode()} ({k_slots.shape[0]} slots)")
    return q
