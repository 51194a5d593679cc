// Paged-attention decode kernel: the one new query token of each sequence attends to that
// sequence's whole history, read in place from the block-tensor KV pool by walking the
// sequence's block table (layouts: paged_attention.h). Plain CUDA C++, no torch headers.
// With window_starts (L13's sliding layers) it attends to the positions from the window's start
// only: the walk begins at the tile holding that start, so blocks before it are never touched.
//
// Thread mapping
//   grid   (num_seqs, num_heads / HEADS_PER_BLOCK): a thread block serves HEADS_PER_BLOCK query
//          heads that share one KV head. Decode attention is memory-bound, so a block that
//          serves a whole GQA group reads each KV byte once for all the group's heads.
//   block  8 warps. Warp w takes the tiles w, w + 8, w + 16, ... of 8 consecutive positions.
//          A tile never straddles two KV blocks, because 8 divides every allowed block size.
//   lane   owns head_dim / 32 consecutive elements of every q, K, V and output row, so a warp
//          loads one position's K row (or V row) with one coalesced access (head_dim 128 in
//          bf16: 4 elements, 8 bytes a lane, 256 contiguous bytes a warp).
//
// For each tile a warp reads one block-table entry, loads 8 K rows and 8 V rows (positions past
// context_len are never loaded), computes 8 scores per head, and folds them into its running
// softmax state (online softmax). At the end the 8 warps merge their states in shared memory.
//
// Split-K (flash-decoding). One thread block per (sequence, GQA group) gives the GPU only
// num_seqs * num_kv_heads blocks: enough at batch 32 with 8 KV heads (256 blocks), too few to
// reach full bandwidth at batch 1. With partition_size > 0 a third grid dimension cuts each
// context into partitions; each block writes the partial softmax state of its partition, and a
// second kernel merges the partitions exactly. The caller (paged_attention.py) picks the path.
//
// One-byte caches (L12). k_cache and v_cache may hold fp8 e4m3 or int8 codes instead of q's dtype,
// each standing for float32(code) * the scale of its KV head. A lane decodes its elements in
// registers as it loads them, so only the codes cross the memory bus (a quarter of float32's
// bytes). A thread block serves one KV head, so both scales are constants of the block: the K
// scale is folded into the pre-scaled query, (q * s_k) . c == q . (c * s_k), and the V scale into
// the output, s_v * (sum p * c) / l == (sum p * c * s_v) / l. Both equal dequantize-then-attend
// up to float32 rounding, at two multiplies a row instead of one per element.

#include "paged_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifndef CUDA_EMULATION
#include <cuda_fp8.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda_launch.h"  // LAUNCH_KERNEL and kWarpSize

