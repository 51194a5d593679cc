// Paged attention for a ragged batch of queries (prefill chunks and decodes in one launch).
//
// Inputs and rules in paged_prefill.h. One thread block per (request, tile of its query rows,
// KV head); the tile holds kRows (query row, query head) pairs: 16 / G query rows of the G heads
// that share the KV head. The block walks the keys its tile reads in chunks of 32 positions:
//
//   all 128 threads   load the chunk's K and V rows of this KV head (through the block table)
//                     into shared memory, as float
//   each warp         takes tile rows w, w + 4, ...; lane i scores key i of the chunk against the
//                     row, the warp reduces max and sum by shuffles, and each lane updates the
//                     head_dim / 32 output elements it owns (online softmax, as L3's kernel)
//
// So a key is read from global memory once per tile, not once per query row: the saving that
// makes a prefill chunk compute-bound instead of a stream of decodes. A decode is a tile of one
// query row. Math in float; q, out and the caches in float32, float16 or bfloat16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../../l3_block_kernel/csrc/cuda_launch.h"  // L3's: LAUNCH_KERNEL and kWarpSize
#include "paged_prefill.h"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kRows = 16;                   // (query row, query head) pairs per thread block
constexpr int kChunk = kWarpSize;           // key positions per shared-memory chunk: one per lane
constexpr int kRowsPerWarp = kRows / kWarps;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Query rows per tile for a GQA group of G query heads.
__host__ __device__ __forceinline__ int tile_queries(int group) { return kRows / group; }

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) paged_prefill_kernel(PagedPrefillArgs a) {
  constexpr int kElems = HEAD_DIM / kWarpSize;  // output elements per lane
  __shared__ float q_tile[kRows][HEAD_DIM];      // scaled queries
  __shared__ float k_chunk[HEAD_DIM][kChunk];    // transposed: lane i reads column i, no bank conflict
  __shared__ float v_chunk[kChunk][HEAD_DIM];
  __shared__ float probs[kWarps][kChunk];

  const int G = a.num_heads / a.num_kv_heads, queries = tile_queries(G);
  const int tiles = (a.max_query_len + queries - 1) / queries;
  const int seq = blockIdx.x / tiles, tile = blockIdx.x % tiles, kv = blockIdx.y;
  const int row0 = a.cu_seqlens_q[seq] + tile * queries;
  const int row_end = min(a.cu_seqlens_q[seq + 1], row0 + queries);
  if (row0 >= row_end) return;  // the whole block leaves: a request shorter than the grid's longest
  const int n = a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq], len = a.context_lens[seq];
  const int first_pos = len - n + (row0 - a.cu_seqlens_q[seq]);  // the causal offset of row0
  const int rows = (row_end - row0) * G;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

  const T* q = static_cast<const T*>(a.q);
  for (int idx = threadIdx.x; idx < rows * HEAD_DIM; idx += kThreads) {
    const int r = idx / HEAD_DIM, d = idx % HEAD_DIM;  // r = query * G + g
    const int64_t src = (int64_t(row0 + r / G) * a.num_heads + kv * G + r % G) * HEAD_DIM + d;
    q_tile[r][d] = to_float(q[src]) * a.scale;
  }
  // The keys the tile reads: from its first row's first to its last row's end.
  int lo, hi, unused;
  key_range(a, seq, first_pos, &lo, &unused);
  key_range(a, seq, first_pos + (row_end - row0) - 1, &unused, &hi);

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kElems];
  for (int k = 0; k < kRowsPerWarp; ++k) {
    m[k] = -INFINITY;
    l[k] = 0.0f;
    for (int e = 0; e < kElems; ++e) acc[k][e] = 0.0f;
  }
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int32_t* table = a.block_tables + int64_t(seq) * a.max_blocks;
  const int64_t row_stride = int64_t(a.num_kv_heads) * HEAD_DIM;
  for (int c0 = lo; c0 < hi; c0 += kChunk) {
    __syncthreads();  // the previous chunk's readers are done with k_chunk and v_chunk
    for (int idx = threadIdx.x; idx < kChunk * HEAD_DIM; idx += kThreads) {
      const int i = idx / HEAD_DIM, d = idx % HEAD_DIM, p = c0 + i;
      float k_val = 0.0f, v_val = 0.0f;  // past the range: never weighted, but finite
      if (p < hi) {
        const int64_t at = (int64_t(table[p / a.block_size]) * a.block_size + p % a.block_size) * row_stride +
                           int64_t(kv) * HEAD_DIM + d;
        k_val = to_float(k_cache[at]);
        v_val = to_float(v_cache[at]);
      }
      k_chunk[d][i] = k_val;
      v_chunk[i][d] = v_val;
    }
    __syncthreads();
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int r = warp + k * kWarps;
      if (r >= rows) break;  // uniform across the warp
      int first, end;
      key_range(a, seq, first_pos + r / G, &first, &end);
      const int p = c0 + lane;
      float score = -INFINITY;
      if (p >= first && p < end) {
        score = 0.0f;
        for (int d = 0; d < HEAD_DIM; ++d) score += q_tile[r][d] * k_chunk[d][lane];
      }
      const float chunk_max = warp_max(score);
      if (chunk_max == -INFINITY) continue;  // the row reads nothing in this chunk (warp-uniform)
      const float m_new = fmaxf(m[k], chunk_max);
      const float rescale = expf(m[k] - m_new);  // 0 while m is -inf
      const float prob = score == -INFINITY ? 0.0f : expf(score - m_new);
      l[k] = l[k] * rescale + warp_sum(prob);
      m[k] = m_new;
      probs[warp][lane] = prob;
      __syncwarp();
      for (int e = 0; e < kElems; ++e) {
        float sum = acc[k][e] * rescale;
        for (int i = 0; i < kChunk; ++i) sum += probs[warp][i] * v_chunk[i][lane + e * kWarpSize];
        acc[k][e] = sum;
      }
      __syncwarp();  // probs is rewritten by the warp's next row
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + k * kWarps;
    if (r >= rows) break;
    const int64_t row = int64_t(row0 + r / G) * a.num_heads + kv * G + r % G;
    const float inv = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;  // a row that reads no key: 0
    for (int e = 0; e < kElems; ++e) out[row * HEAD_DIM + lane + e * kWarpSize] = from_float<T>(acc[k][e] * inv);
    if (a.lse != nullptr && lane == 0) a.lse[row] = l[k] > 0.0f ? m[k] + logf(l[k]) : -INFINITY;
  }
}

