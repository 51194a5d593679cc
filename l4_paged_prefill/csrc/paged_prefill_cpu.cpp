// Paged attention for a ragged batch of queries, written for a CPU's cores (float32).
//
// Inputs and rules as in paged_prefill.h. The work is cut into items that torch's OpenMP threads
// take in turn:
//
//   a tile of several rows        (request, up to kTileRows of its query rows, one KV head): the
//   (a prefill chunk)             tile walks the keys it reads (its first row's first to its last
//                                 row's end) kKeyTile positions at a time, across block boundaries,
//                                 each through the block table; copies the keys' K transposed into
//                                 scratch and computes the scores as register micro-tiles (4 rows x
//                                 16 keys); then each row's online-softmax step; then the value
//                                 micro-tiles (4 rows x 16 output elements) read the V rows in place
//   one row (a decode)            (request, that row, every head): each position's K and V rows of
//                                 all KV heads are one contiguous read, scored as they are read (a
//                                 dot product per query head): the time is the bytes of K and V
//
// Every key row is read once per item, for all its rows (its query rows times the G query heads of
// a KV head). Successive positions lie a page or more apart: the kernel prefetches them itself.
//
// The caches may also hold L12's one-byte codes (fp8 e4m3 or int8, one scale per KV head): each
// key and value row is then dequantized once, as it is read, for every row of the tile
// (l3_block_kernel/csrc/kv_codes.h, shared with L3's CPU kernel). q and out stay float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_codes.h"
#include "paged_prefill.h"

#include "openmp_threads.h"

namespace {

using kv_codes::rows_as_float;

constexpr int kTileRows = 16;               // query rows per item
constexpr int64_t kMinWorkPerThread = 1 << 18;  // multiply-adds worth a thread's start-up
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The register tiles of the two products, written with GCC's (and clang's) vector types so that
// the accumulators stay in registers: a Vec is 8 floats, one AVX register (two SSE ones without
// AVX). A score micro-tile is kRowGroup rows x kKeys keys: each key column of K is loaded once for
// 4 rows. A value micro-tile is kRowGroup rows x kDims output elements: each piece of a V row is
// loaded once for 4 rows. This is what a BLAS micro-kernel does, on a block of 16 keys.
typedef float Vec __attribute__((vector_size(32)));
constexpr int kLanes = 8;
constexpr int kRowGroup = 4;
constexpr int kKeys = 2 * kLanes;
constexpr int kDims = 2 * kLanes;

Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

typedef int Lanes __attribute__((vector_size(32)));

// Lane i of v moved to lane `order[i]`: GCC's and clang's spellings of one shuffle.
inline Vec shuffled(Vec v, Lanes order) {
#if defined(__clang__)
  return __builtin_shufflevector(v, v, order[0], order[1], order[2], order[3], order[4], order[5], order[6], order[7]);
#else
  return __builtin_shuffle(v, order);
#endif
}

// The sum of a Vec's lanes as a tree of three shuffles and adds: a serial sum of eight lanes is a
// chain of eight dependent adds, and a decode row ends one dot product per head per key with it.
inline float lane_sum(Vec v) {
  v += shuffled(v, Lanes{4, 5, 6, 7, 0, 1, 2, 3});
  v += shuffled(v, Lanes{2, 3, 0, 1, 6, 7, 4, 5});
  v += shuffled(v, Lanes{1, 0, 3, 2, 5, 4, 7, 6});
  return v[0];
}

float dot(const float* a, const float* b, int n) {
  Vec acc0 = {}, acc1 = {};  // two chains of adds, not one
  int i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    acc0 += load(a + i) * load(b + i);
    acc1 += load(a + i + kLanes) * load(b + i + kLanes);
  }
  for (; i + kLanes <= n; i += kLanes) acc0 += load(a + i) * load(b + i);
  float sum = lane_sum(acc0 + acc1);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Keys are taken kKeyTile positions at a time, across block boundaries: each row's softmax state
// is updated once per 64 keys, not once per block of 16, and the micro-tiles run longer.
constexpr int kKeyTile = 32;
constexpr int kPrefetch = 4;  // key rows read ahead

