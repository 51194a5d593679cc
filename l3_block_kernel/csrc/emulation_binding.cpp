// C entry point of the CPU emulation build: paged_attention.cu compiled with g++ against
// cuda_emulation.h, called from Python through ctypes with raw pointers of contiguous tensors.
#include "paged_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

extern "C" const char* l3_emulated_paged_attention(
    void* out, const void* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks_per_seq, float scale, int dtype, int cache_format,
    const float* k_scales, const float* v_scales, int partition_size, float* partial_ml, float* partial_acc,
    const int32_t* window_starts) {
  const PagedAttentionArgs args{
      .out = out, .q = q, .k_cache = k_cache, .v_cache = v_cache, .block_tables = block_tables,
      .context_lens = context_lens, .num_seqs = num_seqs, .num_heads = num_heads,
      .num_kv_heads = num_kv_heads, .head_dim = head_dim, .block_size = block_size,
      .max_blocks_per_seq = max_blocks_per_seq, .scale = scale, .dtype = static_cast<KvDtype>(dtype),
      .cache_format = static_cast<KvCacheFormat>(cache_format), .k_scales = k_scales, .v_scales = v_scales,
      .partition_size = partition_size, .partial_ml = partial_ml, .partial_acc = partial_acc,
      .window_starts = window_starts};
  return paged_attention_launch(args, nullptr);
}

// The emulation's own float -> 16-bit conversions, for the tests to compare with torch's:
// kind 1 is __half, 2 is __nv_bfloat16 (as KvDtype). Writes the 16-bit patterns.
extern "C" void l3_emulated_to_16bit(const float* in, uint16_t* out, int64_t n, int kind) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = kind == 1 ? __float2half_rn(in[i]).bits : __float2bfloat16_rn(in[i]).bits;
  }
}

extern "C" void l3_emulated_from_16bit(const uint16_t* in, float* out, int64_t n, int kind) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = kind == 1 ? __half2float(__half{in[i]}) : __bfloat162float(__nv_bfloat16{in[i]});
  }
}