namespace {

constexpr int kNumWarps = 8;
constexpr int kThreads = kNumWarps * kWarpSize;
// NOTE: a warp issues the K and V loads of a whole tile before it uses any of them, so each lane
// has 2 * kTileTokens loads in flight; that is what hides the latency of global memory.
// Measured on an H200 and not kept: 16-position tiles for one-byte caches (the same bytes in
// flight as bf16's 8) spill registers at the 128-a-thread bound and ran 10-20% slower.
constexpr int kTileTokens = 8;
constexpr int kMinBlockSize = kTileTokens;
constexpr int kMaxBlockSize = 128;
// NOTE: two resident blocks per SM (so at most 128 registers a thread) let the 256 blocks of
// batch 32 x 8 KV heads run in one wave on an H100's 132 SMs. With 4 or 8 heads a block the
// state is larger; forcing the limit there would spill registers to local memory.
template <int HEADS_PER_BLOCK>
constexpr int kMinBlocksPerSm = HEADS_PER_BLOCK <= 2 ? 2 : 1;
// NOTE: scores are kept in log2 units (q is scaled by log2(e) once), so every exponential is an
// exp2f, which the GPU's special-function unit computes directly (expf needs an extra multiply):
// exp(x - m) == exp2(x * log2(e) - m * log2(e)).
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// An fp8 e4m3 code: a type of its own, so that overloads and templates tell it from int8.
struct Fp8E4m3 {
  uint8_t bits;
};

// The float a bit pattern stands for, on the GPU and in host code (the CPU emulation) alike.
__host__ __device__ __forceinline__ float float_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

constexpr uint32_t kNanBits = 0x7fc00000u;

// e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, s 1111 111 is NaN. The
// sign, exponent and mantissa fields moved to float32's places give the value times 2^-120 (bias
// 127 instead of 7), a subnormal code included (it lands on a float32 subnormal); one multiply by
// 2^120 restores it exactly, since every e4m3 value is a float32. No branch: this runs for every
// element the kernel reads on a GPU without an fp8 conversion instruction, and in the emulation.
__host__ __device__ __forceinline__ float e4m3_to_float(uint8_t bits) {
  if ((bits & 0x7fu) == 0x7fu) return float_from_bits(kNanBits);
  return float_from_bits(uint32_t(bits & 0x80u) << 24 | uint32_t(bits & 0x7fu) << 20) * 0x1p120f;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// sm_89 and later convert an e4m3 code to a half in one instruction; every e4m3 value (NaN too)
// is exact in half, and every half in float32, so this equals e4m3_to_float bit for bit.
// NOTE: on an H200 this made the fp8 kernel 3.6x faster than the bit-by-bit decode it replaced
// (batch 32 x 2k: 351 -> 98 us), which had made fp8 four times slower than the bf16 cache.
__device__ __forceinline__ float to_float(Fp8E4m3 x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E4M3)));
}
#else
__device__ __forceinline__ float to_float(Fp8E4m3 x) { return e4m3_to_float(x.bits); }
#endif
// Finite values are stored as -127..127; -128 is the code a NaN was stored as.
__device__ __forceinline__ float to_float(int8_t x) { return x == -128 ? float_from_bits(kNanBits) : float(x); }

// Whether a cache element is a one-byte code, read with its KV head's scale.
template <typename C>
constexpr bool kIsCode = std::is_same<C, Fp8E4m3>::value || std::is_same<C, int8_t>::value;

// The scale of a KV head's elements: 1 for a cache in q's dtype, and x * 1 == x, so that path
// computes exactly what it did before caches had scales.
template <typename C>
__device__ __forceinline__ float head_scale(const float* __restrict__ scales, int kv_head) {
  return kIsCode<C> ? scales[kv_head] : 1.f;
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N consecutive elements of a row; alignas lets the compiler move them with one vector load.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T e[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* __restrict__ src) {
  return *reinterpret_cast<const Vec<T, N>*>(src);
}

// A lane's slice of a K or V row as float32, decoded once for all the heads that read it.
template <typename C, int N>
__device__ __forceinline__ void to_floats(const Vec<C, N>& x, float (&out)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = to_float(x.e[e]);
}

// Butterfly reduction: after 5 exchanges every lane holds the sum over the 32 lanes.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// A warp's online-softmax state for each of its heads, over the positions it has seen so far.
// m and l are the same in every lane; acc holds the lane's slice of head_dim.
template <int HEADS, int ELEMS>
struct SoftmaxState {
  float m[HEADS];           // running max score (log2 units); -inf before the first tile
  float l[HEADS];           // running sum of exp2(score - m)
  float acc[HEADS][ELEMS];  // running sum of exp2(score - m) * v
};

template <int HEADS, int ELEMS>
__device__ __forceinline__ void init_state(SoftmaxState<HEADS, ELEMS>& st) {
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    st.m[h] = -INFINITY;
    st.l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) st.acc[h][e] = 0.f;
  }
}

// The lane's slice of each head's query, scaled by scale_log2 = softmax scale * log2(e).
template <typename T, int HEADS, int ELEMS>
__device__ __forceinline__ void load_query(
    const T* __restrict__ q_rows,  // [HEADS, head_dim] at the block's first head, + lane offset
    int head_dim, float scale_log2, float (&q)[HEADS][ELEMS]) {
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    const Vec<T, ELEMS> raw = load_vec<T, ELEMS>(q_rows + h * head_dim);
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) q[h][e] = to_float(raw.e[e]) * scale_log2;
  }
}