// Per tile, rows padded to a multiple of kRowGroup (padding rows read no key): the scaled queries
// qs [rows, D]; the running softmax state of each row (maximum m, sum l of exp(score - m),
// acc = sum of exp(score - m) * v [rows, D]); one key tile's scores, then weights,
// [rows, kKeyTile], and the keys of it each row reads; the key tile's K transposed,
// kt [D, kKeyTile] (zeros past the keys in use); its V rows (in the pool, or dequantized into
// vb [kKeyTile, D] for codes); one dequantized K row [D].
struct TileState {
  int rows;
  float *qs, *acc, *scores, *m, *l, *kt, *vb, *row;
  int *key_lo, *key_hi;
  const float** v_rows;
};

struct Scratch {  // one per thread, sized for the largest tile: max_rows rows, KV rows of `heads` heads
  std::vector<float> floats;
  std::vector<int> ranges;
  std::vector<const float*> v_rows;
  Scratch(int max_rows, int D, int heads)
      : floats(size_t(round_up(max_rows, kRowGroup)) * (2 * D + kKeyTile + 2) + size_t(D) * kKeyTile +
               size_t(kKeyTile + 1) * heads * D),
        ranges(2 * round_up(max_rows, kRowGroup)),
        v_rows(kKeyTile) {}

  TileState tile(int rows, int D, int heads = 1) {
    TileState st;
    st.rows = round_up(rows, kRowGroup);
    st.qs = floats.data();
    st.acc = st.qs + st.rows * D;
    st.scores = st.acc + st.rows * D;
    st.m = st.scores + st.rows * kKeyTile;
    st.l = st.m + st.rows;
    st.kt = st.l + st.rows;
    st.vb = st.kt + D * kKeyTile;
    st.row = st.vb + kKeyTile * D * heads;
    st.key_lo = ranges.data();
    st.key_hi = st.key_lo + st.rows;
    st.v_rows = v_rows.data();
    return st;
  }
};

// exp(x) for finite x <= 0 (a score minus the running maximum), within a few ulp of std::exp.
// Branch-free, so that the compiler vectorises a loop of them: std::exp is a call per element,
// and a tile computes rows x keys of them (most of a prefill tile's time with a libm call).
// x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two parts, so that r is exact), then e^r by its
// Taylor series to r^7 (the next term is below float's rounding), times 2^n through the exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // exp(-87) is float's smallest normal order: below it the term is 0 to the sum
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float two_to_n;
  std::memcpy(&two_to_n, &bits, sizeof two_to_n);
  return p * two_to_n;
}

// Asks for the `count` elements at `at` of K and of V ahead of their use: successive positions lie
// a page or more apart in the pool (a position's rows are H_kv * D elements, and a head's rows are
// a position apart), and hardware prefetchers do not cross pages.
template <typename C>
void prefetch_rows(const C* k_cache, const C* v_cache, int64_t at, int64_t count) {
  for (int64_t byte = 0; byte < count * int64_t(sizeof(C)); byte += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(k_cache + at) + byte);
    __builtin_prefetch(reinterpret_cast<const char*>(v_cache + at) + byte);
  }
}

// What the caches hold: float32 (no scales), or codes with one scale per KV head.
struct Scales {
  const float* k;  // [num_kv_heads], or nullptr for a float32 cache
  const float* v;
};

// scores[r0 .. r0 + 4, c0 .. c0 + kKeys) = qs[r] . kt[:, c]: rows r0.. of the tile against kKeys
// key columns of the transposed block.
void score_micro_tile(const TileState& st, int D, int r0, int c0) {
  Vec acc[kRowGroup][2] = {};
  for (int d = 0; d < D; ++d) {
    const float* k = st.kt + d * kKeyTile + c0;
    const Vec k0 = load(k), k1 = load(k + kLanes);
    for (int i = 0; i < kRowGroup; ++i) {
      const float q = st.qs[(r0 + i) * D + d];
      acc[i][0] += q * k0;
      acc[i][1] += q * k1;
    }
  }
  for (int i = 0; i < kRowGroup; ++i) {
    float* out = st.scores + (r0 + i) * kKeyTile + c0;
    store(out, acc[i][0]);
    store(out + kLanes, acc[i][1]);
  }
}

