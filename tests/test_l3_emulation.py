"""L3: the CUDA-on-CPU emulation itself (csrc/cuda_emulation.h), on small kernels written here.

Each kernel isolates one piece of CUDA's execution model that paged_attention.cu relies on: the
grid and thread indices, __shfl_xor_sync within a warp, __shared__ with __syncthreads within a
block, and the emulation's report when the threads of a block disagree on a barrier.
"""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from l3_block_kernel.kernel_build import CSRC_DIR, EMULATION_FLAGS, EMULATION_SHIMS, host_compiler

pytestmark = [pytest.mark.l3,
              pytest.mark.skipif(host_compiler() is None,
                                 reason="the CUDA emulation needs a C++20 compiler (g++ or clang++, or set CXX)")]

KERNELS = r"""
#include <cuda_runtime.h>

// out[block][thread] = the sum over the thread's warp of (lane + 1) * (block + 1), by butterfly.
__global__ void warp_sums(float* out) {
  float x = float(threadIdx.x % 32 + 1) * float(blockIdx.x + 1);
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  out[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

// Each block reverses its slice of `in` through shared memory; every thread must see the others' writes.
__global__ void reverse_slices(const float* in, float* out) {
  __shared__ float buffer[256];
  const int base = blockIdx.x * blockDim.x;
  buffer[threadIdx.x] = in[base + threadIdx.x];
  __syncthreads();
  out[base + threadIdx.x] = buffer[blockDim.x - 1 - threadIdx.x];
}

// The grid's own coordinates, as every thread sees them.
__global__ void coordinates(int* out) {
  const int t = ((blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  out[t] = blockIdx.x; out[t + 1] = blockIdx.y; out[t + 2] = threadIdx.x; out[t + 3] = gridDim.x * gridDim.y;
}

// Wrong on purpose: thread 0 leaves before the barrier the others wait at.
__global__ void early_exit(float* out) {
  if (threadIdx.x == 0) return;
  __syncthreads();
  out[threadIdx.x] = 1.f;
}

extern "C" const char* run(int which, const float* in, float* out) {
  switch (which) {
    case 0: LAUNCH_KERNEL(warp_sums, 3, 64, nullptr)(out); break;
    case 1: LAUNCH_KERNEL(reverse_slices, 4, 256, nullptr)(in, out); break;
    case 2: LAUNCH_KERNEL(coordinates, dim3(3, 2), 32, nullptr)(reinterpret_cast<int*>(out)); break;
    case 3: LAUNCH_KERNEL(early_exit, 2, 64, nullptr)(out); break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    directory = tmp_path_factory.mktemp("emulation")
    source, library = directory / "kernels.cu", directory / "kernels.so"
    source.write_text(KERNELS)
    command = [host_compiler(), *EMULATION_FLAGS, f"-I{EMULATION_SHIMS}", f"-I{CSRC_DIR}", "-x", "c++", str(source),
               "-o", str(library)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    lib = ctypes.CDLL(str(library))
    lib.run.restype = ctypes.c_char_p
    lib.run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def test_shuffles_exchange_within_each_warp(emulated):
    out = torch.zeros(3, 64)
    assert emulated.run(0, None, out.data_ptr()) is None
    lane_sum = sum(range(1, 33))  # every lane of a warp ends with its warp's sum
    assert torch.equal(out, (torch.arange(1, 4, dtype=torch.float32)[:, None] * lane_sum).expand(3, 64))


def test_shared_memory_and_barrier_within_each_block(emulated):
    data = torch.arange(4 * 256, dtype=torch.float32)
    out = torch.zeros_like(data)
    assert emulated.run(1, data.data_ptr(), out.data_ptr()) is None
    assert torch.equal(out.view(4, 256), data.view(4, 256).flip(1))


def test_grid_and_thread_indices(emulated):
    out = torch.zeros(2, 3, 32, 4, dtype=torch.int32)  # [blockIdx.y, blockIdx.x, threadIdx.x, 4]
    assert emulated.run(2, None, out.data_ptr()) is None
    y, x, t = torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(32), indexing="ij")
    assert torch.equal(out[..., 0], x.int()) and torch.equal(out[..., 1], y.int())
    assert torch.equal(out[..., 2], t.int()) and bool((out[..., 3] == 6).all())


def test_threads_that_disagree_on_a_barrier_are_reported(emulated):
    out = torch.zeros(64)
    message = emulated.run(3, None, out.data_ptr())
    assert message is not None and b"disagree" in message
    assert emulated.run(0, None, torch.zeros(3, 64).data_ptr()) is None  # the next launch is clean