// Scores of one tile: s[h][u] = q_h . k_u summed over the warp, -inf outside [first_valid, num_valid).
template <typename C, int HEADS, int ELEMS>
__device__ __forceinline__ void tile_scores(
    const float (&q)[HEADS][ELEMS], const Vec<C, ELEMS> (&k)[kTileTokens], int first_valid, int num_valid,
    float (&s)[HEADS][kTileTokens]) {
#pragma unroll
  for (int u = 0; u < kTileTokens; ++u) {
    float k_u[ELEMS];
    to_floats(k[u], k_u);
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      float partial = 0.f;
#pragma unroll
      for (int e = 0; e < ELEMS; ++e) partial += q[h][e] * k_u[e];
      const float score = warp_sum(partial);  // every lane takes part, masked or not
      s[h][u] = u >= first_valid && u < num_valid ? score : -INFINITY;
    }
  }
}

// Folds one tile into the running state: raise m to the tile's max, rescale l and acc by
// exp2(m_old - m_new), then add each position's weight p = exp2(s - m_new) and p * v.
// A masked position has s = -inf, so p = 0, and its v was never loaded (it is zero), so a NaN
// stored in its slot cannot reach the result: 0 * NaN would be NaN.
template <typename C, int HEADS, int ELEMS>
__device__ __forceinline__ void update_state(
    const float (&s)[HEADS][kTileTokens], const Vec<C, ELEMS> (&v)[kTileTokens],
    SoftmaxState<HEADS, ELEMS>& st) {
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    float m_new = st.m[h];
#pragma unroll
    for (int u = 0; u < kTileTokens; ++u) m_new = fmaxf(m_new, s[h][u]);
    const float rescale = exp2f(st.m[h] - m_new);  // 0 on the first tile, where m = -inf
    st.m[h] = m_new;
    st.l[h] *= rescale;
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) st.acc[h][e] *= rescale;
  }
#pragma unroll
  for (int u = 0; u < kTileTokens; ++u) {
    float v_u[ELEMS];
    to_floats(v[u], v_u);
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      const float p = exp2f(s[h][u] - st.m[h]);
      st.l[h] += p;
#pragma unroll
      for (int e = 0; e < ELEMS; ++e) st.acc[h][e] += p * v_u[e];
    }
  }
}

// One tile of up to kTileTokens consecutive positions, all in the same KV block.
template <typename C, int HEADS, int ELEMS>
__device__ __forceinline__ void attend_tile(
    const float (&q)[HEADS][ELEMS],
    const C* __restrict__ k_rows,  // the tile's first K row, + lane offset; row u at u * row_stride
    const C* __restrict__ v_rows,  // the same for V
    int64_t row_stride,            // num_kv_heads * head_dim: from one position to the next
    int first_valid,               // rows before it lie before the window start: 0..kTileTokens - 1
    int num_valid,                 // rows before it lie below context_len: 1..kTileTokens
    SoftmaxState<HEADS, ELEMS>& st) {
  Vec<C, ELEMS> k[kTileTokens];
  Vec<C, ELEMS> v[kTileTokens];
#pragma unroll
  for (int u = 0; u < kTileTokens; ++u) {
    // Positions past context_len (or before the window) are not loaded at all: their slots may
    // belong to no one yet (or to a stale token of the window's first block).
    const bool valid = u >= first_valid && u < num_valid;
    k[u] = valid ? load_vec<C, ELEMS>(k_rows + u * row_stride) : Vec<C, ELEMS>{};
    v[u] = valid ? load_vec<C, ELEMS>(v_rows + u * row_stride) : Vec<C, ELEMS>{};
  }
  float s[HEADS][kTileTokens];
  tile_scores<C>(q, k, first_valid, num_valid, s);
  update_state<C>(s, v, st);
}