// acc[r0 .. r0 + 4, d0 .. d0 + kDims) += sum over t in [t0, t1) of weight[r][t] * v[t][d]; a
// row's weights outside the keys it reads are 0.
void value_micro_tile(const TileState& st, int D, int r0, int d0, int t0, int t1) {
  Vec acc[kRowGroup][2];
  for (int i = 0; i < kRowGroup; ++i) {
    acc[i][0] = load(st.acc + (r0 + i) * D + d0);
    acc[i][1] = load(st.acc + (r0 + i) * D + d0 + kLanes);
  }
  for (int t = t0; t < t1; ++t) {
    const Vec v0 = load(st.v_rows[t] + d0), v1 = load(st.v_rows[t] + d0 + kLanes);
    for (int i = 0; i < kRowGroup; ++i) {
      const float p = st.scores[(r0 + i) * kKeyTile + t];
      acc[i][0] += p * v0;
      acc[i][1] += p * v1;
    }
  }
  for (int i = 0; i < kRowGroup; ++i) {
    store(st.acc + (r0 + i) * D + d0, acc[i][0]);
    store(st.acc + (r0 + i) * D + d0 + kLanes, acc[i][1]);
  }
}

// The online-softmax step of row r for its keys [lo, hi) of the key tile (their scores in place):
// rescale the row's state to the new maximum, and leave the weights exp(score - m) in its scores,
// 0 for the tile's other keys [0, width).
void softmax_step(const TileState& st, int D, int r, int width) {
  const int t0 = 0, t1 = width;
  float* s = st.scores + r * kKeyTile;
  const int lo = st.key_lo[r], hi = st.key_hi[r];
  if (lo >= hi) {  // the row reads nothing here
    std::fill(s + t0, s + t1, 0.0f);
    return;
  }
  float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
  for (int t = lo; t < hi; ++t) block_max = std::max(block_max, s[t]);
  const float m_new = std::max(st.m[r], block_max);
  const float rescale = st.m[r] == kNegInf ? 0.0f : exp_nonpositive(st.m[r] - m_new);
  float* acc = st.acc + r * D;
  for (int d = 0; d < D; ++d) acc[d] *= rescale;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int t = lo; t < hi; ++t) {
    s[t] = exp_nonpositive(s[t] - m_new);
    sum += s[t];
  }
  std::fill(s + t0, s + lo, 0.0f);
  std::fill(s + hi, s + t1, 0.0f);
  st.l[r] = st.l[r] * rescale + sum;
  st.m[r] = m_new;
}

