// C entry point of the CPU emulation build: paged_attention.cu compiled with g++ against
// cuda_emulation.h, called from Python through ctypes with raw pointers of contiguous tensors.
#include "paged_attention.h"

extern "C" const char* l3_emulated_paged_attention(
    void* out, const void* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks_per_seq, float scale, int dtype,
    int partition_size, float* partial_ml, float* partial_acc) {
  PagedAttentionArgs args{};
  args.out = out;
  args.q = q;
  args.k_cache = k_cache;
  args.v_cache = v_cache;
  args.block_tables = block_tables;
  args.context_lens = context_lens;
  args.num_seqs = num_seqs;
  args.num_heads = num_heads;
  args.num_kv_heads = num_kv_heads;
  args.head_dim = head_dim;
  args.block_size = block_size;
  args.max_blocks_per_seq = max_blocks_per_seq;
  args.scale = scale;
  args.dtype = static_cast<KvDtype>(dtype);
  args.partition_size = partition_size;
  args.partial_ml = partial_ml;
  args.partial_acc = partial_acc;
  return paged_attention_launch(args, nullptr);
}