// Merges the warps' states in shared memory. For each of the block's HEADS * HEAD_DIM outputs
// (i = h * HEAD_DIM + d) calls store(i, m, l, o): the block's max score m (log2 units, -inf when
// no warp saw a position), its sum l of exp2(score - m), and o, the sum of exp2(score - m) * v[d].
template <int HEAD_DIM, int HEADS, int ELEMS, typename Store>
__device__ __forceinline__ void merge_warps(const SoftmaxState<HEADS, ELEMS>& st, Store store) {
  __shared__ float warp_m[kNumWarps][HEADS];
  __shared__ float warp_l[kNumWarps][HEADS];
  __shared__ float warp_acc[kNumWarps][HEADS][HEAD_DIM];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    if (lane == 0) {
      warp_m[warp][h] = st.m[h];
      warp_l[warp][h] = st.l[h];
    }
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) warp_acc[warp][h][lane * ELEMS + e] = st.acc[h][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < HEADS * HEAD_DIM; i += kThreads) {
    const int h = i / HEAD_DIM;
    const int d = i % HEAD_DIM;
    float m = -INFINITY;
    for (int w = 0; w < kNumWarps; ++w) m = fmaxf(m, warp_m[w][h]);
    float l = 0.f;
    float o = 0.f;
    if (m != -INFINITY) {  // else no warp saw a position: exp2(-inf - -inf) would be NaN
      for (int w = 0; w < kNumWarps; ++w) {
        // A warp that saw no position has m = -inf, hence weight 0 (and l = acc = 0).
        const float weight = exp2f(warp_m[w][h] - m);
        l += weight * warp_l[w][h];
        o += weight * warp_acc[w][h][d];
      }
    }
    store(i, m, l, o);
  }
}

// The warps of a block share the tiles of positions [begin, end): warp w takes the tiles
// w, w + 8, ... counted from begin. begin is a multiple of kTileTokens, so no tile straddles two
// KV blocks; positions below window_start (at most the first tile's first few) are masked.
// Returns each warp's state over its tiles.
template <typename C, int HEAD_DIM, int HEADS, int ELEMS>
__device__ __forceinline__ void attend_positions(
    const float (&q_reg)[HEADS][ELEMS], const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    const int32_t* __restrict__ block_table,  // [max_blocks_per_seq] of this sequence
    int kv_head, int num_kv_heads, int block_size, int begin, int end, int window_start,
    SoftmaxState<HEADS, ELEMS>& state) {
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row_stride = int64_t(num_kv_heads) * HEAD_DIM;
  for (int start = begin + warp * kTileTokens; start < end; start += kNumWarps * kTileTokens) {
    // NOTE: int64 from here on: num_blocks * block_size * num_kv_heads * head_dim can pass 2^31.
    const int64_t block_id = block_table[start / block_size];
    const int64_t slot = block_id * block_size + start % block_size;  // the course's slot convention
    const int64_t offset = slot * row_stride + kv_head * HEAD_DIM + lane * ELEMS;
    const int num_valid = min(kTileTokens, end - start);
    const int first_valid = max(0, window_start - start);
    attend_tile<C>(q_reg, k_cache + offset, v_cache + offset, row_stride, first_valid, num_valid, state);
  }
}

// What every kernel below needs to know about its thread block's place in the problem.
struct BlockPlace {
  int seq;            // blockIdx.x
  int first_head;     // the block's first query head
  int kv_head;        // the KV head its query heads share
  int context_len;    // clamped to the table's capacity (the host checks every length)
  int window_start;   // the first position attended to: 0 without windows
  int first_tile;     // the tile that holds it: window_start rounded down to kTileTokens
  int64_t first_row;  // q/out row of the first head: seq * num_heads + first_head
};

// The first position sequence seq attends to, clamped into [0, context_len] (the host checks them).
__device__ __forceinline__ int window_start_of(const int32_t* __restrict__ window_starts, int seq, int context_len) {
  return window_starts == nullptr ? 0 : min(max(window_starts[seq], 0), max(context_len, 0));
}

__device__ __forceinline__ BlockPlace place_block(const int32_t* __restrict__ context_lens,
                                                  const int32_t* __restrict__ window_starts, int heads_per_block,
                                                  int num_heads, int num_kv_heads, int capacity) {
  BlockPlace p;
  p.seq = blockIdx.x;
  p.first_head = blockIdx.y * heads_per_block;
  p.kv_head = p.first_head / (num_heads / num_kv_heads);
  // NOTE: the clamp only keeps a bad length from reading past the table's row.
  p.context_len = min(context_lens[p.seq], capacity);
  p.window_start = window_start_of(window_starts, p.seq, p.context_len);
  p.first_tile = p.window_start / kTileTokens * kTileTokens;
  p.first_row = int64_t(p.seq) * num_heads + p.first_head;
  return p;
}