// Request `seq`, its query rows [r0, r1), KV head `kv`: rows of the tile are (query i, group g).
// C: the caches' element type (float, or a code type of kv_codes.h).
template <typename C>
void attend_tile(const PagedPrefillArgs& a, Scales scales, int seq, int r0, int r1, int kv, Scratch& scratch) {
  const int D = a.head_dim, G = a.num_heads / a.num_kv_heads, bs = a.block_size;
  const int queries = r1 - r0, rows = queries * G;
  const int n = a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq], len = a.context_lens[seq];
  const int first_pos = len - n + (r0 - a.cu_seqlens_q[seq]);  // the causal offset of row r0
  const int64_t row_stride = int64_t(a.num_kv_heads) * D;      // one position of one block
  const float* q = static_cast<const float*>(a.q);
  TileState st = scratch.tile(rows, D);
  std::fill(st.qs, st.qs + st.rows * D, 0.0f);  // padding rows: zero queries, no keys
  for (int i = 0; i < queries; ++i) {
    for (int g = 0; g < G; ++g) {
      const float* src = q + (int64_t(r0 + i) * a.num_heads + kv * G + g) * D;
      for (int d = 0; d < D; ++d) st.qs[(i * G + g) * D + d] = src[d] * a.scale;
    }
  }
  std::fill(st.acc, st.acc + st.rows * D, 0.0f);
  std::fill(st.m, st.m + st.rows, kNegInf);
  std::fill(st.l, st.l + st.rows, 0.0f);

  int lo, hi, unused;  // the keys the tile reads: from its first row's first to its last row's end
  key_range(a, seq, first_pos, &lo, &unused);
  key_range(a, seq, first_pos + queries - 1, &unused, &hi);
  const int32_t* table = a.block_tables + int64_t(seq) * a.max_blocks;
  const C* k_cache = static_cast<const C*>(a.k_cache);
  const C* v_cache = static_cast<const C*>(a.v_cache);
  const float* k_scale = scales.k == nullptr ? nullptr : scales.k + kv;  // this KV head's
  const float* v_scale = scales.v == nullptr ? nullptr : scales.v + kv;
  for (int c0 = lo; c0 < hi; c0 += kKeyTile) {
    const int width = std::min(kKeyTile, hi - c0);  // keys c0 .. c0 + width of the request
    // A tile of a few rows (a decode) scores each key row as it reads it, one dot product per row:
    // its time is the bytes of K and V, and a transposed copy would add to them. A tile of many
    // rows copies the keys transposed once and runs the score micro-tiles on them.
    const bool few_rows = st.rows <= kRowGroup;
    auto offset = [&](int p) { return (int64_t(table[p / bs]) * bs + p % bs) * row_stride + int64_t(kv) * D; };
    for (int t = 0; t < kKeyTile; ++t) {  // K (transposed, zeros past width; or scored), V rows
      const int p = c0 + t;
      const int64_t at = t < width ? offset(p) : 0;
      if (t + kPrefetch < width) prefetch_rows(k_cache, v_cache, offset(p + kPrefetch), D);
      const float* k = t < width ? rows_as_float(k_cache + at, k_scale, 1, D, st.row) : nullptr;
      if (few_rows) {
        for (int r = 0; r < st.rows && k != nullptr; ++r) st.scores[r * kKeyTile + t] = dot(st.qs + r * D, k, D);
      } else {
        for (int d = 0; d < D; ++d) st.kt[d * kKeyTile + t] = k == nullptr ? 0.0f : k[d];
      }
      if (t < width) st.v_rows[t] = rows_as_float(v_cache + at, v_scale, 1, D, st.vb + t * D);
    }
    for (int r = 0; r < st.rows; ++r) {  // the keys of this tile each row reads
      int first = 0, end = 0;
      if (r < rows) key_range(a, seq, first_pos + r / G, &first, &end);
      st.key_lo[r] = std::max(0, first - c0);
      st.key_hi[r] = std::max(st.key_lo[r], std::min(width, end - c0));
    }
    for (int r = 0; r < st.rows && !few_rows; r += kRowGroup) {
      for (int c = 0; c < width; c += kKeys) score_micro_tile(st, D, r, c);
    }
    for (int r = 0; r < st.rows; ++r) softmax_step(st, D, r, width);
    for (int r = 0; r < st.rows; r += kRowGroup) {
      int d = 0;
      for (; d + kDims <= D; d += kDims) value_micro_tile(st, D, r, d, 0, width);
      for (; d < D; ++d) {  // a head_dim that is not a multiple of kDims: the rest one by one
        for (int i = 0; i < kRowGroup; ++i) {
          for (int t = 0; t < width; ++t) st.acc[(r + i) * D + d] += st.scores[(r + i) * kKeyTile + t] * st.v_rows[t][d];
        }
      }
    }
  }
  float* out = static_cast<float*>(a.out);
  for (int i = 0; i < queries; ++i) {
    for (int g = 0; g < G; ++g) {
      const int r = i * G + g, head = kv * G + g;
      const int64_t row = int64_t(r0 + i) * a.num_heads + head;
      const float inv = st.l[r] > 0.0f ? 1.0f / st.l[r] : 0.0f;  // a row with no key: 0
      for (int d = 0; d < D; ++d) out[row * D + d] = st.acc[r * D + d] * inv;
      if (a.lse != nullptr) a.lse[row] = st.l[r] > 0.0f ? st.m[r] + std::log(st.l[r]) : kNegInf;
    }
  }
}

