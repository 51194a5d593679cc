// What the course's CUDA kernels share (L3's decode kernel, L4's ragged-batch kernel): the warp
// width they are written for, and their launch, `kernel<<<grid, block, 0, stream>>>(args)`,
// spelled as a macro so that the CPU emulation (cuda_emulation.h, which defines its own
// LAUNCH_KERNEL first) runs the same line on host threads.
#pragma once

#ifndef LAUNCH_KERNEL
#define LAUNCH_KERNEL(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
#endif

constexpr int kWarpSize = 32;