// What both kernels share: the block's query rows, pre-scaled (by K's scale too, for codes),
// against positions [begin, end) of its sequence; leaves each warp's softmax state over its tiles
// in `state`. The values in it still lack V's scale.
template <typename T, typename C, int HEAD_DIM, int HEADS, int ELEMS>
__device__ __forceinline__ void attend_range(
    const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,
    const float* __restrict__ k_scales, const int32_t* __restrict__ block_tables, const BlockPlace& p,
    int max_blocks_per_seq, int num_kv_heads, int block_size, float scale_log2, int begin, int end,
    SoftmaxState<HEADS, ELEMS>& state) {
  const int lane = threadIdx.x % kWarpSize;
  float q_reg[HEADS][ELEMS];
  load_query<T>(q + p.first_row * HEAD_DIM + lane * ELEMS, HEAD_DIM,
                scale_log2 * head_scale<C>(k_scales, p.kv_head), q_reg);
  init_state(state);
  attend_positions<C, HEAD_DIM>(q_reg, k_cache, v_cache, block_tables + int64_t(p.seq) * max_blocks_per_seq,
                                p.kv_head, num_kv_heads, block_size, begin, end, p.window_start, state);
}

// Single pass: grid (num_seqs, num_heads / HEADS_PER_BLOCK); one block reads a sequence's whole
// context for HEADS_PER_BLOCK query heads and writes their output rows.
template <typename T, typename C, int HEAD_DIM, int HEADS_PER_BLOCK>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<HEADS_PER_BLOCK>) paged_attention_kernel(
    T* __restrict__ out,                       // [num_seqs, num_heads, HEAD_DIM]
    const T* __restrict__ q,                   // [num_seqs, num_heads, HEAD_DIM]
    const C* __restrict__ k_cache,             // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const C* __restrict__ v_cache,             // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const float* __restrict__ k_scales,        // [num_kv_heads], codes only (see head_scale)
    const float* __restrict__ v_scales,        // [num_kv_heads], codes only
    const int32_t* __restrict__ block_tables,  // [num_seqs, max_blocks_per_seq]
    const int32_t* __restrict__ context_lens,  // [num_seqs]
    const int32_t* __restrict__ window_starts, // [num_seqs] or nullptr
    int num_heads, int num_kv_heads, int block_size, int max_blocks_per_seq,
    float scale_log2) {                        // softmax scale * log2(e)
  constexpr int kElems = HEAD_DIM / kWarpSize;  // elements of a row that one lane owns
  const BlockPlace p = place_block(context_lens, window_starts, HEADS_PER_BLOCK, num_heads, num_kv_heads,
                                   max_blocks_per_seq * block_size);
  SoftmaxState<HEADS_PER_BLOCK, kElems> state;
  attend_range<T, C, HEAD_DIM>(q, k_cache, v_cache, k_scales, block_tables, p, max_blocks_per_seq, num_kv_heads,
                               block_size, scale_log2, p.first_tile, p.context_len, state);
  const float v_scale = head_scale<C>(v_scales, p.kv_head);
  T* out_rows = out + p.first_row * HEAD_DIM;  // [HEADS_PER_BLOCK, HEAD_DIM]
  merge_warps<HEAD_DIM>(state, [&](int i, float /*m*/, float l, float o) {
    // l >= 1 when the block saw a position (the warp that holds the max adds exp2(0)); a length
    // of 0 or less gives l = 0, and writes 0 rather than 0 / 0 = NaN.
    out_rows[i] = from_float<T>(l > 0.f ? o / l * v_scale : 0.f);
  });
}

