// C entry point of the CPU emulation build: paged_prefill.cu compiled with g++ against L3's
// cuda_emulation.h, called from Python through ctypes with raw pointers of contiguous tensors.
// The tables are on the host here, so they are checked before the launch, as the CPU kernel does.
#include <cuda_runtime.h>

#include "paged_prefill.h"

// paged_prefill.cu: queues the kernel, or returns a one-line message (an unsupported size).
const char* paged_prefill_launch(const PagedPrefillArgs& args, cudaStream_t stream);

namespace {
thread_local char error_message[320];
}

extern "C" const char* l4_emulated_paged_prefill(
    void* out, float* lse, const void* q, const void* k_cache, const void* v_cache,
    const int32_t* cu_seqlens_q, const int32_t* context_lens, const int32_t* block_tables,
    int num_seqs, int num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int max_blocks, int num_blocks, int max_query_len, float scale, int window, int key_begin,
    int causal, int dtype) {
  const PagedPrefillArgs args{out, lse, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                              num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size,
                              max_blocks, num_blocks, max_query_len, scale, window, key_begin, causal,
                              static_cast<PrefillDtype>(dtype)};
  if (num_kv_heads < 1 || num_heads % num_kv_heads) return "num_heads must be a multiple of num_kv_heads";
  if (const char* error = check_prefill_tables(args, error_message, sizeof error_message)) return error;
  return paged_prefill_launch(args, nullptr);
}
