// Stand-in for CUDA's cuda_runtime.h when paged_attention.cu is compiled for the CPU emulation.
#pragma once
#include "../cuda_emulation.h"
