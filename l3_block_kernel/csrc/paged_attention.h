// Paged-attention decode: the launcher's interface, free of torch so that plain nvcc compiles it.
//
// The KV pool of one layer is a block tensor; a sequence's history lives in the blocks its row
// of the block table names, in order:
//
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables      [num_seqs, max_blocks_per_seq]   row s: the block ids of sequence s
//   context_lens      [num_seqs]                       position p of sequence s is stored at
//                                                      block block_tables[s][p / block_size],
//                                                      row p % block_size
//   window_starts     [num_seqs] or none               sequence s attends to positions
//                                                      [window_starts[s], context_lens[s]) only
//                                                      (L13's sliding-window layers)
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

enum class KvDtype { kFloat32, kFloat16, kBFloat16 };
// What k_cache and v_cache hold. kSameAsQuery: elements in `dtype`, like q. kFp8E4m3, kInt8 (L12):
// one-byte codes, read as the value float32(code) * scale of the element's KV head; the int8 code
// -128 and fp8's NaN code read as NaN.
enum class KvCacheFormat { kSameAsQuery = 0, kFp8E4m3 = 1, kInt8 = 2 };

// Every tensor is contiguous and row-major; every pointer is on the device.
struct PagedAttentionArgs {
  void* out;                    // [num_seqs, num_heads, head_dim], written
  const void* q;                // [num_seqs, num_heads, head_dim], one decode token per sequence
  const void* k_cache;          // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v_cache;          // [num_blocks, block_size, num_kv_heads, head_dim]
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]; entries past a sequence's
                                // ceil(context_len / block_size) are padding and never read
  const int32_t* context_lens;  // [num_seqs], each in [1, max_blocks_per_seq * block_size]
                                // (a length of 0 or less writes zeros; the host rejects it first)
  int num_seqs;
  int num_heads;
  int num_kv_heads;             // divides num_heads (GQA)
  int head_dim;                 // 32, 64 or 128
  int block_size;               // a power of two from 8 to 128
  int max_blocks_per_seq;
  float scale;                  // softmax scale, usually 1 / sqrt(head_dim)
  KvDtype dtype;                // of out and q, and of k_cache and v_cache for kSameAsQuery
  KvCacheFormat cache_format;
  const float* k_scales;        // [num_kv_heads]: one-byte formats only, else nullptr
  const float* v_scales;        // [num_kv_heads]: one-byte formats only, else nullptr
  // Split-K: 0 runs the single-pass kernel; a positive multiple of 8 cuts every context into
  // partitions of that many positions, and then the two float32 buffers below must hold
  // num_seqs * num_heads * max_partitions * {2, head_dim} elements, with
  // max_partitions = ceil(max_blocks_per_seq * block_size / partition_size).
  int partition_size;
  float* partial_ml;            // [num_seqs, num_heads, max_partitions, 2]: max (log2 units), sum
  float* partial_acc;           // [num_seqs, num_heads, max_partitions, head_dim]
  // nullptr: every sequence attends from position 0. Else sequence s attends to positions
  // [window_starts[s], context_len), with window_starts[s] in [0, context_len); its table entries
  // before column window_starts[s] / block_size are never read (L13 leaves -1 there).
  const int32_t* window_starts;  // [num_seqs]
};

// Queues the kernel on `stream`. Returns nullptr on success, else a static one-line message
// (an unsupported size, a misaligned pointer, or the CUDA launch error).
// Pointers must be aligned to their element size * head_dim / 32 bytes, the widest load a lane
// issues (head_dim / 32 bytes for a one-byte cache).
const char* paged_attention_launch(const PagedAttentionArgs& args, cudaStream_t stream);
