// The paged-attention decode kernel's algorithm written for a CPU's cores (float32).
//
// Same inputs as paged_attention.cu: q [num_seqs, H, D]; k_cache, v_cache [num_blocks, block_size,
// H_kv, D]; block_tables int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs]. Same walk:
// block by block through each sequence's table, an online softmax over the positions, keys and
// values read where they lie in the pool. window_starts (L13's sliding layers, or null) moves the
// walk's start: sequence s reads positions [window_starts[s], context_lens[s]) only, and no block
// before the window's first. What changes is who does the work:
//
//   GPU: one thread block per (sequence, query heads), 128 threads splitting a block's positions
//   CPU: one work item per sequence (or per range of its KV heads when there are fewer sequences
//        than threads), torch's OpenMP threads taking items in turn; an item serves each KV head's whole
//        GQA group, so each key and value row is read from memory once for all G query heads, and
//        the D-long dot products and updates are left to the compiler to vectorise (eight partial
//        sums per dot product let it do so without fast-math).
//
// Returns nullptr, or a message naming the first bad length or block id (checked before any
// thread starts, so a bad table never reads outside the pool).
//
// One-byte caches (L12): k_cache and v_cache may hold fp8 e4m3 or int8 codes, each standing for
// float32(code) * the scale of its KV head (int8's -128 and fp8's NaN code stand for NaN). q and
// out stay float32.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_codes.h"

#include "openmp_threads.h"

namespace {

using namespace kv_codes;

constexpr int64_t kMinKeysPerThread = 1 << 16;  // 256 KB of keys (and as much of values) per thread

struct Args {
  float* out;
  const float* q;
  const void* k_cache;  // float32, or the codes of a KvCacheFormat
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* window_starts;  // [num_seqs] or null (every sequence from position 0)
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
  const float* k_scales;  // [num_kv_heads], codes only
  const float* v_scales;
};

float dot(const float* a, const float* b, int n) {
  float partial[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int lane = 0; lane < 8; ++lane) partial[lane] += a[i + lane] * b[i + lane];
  }
  float sum = 0;
  for (int lane = 0; lane < 8; ++lane) sum += partial[lane];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

int window_start(const Args& a, int seq) { return a.window_starts == nullptr ? 0 : a.window_starts[seq]; }

// One sequence, KV heads [h0, h1): each head's G query heads attend to positions [start, len).
// Per position the item reads the heads' key rows as one contiguous run (a position's H_kv rows
// lie side by side in a block), which the hardware prefetcher follows; one item per head would
// jump a whole position row between reads.
// scratch: per head, G * D scaled queries, G * D accumulators, G * block_size scores, G running
// maxima, G running sums, and D floats for a dequantized row (codes only).
template <typename C>
void attend_item(const Args& a, int seq, int h0, int h1, std::vector<float>& scratch) {
  const int D = a.head_dim, G = a.num_heads / a.num_kv_heads, bs = a.block_size;
  const int64_t row_stride = int64_t(a.num_kv_heads) * D;  // one position of one block
  const int heads = h1 - h0, rows = heads * G;             // query heads served
  float* qs = scratch.data();
  float* acc = qs + rows * D;
  float* scores = acc + rows * D;
  float* m = scores + rows * bs;
  float* l = m + rows;
  float* dequantized = l + rows;  // [heads, D]
  constexpr bool codes = !std::is_same<C, float>::value;  // a float32 cache has no scales (null)
  const float* k_scales = codes ? a.k_scales + h0 : nullptr;
  const float* v_scales = codes ? a.v_scales + h0 : nullptr;
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0f);
  const float* q = a.q + (int64_t(seq) * a.num_heads + int64_t(h0) * G) * D;
  for (int i = 0; i < rows * D; ++i) qs[i] = q[i] * a.scale;
  std::fill(acc, acc + rows * D, 0.0f);

  const int len = a.context_lens[seq], start = window_start(a, seq);
  const int32_t* table = a.block_tables + int64_t(seq) * a.max_blocks;
  for (int j = start / bs; j * bs < len; ++j) {
    // Rows [t0, n) of this block are in use: t0 > 0 only in the window's first block.
    const int t0 = std::max(0, start - j * bs), n = std::min(bs, len - j * bs);
    const C* k_block = static_cast<const C*>(a.k_cache) + int64_t(table[j]) * bs * row_stride + int64_t(h0) * D;
    const C* v_block = static_cast<const C*>(a.v_cache) + int64_t(table[j]) * bs * row_stride + int64_t(h0) * D;
    for (int t = t0; t < n; ++t) {
      const float* k = rows_as_float(k_block + t * row_stride, k_scales, heads, D, dequantized);
      for (int r = 0; r < rows; ++r) scores[r * bs + t] = dot(qs + r * D, k + (r / G) * D, D);
    }
    for (int r = 0; r < rows; ++r) {
      float* s = scores + r * bs;
      const float m_new = std::max(m[r], *std::max_element(s + t0, s + n));
      const float rescale = std::exp(m[r] - m_new);  // 0 on the first block, where m = -inf
      float* acc_r = acc + r * D;
      for (int i = 0; i < D; ++i) acc_r[i] *= rescale;
      l[r] *= rescale;
      for (int t = t0; t < n; ++t) {
        s[t] = std::exp(s[t] - m_new);
        l[r] += s[t];
      }
      m[r] = m_new;
    }
    for (int t = t0; t < n; ++t) {
      const float* v_rows = rows_as_float(v_block + t * row_stride, v_scales, heads, D, dequantized);
      for (int r = 0; r < rows; ++r) {
        const float p = scores[r * bs + t];
        const float* v = v_rows + (r / G) * D;
        float* acc_r = acc + r * D;
        for (int i = 0; i < D; ++i) acc_r[i] += p * v[i];
      }
    }
  }
  float* out = a.out + (int64_t(seq) * a.num_heads + int64_t(h0) * G) * D;
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < D; ++i) out[r * D + i] = acc[r * D + i] / l[r];
  }
}