// acc[0, D) += sum over t in [0, width) of p[t] * v_rows[t][offset + d]: one head's weighted values.
// Four Vecs of acc stay in registers across the keys (through memory, each key's adds would wait
// for the previous key's stores).
void accumulate_values(float* acc, const float* p, const float* const* v_rows, int64_t offset, int width, int D) {
  int d = 0;
  for (; d + 4 * kLanes <= D; d += 4 * kLanes) {
    Vec a0 = load(acc + d), a1 = load(acc + d + kLanes), a2 = load(acc + d + 2 * kLanes), a3 = load(acc + d + 3 * kLanes);
    for (int t = 0; t < width; ++t) {
      const float* v = v_rows[t] + offset + d;
      a0 += p[t] * load(v);
      a1 += p[t] * load(v + kLanes);
      a2 += p[t] * load(v + 2 * kLanes);
      a3 += p[t] * load(v + 3 * kLanes);
    }
    store(acc + d, a0);
    store(acc + d + kLanes, a1);
    store(acc + d + 2 * kLanes, a2);
    store(acc + d + 3 * kLanes, a3);
  }
  for (; d < D; ++d) {  // a head_dim that is not a multiple of 32: the rest one by one
    for (int t = 0; t < width; ++t) acc[d] += p[t] * v_rows[t][offset + d];
  }
}

// One query row of request `seq` (a decode, or a chunk's lone last row) for every query head at
// once: a position's K (and V) rows of all KV heads lie side by side in its block, so each key is
// one contiguous read of H_kv * D elements, as in L3's decode walk, instead of H_kv reads a page
// apart. Scores are dot products as each row is read: one row's time is the bytes of K and V.
template <typename C>
void attend_single_row(const PagedPrefillArgs& a, Scales scales, int seq, int row, Scratch& scratch) {
  const int D = a.head_dim, H = a.num_heads, H_kv = a.num_kv_heads, G = H / H_kv, bs = a.block_size;
  const int64_t row_stride = int64_t(H_kv) * D;
  const int n = a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq], len = a.context_lens[seq];
  const int pos = len - n + (row - a.cu_seqlens_q[seq]);  // the causal offset
  TileState st = scratch.tile(H, D, H_kv);
  const float* q = static_cast<const float*>(a.q) + int64_t(row) * H * D;
  for (int i = 0; i < H * D; ++i) st.qs[i] = q[i] * a.scale;
  std::fill(st.acc, st.acc + H * D, 0.0f);
  std::fill(st.m, st.m + H, kNegInf);
  std::fill(st.l, st.l + H, 0.0f);
  int lo, hi;
  key_range(a, seq, pos, &lo, &hi);
  const int32_t* table = a.block_tables + int64_t(seq) * a.max_blocks;
  const C* k_cache = static_cast<const C*>(a.k_cache);
  const C* v_cache = static_cast<const C*>(a.v_cache);
  auto offset = [&](int p) { return (int64_t(table[p / bs]) * bs + p % bs) * row_stride; };
  for (int c0 = lo; c0 < hi; c0 += kKeyTile) {
    const int width = std::min(kKeyTile, hi - c0);
    for (int t = 0; t < width; ++t) {
      const int64_t at = offset(c0 + t);
      if (c0 + t + kPrefetch < hi) prefetch_rows(k_cache, v_cache, offset(c0 + t + kPrefetch), row_stride);
      const float* k = rows_as_float(k_cache + at, scales.k, H_kv, D, st.row);
      for (int h = 0; h < H; ++h) st.scores[h * kKeyTile + t] = dot(st.qs + h * D, k + (h / G) * D, D);
      st.v_rows[t] = rows_as_float(v_cache + at, scales.v, H_kv, D, st.vb + int64_t(t) * H_kv * D);
    }
    for (int h = 0; h < H; ++h) {
      st.key_lo[h] = 0;
      st.key_hi[h] = width;
      softmax_step(st, D, h, width);
    }
    for (int h = 0; h < H; ++h) {
      accumulate_values(st.acc + h * D, st.scores + h * kKeyTile, st.v_rows, (h / G) * D, width, D);
    }
  }
  float* out = static_cast<float*>(a.out) + int64_t(row) * H * D;
  for (int h = 0; h < H; ++h) {
    const float inv = st.l[h] > 0.0f ? 1.0f / st.l[h] : 0.0f;  // a row with no key: 0
    for (int d = 0; d < D; ++d) out[h * D + d] = st.acc[h * D + d] * inv;
    if (a.lse != nullptr) a.lse[int64_t(row) * H + h] = st.l[h] > 0.0f ? st.m[h] + std::log(st.l[h]) : kNegInf;
  }
}