// Split-K, first kernel: grid (num_seqs, num_heads / HEADS_PER_BLOCK, max_partitions). Block z
// reads only positions [z * partition_size, (z + 1) * partition_size) of its sequence and writes
// its partial state, unnormalised, for the reduce kernel:
//   partial_ml  [num_seqs, num_heads, max_partitions, 2]         (m in log2 units, l)
//   partial_acc [num_seqs, num_heads, max_partitions, HEAD_DIM]   (o)
// A partition past the sequence's end, or wholly before its window, returns at once and writes
// nothing; a sliding layer's long context launches as many partitions as a full one, but all
// except the window's one or two leave before reading a byte.
template <typename T, typename C, int HEAD_DIM, int HEADS_PER_BLOCK>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<HEADS_PER_BLOCK>) paged_attention_partition_kernel(
    float* __restrict__ partial_ml, float* __restrict__ partial_acc, const T* __restrict__ q,
    const C* __restrict__ k_cache, const C* __restrict__ v_cache, const float* __restrict__ k_scales,
    const float* __restrict__ v_scales, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ context_lens, const int32_t* __restrict__ window_starts, int num_heads,
    int num_kv_heads, int block_size, int max_blocks_per_seq, int partition_size, float scale_log2) {
  constexpr int kElems = HEAD_DIM / kWarpSize;
  const BlockPlace p = place_block(context_lens, window_starts, HEADS_PER_BLOCK, num_heads, num_kv_heads,
                                   max_blocks_per_seq * block_size);
  const int partition_begin = blockIdx.z * partition_size;
  // The whole block leaves before any barrier: past the end, or wholly before the window.
  if (partition_begin >= p.context_len || partition_begin + partition_size <= p.window_start) return;
  const int begin = max(partition_begin, p.first_tile);  // both multiples of kTileTokens
  const int end = min(partition_begin + partition_size, p.context_len);
  SoftmaxState<HEADS_PER_BLOCK, kElems> state;
  attend_range<T, C, HEAD_DIM>(q, k_cache, v_cache, k_scales, block_tables, p, max_blocks_per_seq, num_kv_heads,
                               block_size, scale_log2, begin, end, state);
  // V's scale here: the reduce kernel, which knows no KV head, merges the partitions' o linearly.
  const float v_scale = head_scale<C>(v_scales, p.kv_head);
  const int max_partitions = gridDim.z;
  merge_warps<HEAD_DIM>(state, [&](int i, float m, float l, float o) {
    const int64_t part = (p.first_row + i / HEAD_DIM) * max_partitions + blockIdx.z;  // [seq, head, z]
    partial_acc[part * HEAD_DIM + i % HEAD_DIM] = o * v_scale;
    if (i % HEAD_DIM == 0) {
      partial_ml[part * 2] = m;
      partial_ml[part * 2 + 1] = l;
    }
  });
}

// Split-K, second kernel: grid (num_seqs, num_heads), HEAD_DIM threads, thread d writes out[d].
// The merge is exact: with M the largest partition max, every partition's l and o are rescaled by
// exp2(m_z - M) and summed, the same step that merges two warps or two tiles.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(HEAD_DIM) paged_attention_reduce_kernel(
    T* __restrict__ out, const float* __restrict__ partial_ml, const float* __restrict__ partial_acc,
    const int32_t* __restrict__ context_lens, const int32_t* __restrict__ window_starts, int capacity,
    int max_partitions, int partition_size) {
  const int64_t row = int64_t(blockIdx.x) * gridDim.y + blockIdx.y;  // seq * num_heads + head
  const int d = threadIdx.x;
  const int context_len = min(context_lens[blockIdx.x], capacity);
  // The partitions the first kernel wrote: from the window start's to the last position's.
  const int first_partition = window_start_of(window_starts, blockIdx.x, context_len) / partition_size;
  const int end_partition = context_len > 0 ? (context_len + partition_size - 1) / partition_size : 0;
  const float* ml = partial_ml + row * max_partitions * 2;          // [max_partitions, 2]
  const float* acc = partial_acc + row * max_partitions * HEAD_DIM;  // [max_partitions, HEAD_DIM]
  float m = -INFINITY;
  for (int z = first_partition; z < end_partition; ++z) m = fmaxf(m, ml[z * 2]);
  float l = 0.f;
  float o = 0.f;
  for (int z = first_partition; z < end_partition; ++z) {
    const float weight = exp2f(ml[z * 2] - m);
    l += weight * ml[z * 2 + 1];
    o += weight * acc[z * HEAD_DIM + d];
  }
  out[row * HEAD_DIM + d] = from_float<T>(l > 0.f ? o / l : 0.f);
}

