// Paged attention for a ragged batch of queries, written for a CPU's cores (float32).
//
// Inputs and rules as in paged_prefill.h. The work is cut into items of (request, tile of up to
// kTileRows of its query rows, KV head); torch's OpenMP threads take items in turn. An item walks
// the blocks its tile reads once, from the first key any of its rows may read to the last, and
// every row of the tile (each query row times the G query heads of the KV head) scores each key
// row as it passes: a key row is read from memory once per tile, not once per query. A decode is
// a tile of one row, and the walk is then L3's.
//
// The caches may also hold L12's one-byte codes (fp8 e4m3 or int8, one scale per KV head): each
// key and value row is then dequantized once, as it is read, for every row of the tile
// (l3_block_kernel/csrc/kv_codes.h, shared with L3's CPU kernel). q and out stay float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kv_codes.h"
#include "paged_prefill.h"

#ifdef _OPENMP
#include <omp.h>
#else  // built without OpenMP: the calling thread does every item
static int omp_get_thread_num() { return 0; }
static int omp_get_num_threads() { return 1; }
#endif

namespace {

using kv_codes::rows_as_float;

constexpr int kTileRows = 16;               // query rows per item
constexpr int64_t kMinWorkPerThread = 1 << 18;  // multiply-adds worth a thread's start-up
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per tile: the scaled queries qs [rows, D], the running softmax state of each row (maximum m,
// sum l of exp(score - m), acc = sum of exp(score - m) * v [rows, D]), one block's scores
// [rows, block_size] and the keys each row reads in it, the block's K transposed (kt [D, block_size])
// and its V rows dequantized (vb [block_size, D], codes only), and one dequantized K row [D].
struct TileState {
  float *qs, *acc, *scores, *m, *l, *kt, *vb, *row;
  int *key_lo, *key_hi;  // [rows]: row r reads keys [key_lo, key_hi) of the current block
  const float** v_rows;  // [block_size]: each V row of the block, in the pool or in vb
  TileState(std::vector<float>& scratch, std::vector<int>& ranges, std::vector<const float*>& rows_of_v, int rows,
            int D, int block_size) {
    qs = scratch.data();
    acc = qs + rows * D;
    scores = acc + rows * D;
    m = scores + rows * block_size;
    l = m + rows;
    kt = l + rows;
    vb = kt + D * block_size;
    row = vb + block_size * D;
    key_lo = ranges.data();
    key_hi = key_lo + rows;
    v_rows = rows_of_v.data();
  }
};

size_t scratch_floats(int max_rows, int D, int block_size) {
  return size_t(max_rows) * (2 * D + block_size + 2) + 2 * size_t(D) * block_size + D;
}

// What the caches hold: float32 (no scales), or codes with one scale per KV head.
struct Scales {
  const float* k;  // [num_kv_heads], or nullptr for a float32 cache
  const float* v;
};

// Row r's scores against keys [lo, hi) of the block: D multiply-adds across contiguous keys of
// kt (vectorised across keys, no horizontal sum per key), then the online-softmax update. Leaves
// exp(score - m) in scores[r] for the V pass.
void score_and_rescale(TileState& st, int r, int D, int bs, int lo, int hi) {
  float* s = st.scores + r * bs;
  std::fill(s + lo, s + hi, 0.0f);
  const float* q = st.qs + r * D;
  for (int d = 0; d < D; ++d) {
    const float qd = q[d];
    const float* k = st.kt + d * bs;
#pragma omp simd
    for (int t = lo; t < hi; ++t) s[t] += qd * k[t];
  }
  const float block_max = *std::max_element(s + lo, s + hi);
  const float m_new = std::max(st.m[r], block_max);
  const float rescale = std::exp(st.m[r] - m_new);  // 0 while m is -inf
  float* acc = st.acc + r * D;
  for (int d = 0; d < D; ++d) acc[d] *= rescale;
  float sum = 0.0f;
  for (int t = lo; t < hi; ++t) {
    s[t] = std::exp(s[t] - m_new);
    sum += s[t];
  }
  st.l[r] = st.l[r] * rescale + sum;
  st.m[r] = m_new;
}

// Request `seq`, its query rows [r0, r1), KV head `kv`: rows of the tile are (query i, group g).
// C: the caches' element type (float, or a code type of kv_codes.h).
template <typename C>
void attend_tile(const PagedPrefillArgs& a, Scales scales, int seq, int r0, int r1, int kv,
                 std::vector<float>& scratch, std::vector<int>& ranges, std::vector<const float*>& v_rows) {
  const int D = a.head_dim, G = a.num_heads / a.num_kv_heads, bs = a.block_size;
  const int queries = r1 - r0, rows = queries * G;
  const int n = a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq], len = a.context_lens[seq];
  const int first_pos = len - n + (r0 - a.cu_seqlens_q[seq]);  // the causal offset of row r0
  const int64_t row_stride = int64_t(a.num_kv_heads) * D;      // one position of one block
  const float* q = static_cast<const float*>(a.q);
  TileState st(scratch, ranges, v_rows, rows, D, bs);
  for (int i = 0; i < queries; ++i) {
    for (int g = 0; g < G; ++g) {
      const float* src = q + (int64_t(r0 + i) * a.num_heads + kv * G + g) * D;
      for (int d = 0; d < D; ++d) st.qs[(i * G + g) * D + d] = src[d] * a.scale;
    }
  }
  std::fill(st.acc, st.acc + rows * D, 0.0f);
  std::fill(st.m, st.m + rows, kNegInf);
  std::fill(st.l, st.l + rows, 0.0f);

  int lo, hi, unused;  // the keys the tile reads: from its first row's first to its last row's end
  key_range(a, seq, first_pos, &lo, &unused);
  key_range(a, seq, first_pos + queries - 1, &unused, &hi);
  const int32_t* table = a.block_tables + int64_t(seq) * a.max_blocks;
  const C* k_cache = static_cast<const C*>(a.k_cache);
  const C* v_cache = static_cast<const C*>(a.v_cache);
  const float* k_scale = scales.k == nullptr ? nullptr : scales.k + kv;  // this KV head's
  const float* v_scale = scales.v == nullptr ? nullptr : scales.v + kv;
  for (int j = lo / bs; j * bs < hi; ++j) {
    const int t0 = std::max(0, lo - j * bs), t1 = std::min(bs, hi - j * bs);  // rows of the block in use
    const int64_t base = int64_t(table[j]) * bs * row_stride + int64_t(kv) * D;
    for (int t = t0; t < t1; ++t) {
      const float* k = rows_as_float(k_cache + base + t * row_stride, k_scale, 1, D, st.row);
      for (int d = 0; d < D; ++d) st.kt[d * bs + t] = k[d];
    }
    for (int i = 0; i < queries; ++i) {
      int first, end;
      key_range(a, seq, first_pos + i, &first, &end);
      const int key_lo = std::max(t0, first - j * bs), key_hi = std::min(t1, end - j * bs);
      for (int g = 0; g < G; ++g) {
        const int r = i * G + g;
        st.key_lo[r] = key_lo;
        st.key_hi[r] = key_hi;
        if (key_lo < key_hi) score_and_rescale(st, r, D, bs, key_lo, key_hi);
      }
    }
    for (int t = t0; t < t1; ++t) {  // V rows in place (float32) or dequantized once for every row
      st.v_rows[t] = rows_as_float(v_cache + base + t * row_stride, v_scale, 1, D, st.vb + t * D);
    }
    for (int r = 0; r < rows; ++r) {  // only the keys a row reads: a NaN in an unread slot never counts
      float* acc = st.acc + r * D;
      const float* p = st.scores + r * bs;
      for (int t = st.key_lo[r]; t < st.key_hi[r]; ++t) {
        const float* v = st.v_rows[t];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[d] += p[t] * v[d];
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
  void (*attend)(const PagedPrefillArgs&, Scales, int, int, int, int, std::vector<float>&, std::vector<int>&,
                 std::vector<const float*>&) =
      cache_format == kv_codes::kFloat32 ? attend_tile<float>
      : cache_format == kv_codes::kFp8E4m3 ? attend_tile<Fp8E4m3>
      : cache_format == kv_codes::kInt8 ? attend_tile<int8_t> : nullptr;
  if (attend == nullptr) return "cache_format must be 0 (float32), 1 (fp8 e4m3) or 2 (int8)";
  if ((cache_format != kv_codes::kFloat32) != (k_scales != nullptr && v_scales != nullptr)) {
    return "k_scales and v_scales go with an fp8 or int8 cache, and only with one";
  }
  const Scales scales{k_scales, v_scales};
  if (const char* error = check_prefill_tables(a, error_message, sizeof error_message)) return error;

  // Items: every request's rows cut into tiles, times the KV heads. Small calls run on the
  // calling thread alone: handing work to other threads costs microseconds.
  std::vector<int> item_seq, item_row;
  int64_t work = 0;
  for (int s = 0; s < num_seqs; ++s) {
    for (int r = cu_seqlens_q[s]; r < cu_seqlens_q[s + 1]; r += kTileRows) {
      item_seq.push_back(s);
      item_row.push_back(r);
    }
    work += int64_t(cu_seqlens_q[s + 1] - cu_seqlens_q[s]) * context_lens[s] * num_heads * head_dim;
  }
  const int items = int(item_seq.size()) * num_kv_heads;
  const int workers = int(std::clamp<int64_t>(work / kMinWorkPerThread, 1, std::max(1, num_threads)));
  const int G = num_heads / num_kv_heads;
  #pragma omp parallel num_threads(std::max(1, std::min(workers, items)))
  {
    std::vector<float> scratch(scratch_floats(kTileRows * G, head_dim, block_size));
    std::vector<int> ranges(2 * kTileRows * G);
    std::vector<const float*> v_rows(block_size);
    for (int item = omp_get_thread_num(); item < items; item += omp_get_num_threads()) {
      const int tile = item / num_kv_heads, kv = item % num_kv_heads, s = item_seq[tile];
      attend(a, scales, s, item_row[tile], std::min(item_row[tile] + kTileRows, cu_seqlens_q[s + 1]), kv, scratch,
             ranges, v_rows);
    }
  }
  return nullptr;
}