thread_local char error_message[320];  // per calling thread: ctypes releases the GIL

}  // namespace

// Returns nullptr, or a one-line message naming the first bad length, row offset or block id
// (checked before any thread starts, so a bad table never reads outside the pool).
// cache_format: 0 float32 (k_scales, v_scales null), 1 fp8 e4m3 codes, 2 int8 codes.
extern "C" const char* l4_cpu_paged_prefill(
    float* out, float* lse, const float* q, const void* k_cache, const void* v_cache,
    const int32_t* cu_seqlens_q, const int32_t* context_lens, const int32_t* block_tables,
    int num_seqs, int num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int max_blocks, int num_blocks, int max_query_len, float scale, int window, int key_begin,
    int causal, int num_threads, int cache_format, const float* k_scales, const float* v_scales) {
  const PagedPrefillArgs a{out, lse, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                           num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size,
                           max_blocks, num_blocks, max_query_len, scale, window, key_begin, causal,
                           PrefillDtype::kFloat32};
  if (num_kv_heads < 1 || num_heads % num_kv_heads) return "num_heads must be a multiple of num_kv_heads";
  using kv_codes::Fp8E4m3;
  using Tile = void (*)(const PagedPrefillArgs&, Scales, int, int, int, int, Scratch&);
  using Row = void (*)(const PagedPrefillArgs&, Scales, int, int, Scratch&);
  Tile attend = nullptr;
  Row attend_row = nullptr;
  if (cache_format == kv_codes::kFloat32) {
    attend = attend_tile<float>, attend_row = attend_single_row<float>;
  } else if (cache_format == kv_codes::kFp8E4m3) {
    attend = attend_tile<Fp8E4m3>, attend_row = attend_single_row<Fp8E4m3>;
  } else if (cache_format == kv_codes::kInt8) {
    attend = attend_tile<int8_t>, attend_row = attend_single_row<int8_t>;
  }
  if (attend == nullptr) return "cache_format must be 0 (float32), 1 (fp8 e4m3) or 2 (int8)";
  if ((cache_format != kv_codes::kFloat32) != (k_scales != nullptr && v_scales != nullptr)) {
    return "k_scales and v_scales go with an fp8 or int8 cache, and only with one";
  }
  const Scales scales{k_scales, v_scales};
  if (const char* error = check_prefill_tables(a, error_message, sizeof error_message)) return error;

  // Items: every request's rows cut into tiles; a tile of several rows makes one item per KV head,
  // a tile of one row one item for all heads (attend_single_row). Small calls run on the calling
  // thread alone: handing work to other threads costs microseconds.
  struct Item {
    int seq, row, kv;  // kv -1: one row, every head
  };
  std::vector<Item> items;
  int64_t work = 0;
  for (int s = 0; s < num_seqs; ++s) {
    for (int r = cu_seqlens_q[s]; r < cu_seqlens_q[s + 1]; r += kTileRows) {
      if (cu_seqlens_q[s + 1] - r == 1) {
        items.push_back({s, r, -1});
      } else {
        for (int kv = 0; kv < num_kv_heads; ++kv) items.push_back({s, r, kv});
      }
    }
    work += int64_t(cu_seqlens_q[s + 1] - cu_seqlens_q[s]) * context_lens[s] * num_heads * head_dim;
  }
  const int count = int(items.size());
  const int workers = int(std::clamp<int64_t>(work / kMinWorkPerThread, 1, std::max(1, num_threads)));
  const int G = num_heads / num_kv_heads;
  #pragma omp parallel num_threads(std::max(1, std::min(workers, count)))
  {
    Scratch scratch(std::max(kTileRows * G, num_heads), head_dim, num_kv_heads);
    for (int i = omp_get_thread_num(); i < count; i += omp_get_num_threads()) {
      const Item& it = items[i];
      if (it.kv < 0) {
        attend_row(a, scales, it.seq, it.row, scratch);
      } else {
        attend(a, scales, it.seq, it.row, std::min(it.row + kTileRows, cu_seqlens_q[it.seq + 1]), it.kv, scratch);
      }
    }
  }
  return nullptr;
}