int max_partitions(const PagedAttentionArgs& a) {
  return (a.max_blocks_per_seq * a.block_size + a.partition_size - 1) / a.partition_size;
}

template <typename T, typename C, int HEAD_DIM, int HEADS_PER_BLOCK>
void launch(const PagedAttentionArgs& a, cudaStream_t stream) {
  T* out = static_cast<T*>(a.out);
  const T* q = static_cast<const T*>(a.q);
  const C* k_cache = static_cast<const C*>(a.k_cache);
  const C* v_cache = static_cast<const C*>(a.v_cache);
  const float scale_log2 = a.scale * kLog2e;
  if (a.partition_size == 0) {
    const dim3 grid(a.num_seqs, a.num_heads / HEADS_PER_BLOCK);
    LAUNCH_KERNEL((paged_attention_kernel<T, C, HEAD_DIM, HEADS_PER_BLOCK>), grid, kThreads, stream)(
        out, q, k_cache, v_cache, a.k_scales, a.v_scales, a.block_tables, a.context_lens, a.window_starts,
        a.num_heads, a.num_kv_heads, a.block_size, a.max_blocks_per_seq, scale_log2);
    return;
  }
  const dim3 grid(a.num_seqs, a.num_heads / HEADS_PER_BLOCK, max_partitions(a));
  LAUNCH_KERNEL((paged_attention_partition_kernel<T, C, HEAD_DIM, HEADS_PER_BLOCK>), grid, kThreads, stream)(
      a.partial_ml, a.partial_acc, q, k_cache, v_cache, a.k_scales, a.v_scales, a.block_tables, a.context_lens,
      a.window_starts, a.num_heads, a.num_kv_heads, a.block_size, a.max_blocks_per_seq, a.partition_size,
      scale_log2);
  LAUNCH_KERNEL((paged_attention_reduce_kernel<T, HEAD_DIM>), dim3(a.num_seqs, a.num_heads), HEAD_DIM, stream)(
      out, a.partial_ml, a.partial_acc, a.context_lens, a.window_starts, a.max_blocks_per_seq * a.block_size,
      max_partitions(a), a.partition_size);
}

// A block serves the largest of 8, 4, 2, 1 query heads that divides the GQA group. Groups of
// 1, 2, 4 and 8 are served whole; a group of 6 takes 3 blocks of 2 heads, each reading the KV.
template <typename T, typename C, int HEAD_DIM>
void launch_for_group(const PagedAttentionArgs& a, cudaStream_t stream) {
  const int group = a.num_heads / a.num_kv_heads;
  if (group % 8 == 0) return launch<T, C, HEAD_DIM, 8>(a, stream);
  if (group % 4 == 0) return launch<T, C, HEAD_DIM, 4>(a, stream);
  if (group % 2 == 0) return launch<T, C, HEAD_DIM, 2>(a, stream);
  return launch<T, C, HEAD_DIM, 1>(a, stream);
}

// NOTE: every (dtype, cache format, head_dim, group) is a kernel of its own: 189 of them, which
// nvcc compiles one by one. PAGED_ATTENTION_COMPILE_CHECK instantiates head_dim 128 only (every
// dtype, format and group still), for a test that checks the source compiles, not for running.
template <typename T, typename C>
void launch_for_head_dim(const PagedAttentionArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
#ifndef PAGED_ATTENTION_COMPILE_CHECK
    case 32: return launch_for_group<T, C, 32>(a, stream);
    case 64: return launch_for_group<T, C, 64>(a, stream);
#endif
    case 128: return launch_for_group<T, C, 128>(a, stream);
  }
}