template <typename T, int HEAD_DIM>
cudaError_t launch(const PagedPrefillArgs& a, cudaStream_t stream) {
  const int queries = tile_queries(a.num_heads / a.num_kv_heads);
  const int tiles = (a.max_query_len + queries - 1) / queries;
  const dim3 grid(a.num_seqs * tiles, a.num_kv_heads);
  LAUNCH_KERNEL((paged_prefill_kernel<T, HEAD_DIM>), grid, kThreads, stream)(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for_head_dim(const PagedPrefillArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 32: return launch<T, 32>(a, stream);
    case 64: return launch<T, 64>(a, stream);
    case 128: return launch<T, 128>(a, stream);
    default: return cudaErrorLaunchFailure;  // rejected by paged_prefill_launch first
  }
}

}  // namespace

const char* paged_prefill_launch(const PagedPrefillArgs& a, cudaStream_t stream) {
  if (a.head_dim != 32 && a.head_dim != 64 && a.head_dim != 128) return "head_dim must be 32, 64 or 128";
  if (a.num_kv_heads < 1 || a.num_heads % a.num_kv_heads) return "num_heads must be a multiple of num_kv_heads";
  if (a.num_heads / a.num_kv_heads > kRows) return "a GQA group of more than 16 query heads is not supported";
  if (a.num_seqs == 0 || a.max_query_len == 0) return nullptr;
  cudaError_t error = a.dtype == PrefillDtype::kFloat16    ? launch_for_head_dim<__half>(a, stream)
                      : a.dtype == PrefillDtype::kBFloat16 ? launch_for_head_dim<__nv_bfloat16>(a, stream)
                                                           : launch_for_head_dim<float>(a, stream);
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}