thread_local char error_message[256];  // per calling thread: ctypes releases the GIL

const char* check_tables(const Args& a, int num_blocks) {
  const int capacity = a.max_blocks * a.block_size;
  for (int s = 0; s < a.num_seqs; ++s) {
    const int len = a.context_lens[s];
    if (len < 1 || len > capacity) {
      std::snprintf(error_message, sizeof error_message,
                    "context_lens must be in [1, %d] (block_tables has %d columns of block_size %d), "
                    "got %d for sequence %d", capacity, a.max_blocks, a.block_size, len, s);
      return error_message;
    }
    const int start = window_start(a, s);
    if (start < 0 || start >= len) {
      std::snprintf(error_message, sizeof error_message,
                    "window_starts must be in [0, context_len), got %d for sequence %d (context_len %d)",
                    start, s, len);
      return error_message;
    }
    for (int j = start / a.block_size; j * a.block_size < len; ++j) {
      const int32_t id = a.block_tables[int64_t(s) * a.max_blocks + j];
      if (id < 0 || id >= num_blocks) {
        std::snprintf(error_message, sizeof error_message,
                      "block_tables[%d, %d] = %d is not a block id in [0, %d), but sequence %d "
                      "(context_len %d) reads it", s, j, id, num_blocks, s, len);
        return error_message;
      }
    }
  }
  return nullptr;
}

}  // namespace

// cache_format: 0 for float32 caches (k_scales, v_scales unused), 1 fp8 e4m3, 2 int8 codes.
// window_starts: int32 [num_seqs], or null for attention from position 0.
extern "C" const char* l3_cpu_paged_attention(
    float* out, const float* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int max_blocks, int num_blocks, float scale, int num_threads,
    int cache_format, const float* k_scales, const float* v_scales, const int32_t* window_starts) {
  const Args a{out, q, k_cache, v_cache, block_tables, context_lens, window_starts, num_seqs, num_heads,
               num_kv_heads, head_dim, block_size, max_blocks, scale, k_scales, v_scales};
  if (num_heads % num_kv_heads) return "num_heads must be a multiple of num_kv_heads";
  void (*attend)(const Args&, int, int, int, std::vector<float>&) =
      cache_format == kFloat32 ? attend_item<float> : cache_format == kFp8E4m3 ? attend_item<Fp8E4m3>
      : cache_format == kInt8 ? attend_item<int8_t> : nullptr;
  if (attend == nullptr) return "cache_format must be 0 (float32), 1 (fp8 e4m3) or 2 (int8)";
  if (cache_format != kFloat32 && (k_scales == nullptr || v_scales == nullptr)) {
    return "an fp8 or int8 cache needs k_scales and v_scales";
  }
  if (const char* error = check_tables(a, num_blocks)) return error;

  // Handing work to other threads costs microseconds: a small call (a tiny model, short contexts)
  // runs on the calling thread alone, a larger one on up to num_threads.
  int64_t keys = 0;  // key elements to read, all sequences and KV heads
  for (int s = 0; s < num_seqs; ++s) keys += int64_t(context_lens[s] - window_start(a, s)) * num_kv_heads * head_dim;
  const int workers = int(std::clamp<int64_t>(keys / kMinKeysPerThread, 1, std::max(1, num_threads)));
  // Items: each sequence's KV heads cut into `parts` ranges, enough for every worker to get a
  // few even with one sequence. Worker w takes items w, w + workers, ...: neighbouring items
  // (parts of one sequence) have the same length, so the workers' shares stay even.
  const int parts = std::min(num_kv_heads, std::max(1, 2 * workers / std::max(1, num_seqs)));
  const int heads_per_part = (num_kv_heads + parts - 1) / parts;
  const int items = num_seqs * parts;
  const size_t scratch_floats =  // see attend_item
      size_t(heads_per_part) * ((num_heads / num_kv_heads) * (2 * head_dim + block_size + 2) + head_dim);
  // The workers are torch's own intra-op threads when built with -fopenmp (see kernel_build.py):
  // between two matrix products they are already running or waiting for work, where threads of
  // our own would have to be started and would compete with them for the cores.
  #pragma omp parallel num_threads(std::min(workers, items))
  {
    std::vector<float> scratch(scratch_floats);
    for (int item = omp_get_thread_num(); item < items; item += omp_get_num_threads()) {
      const int h0 = (item % parts) * heads_per_part, h1 = std::min(num_kv_heads, h0 + heads_per_part);
      if (h0 < h1) attend(a, item / parts, h0, h1, scratch);
    }
  }
  return nullptr;
}