// One-byte caches are read with a float32 (CPU emulation, tests) or bfloat16 (GPU) query only:
// float16 queries with them would add kernels no engine of the course runs.
template <typename T>
void launch_for_cache(const PagedAttentionArgs& a, cudaStream_t stream) {
  switch (a.cache_format) {
    case KvCacheFormat::kSameAsQuery: return launch_for_head_dim<T, T>(a, stream);
    case KvCacheFormat::kFp8E4m3: return launch_for_head_dim<T, Fp8E4m3>(a, stream);
    case KvCacheFormat::kInt8: return launch_for_head_dim<T, int8_t>(a, stream);
  }
}

int element_bytes(KvDtype dtype) { return dtype == KvDtype::kFloat32 ? 4 : 2; }

int cache_element_bytes(const PagedAttentionArgs& a) {
  return a.cache_format == KvCacheFormat::kSameAsQuery ? element_bytes(a.dtype) : 1;
}

const char* check_args(const PagedAttentionArgs& a) {
  if (a.num_seqs < 0 || a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads) {
    return "paged_attention: num_heads must be a positive multiple of num_kv_heads";
  }
  if (a.head_dim != 32 && a.head_dim != 64 && a.head_dim != 128) {
    return "paged_attention: head_dim must be 32, 64 or 128";
  }
  if (a.dtype != KvDtype::kFloat32 && a.dtype != KvDtype::kFloat16 && a.dtype != KvDtype::kBFloat16) {
    return "paged_attention: dtype must be float32, float16 or bfloat16";
  }
  if (a.cache_format != KvCacheFormat::kSameAsQuery && a.cache_format != KvCacheFormat::kFp8E4m3 &&
      a.cache_format != KvCacheFormat::kInt8) {
    return "paged_attention: cache_format must be kSameAsQuery, kFp8E4m3 or kInt8";
  }
  if (a.cache_format != KvCacheFormat::kSameAsQuery && (a.k_scales == nullptr || a.v_scales == nullptr)) {
    return "paged_attention: an fp8 or int8 cache needs k_scales and v_scales";
  }
  if (a.cache_format != KvCacheFormat::kSameAsQuery && a.dtype == KvDtype::kFloat16) {
    return "paged_attention: an fp8 or int8 cache is read with a float32 or bfloat16 query, not float16";
  }
  const bool power_of_two = (a.block_size & (a.block_size - 1)) == 0;
  if (!power_of_two || a.block_size < kMinBlockSize || a.block_size > kMaxBlockSize) {
    return "paged_attention: block_size must be a power of two from 8 to 128";
  }
  if (a.max_blocks_per_seq < 1) return "paged_attention: block_tables needs at least one column";
  if (a.partition_size < 0 || a.partition_size % kTileTokens) {
    return "paged_attention: partition_size must be 0 (single pass) or a positive multiple of 8";
  }
  if (a.partition_size > 0 && (a.partial_ml == nullptr || a.partial_acc == nullptr)) {
    return "paged_attention: split-K needs the partial_ml and partial_acc buffers";
  }
  // The widest load is one lane's Vec: head_dim / 32 elements. Every row starts head_dim elements
  // after the previous one, so an aligned base pointer aligns every row.
  const auto misaligned = [&](const void* p, int element_size) {
    return reinterpret_cast<uintptr_t>(p) % (uintptr_t(element_size) * (a.head_dim / kWarpSize)) != 0;
  };
  const int io_bytes = element_bytes(a.dtype), cache_bytes = cache_element_bytes(a);
  if (misaligned(a.out, io_bytes) || misaligned(a.q, io_bytes) || misaligned(a.k_cache, cache_bytes) ||
      misaligned(a.v_cache, cache_bytes)) {
    return "paged_attention: out, q, k_cache and v_cache must start on a multiple of "
           "(their element size * head_dim / 32) bytes";
  }
  return nullptr;
}

}  // namespace

const char* paged_attention_launch(const PagedAttentionArgs& args, cudaStream_t stream) {
  if (const char* error = check_args(args)) return error;
  if (args.num_seqs == 0) return nullptr;  // an empty batch: nothing to launch
  switch (args.dtype) {
    case KvDtype::kFloat32: launch_for_cache<float>(args, stream); break;
    case KvDtype::kFloat16: launch_for_head_dim<__half, __half>(args, stream); break;
    case KvDtype::kBFloat16: launch_for_cache<__nv_bfloat16>(args, stream); break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}
