// Paged attention for a ragged batch of queries: the launcher's interface and the host-side table
// check, free of torch so that plain nvcc (and the CPU builds) compile it.
//
//   q             [num_tokens, num_heads, head_dim]    request r's rows are [cu_seqlens_q[r], cu_seqlens_q[r+1])
//   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]   (L3's block-tensor pool)
//   context_lens  [num_seqs]     keys of request r in the pool, its new rows' own keys included
//   block_tables  [num_seqs, max_blocks]   position p of request r is row p % block_size of
//                                          block block_tables[r][p / block_size]
//
// The causal offset: row i of a request with n new rows is the token at position
// context_len - n + i, and (causal) reads the keys at positions <= its own. A decode is n = 1.
// window > 0 (a sliding layer): a query at p reads only positions in (p - window, p].
// key_begin, causal: cascade's two passes (see cascade.py): the suffix pass skips the shared
// prefix's positions (< key_begin); the prefix pass (causal = 0) lets every row read every key.
#pragma once

#include <cstdint>
#include <cstdio>

#ifdef __CUDACC__
#define HOST_DEVICE __host__ __device__  // key_range runs in the kernel and in the host's check
#else
#define HOST_DEVICE
#endif

enum class PrefillDtype { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct PagedPrefillArgs {
  void* out;                    // [num_tokens, num_heads, head_dim], q's dtype, written
  float* lse;                   // [num_tokens, num_heads] log-sum-exp of each row's scores, or nullptr
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* cu_seqlens_q;  // [num_seqs + 1], 0 first, num_tokens last, non-decreasing
  const int32_t* context_lens;  // [num_seqs], each in [1, max_blocks * block_size]
  const int32_t* block_tables;  // [num_seqs, max_blocks]; columns a request never reads: padding
  int num_seqs;
  int num_tokens;
  int num_heads;
  int num_kv_heads;             // divides num_heads (GQA)
  int head_dim;
  int block_size;
  int max_blocks;
  int num_blocks;
  int max_query_len;            // the largest cu_seqlens_q[r+1] - cu_seqlens_q[r] (the grid's size)
  float scale;                  // softmax scale, usually 1 / sqrt(head_dim)
  int window;                   // 0: no window
  int key_begin;                // 0: from the first position (or the window's)
  int causal;                   // 1: the causal rule above; 0: every key in [key_begin, context_len)
  PrefillDtype dtype;           // of q, out and the caches
};

// The first and one-past-the-last key position a query at `pos` reads in request `seq`.
HOST_DEVICE inline void key_range(const PagedPrefillArgs& a, int seq, int pos, int* first, int* end) {
  int lo = a.key_begin;
  if (a.window > 0 && pos - a.window + 1 > lo) lo = pos - a.window + 1;
  *first = lo;
  *end = a.causal ? pos + 1 : a.context_lens[seq];
}

// Host side, before anything is read: the lengths, the row offsets, and every block id a row of
// some request reads. Returns nullptr, or `message` holding the first problem found.
inline const char* check_prefill_tables(const PagedPrefillArgs& a, char* message, size_t size) {
  const int capacity = a.max_blocks * a.block_size;
  if (a.cu_seqlens_q[0] != 0 || a.cu_seqlens_q[a.num_seqs] != a.num_tokens) {
    std::snprintf(message, size, "cu_seqlens_q must start at 0 and end at the number of query rows %d, "
                  "got %d and %d", a.num_tokens, a.cu_seqlens_q[0], a.cu_seqlens_q[a.num_seqs]);
    return message;
  }
  for (int s = 0; s < a.num_seqs; ++s) {
    const int n = a.cu_seqlens_q[s + 1] - a.cu_seqlens_q[s], len = a.context_lens[s];
    if (n < 0 || n > a.max_query_len) {
      std::snprintf(message, size, "request %d has %d query rows (cu_seqlens_q must be non-decreasing, "
                    "max_query_len %d)", s, n, a.max_query_len);
      return message;
    }
    if (len < 1 || len > capacity || (a.causal && n > len)) {
      std::snprintf(message, size, "context_lens[%d] = %d must be in [max(1, its %d query rows), %d] "
                    "(block_tables has %d columns of block_size %d)", s, len, n, capacity, a.max_blocks,
                    a.block_size);
      return message;
    }
    if (n == 0) continue;
    int first, end, unused;
    key_range(a, s, a.causal ? len - n : len - 1, &first, &unused);
    key_range(a, s, len - 1, &unused, &end);
    for (int j = first / a.block_size; j * a.block_size < end; ++j) {
      const int32_t id = a.block_tables[int64_t(s) * a.max_blocks + j];
      if (id < 0 || id >= a.num_blocks) {
        std::snprintf(message, size, "block_tables[%d, %d] = %d is not a block id in [0, %d), but request %d "
                      "(context_len %d) reads it", s, j, id, a.num_blocks, s, len);
        return message;
      }
    }
  }
  return nullptr;
}
