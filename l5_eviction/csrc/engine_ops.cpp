// The engine's fused operations for a CPU in float32 (engine_ops.py builds and calls them).
//
// PyTorch runs the work between a layer's q/k/v product and its attention as about fifteen small
// operations: slice, view, RMSNorm (itself several), the weight, rotate-half's slices, negation and
// concatenation, two products and a sum, the split into q and k; and an RMSNorm as several more
// (torch's F.rms_norm on a CPU is a composite of square, mean, add, rsqrt and two products). Each
// costs microseconds of dispatch whatever its size, so for a few rows they cost far more than
// their arithmetic; here the same arithmetic is one call (with the K/V write after it, and the
// residual add before each norm, in the same pass).

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// One head of head_dim floats x: RMS-normalised in float32 (x / sqrt(mean(x^2) + eps)), times its
// weight w, then rotated as rotate-half pairs dimension i with i + head_dim / 2 by the row's c, s:
//   out[i] = a[i] c[i] - a[i + half] s[i],   out[i + half] = a[i + half] c[i + half] + a[i] s[i + half]
void norm_rope_head(const float* x, const float* w, float eps, const float* c, const float* s, int head_dim,
                    float* out) {
  const int half = head_dim / 2;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < head_dim; ++i) sum += x[i] * x[i];
  const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(head_dim) + eps);
  for (int i = 0; i < half; ++i) {
    const float a = x[i] * inv_rms * w[i];
    const float b = x[i + half] * inv_rms * w[i + half];
    out[i] = a * c[i] - b * s[i];
    out[i + half] = b * c[i + half] + a * s[i + half];
  }
}

}  // namespace

extern "C" {

// x: num_rows rows of dim floats, row_stride apart; out [num_rows, dim]:
// x / sqrt(mean(x^2) + eps) * weight, in float32 (L1's RMSNorm for a float32 model).
void l5_rms_norm(const float* x, int64_t row_stride, int num_rows, int dim, const float* weight, float eps,
                 float* out) {
  for (int t = 0; t < num_rows; ++t) {
    const float* row = x + t * row_stride;
    float* o = out + static_cast<int64_t>(t) * dim;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < dim; ++i) sum += row[i] * row[i];
    const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int i = 0; i < dim; ++i) o[i] = row[i] * inv_rms * weight[i];
  }
}

// x: num_rows rows of dim floats, x_stride apart; residual [num_rows, dim], updated in place to
// residual + x; out [num_rows, dim]: the updated residual through l5_rms_norm. One pass instead of
// a layer's residual add followed by the next norm (vLLM's fused_add_rms_norm).
void l5_add_rms_norm(const float* x, int64_t x_stride, float* residual, int num_rows, int dim,
                     const float* weight, float eps, float* out) {
  for (int t = 0; t < num_rows; ++t) {
    const float* add = x + t * x_stride;
    float* row = residual + static_cast<int64_t>(t) * dim;
#pragma omp simd
    for (int i = 0; i < dim; ++i) row[i] += add[i];
  }
  l5_rms_norm(residual, dim, num_rows, dim, weight, eps, out);
}

// qkv: num_rows rows of row_stride floats, each starting with num_heads heads of head_dim (q's
// heads, then k's; v's follow and are not read). weight [num_heads, head_dim]: each head's norm
// weight. cos, sin [num_rows, head_dim]: each row's rotary angles (both halves equal).
// out [num_rows, num_heads, head_dim]: each head through norm_rope_head.
void l5_qk_norm_rope(const float* qkv, int64_t row_stride, int num_rows, int num_heads, int head_dim,
                     const float* weight, float eps, const float* cos, const float* sin, float* out) {
  for (int t = 0; t < num_rows; ++t) {
    for (int h = 0; h < num_heads; ++h) {
      norm_rope_head(qkv + t * row_stride + static_cast<int64_t>(h) * head_dim, weight + static_cast<int64_t>(h) * head_dim,
                     eps, cos + static_cast<int64_t>(t) * head_dim, sin + static_cast<int64_t>(t) * head_dim, head_dim,
                     out + (static_cast<int64_t>(t) * num_heads + h) * head_dim);
    }
  }
}

// l5_qk_norm_rope with the cache step's write in the same pass. qkv: num_rows rows of row_stride
// floats, q's num_heads heads, k's num_kv_heads, v's num_kv_heads (head_dim each). weight
// [num_heads + num_kv_heads, head_dim]. q_out [num_rows, num_heads, head_dim]: q's heads normed and
// rotated. k_cache, v_cache [num_slots, num_kv_heads, head_dim]: row t's k (normed, rotated) and v
// (as it is) go to slot slot_mapping[t]. Returns nullptr, or a one-line message for a slot outside
// the pool (every slot is checked before anything is written).
const char* l5_qk_norm_rope_write(const float* qkv, int64_t row_stride, int num_rows, int num_heads,
                                  int num_kv_heads, int head_dim, const float* weight, float eps, const float* cos,
                                  const float* sin, float* q_out, float* k_cache, float* v_cache,
                                  const int64_t* slot_mapping, int64_t num_slots) {
  for (int t = 0; t < num_rows; ++t) {
    if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return "a slot of slot_mapping is outside the pool";
  }
  const int64_t kv_row = static_cast<int64_t>(num_kv_heads) * head_dim;  // one slot of K (or V)
  for (int t = 0; t < num_rows; ++t) {
    const float* row = qkv + t * row_stride;
    const float* c = cos + static_cast<int64_t>(t) * head_dim;
    const float* s = sin + static_cast<int64_t>(t) * head_dim;
    for (int h = 0; h < num_heads; ++h) {
      norm_rope_head(row + static_cast<int64_t>(h) * head_dim, weight + static_cast<int64_t>(h) * head_dim, eps, c, s,
                     head_dim, q_out + (static_cast<int64_t>(t) * num_heads + h) * head_dim);
    }
    const float* k = row + static_cast<int64_t>(num_heads) * head_dim;
    float* k_slot = k_cache + slot_mapping[t] * kv_row;
    for (int h = 0; h < num_kv_heads; ++h) {
      norm_rope_head(k + static_cast<int64_t>(h) * head_dim, weight + static_cast<int64_t>(num_heads + h) * head_dim,
                     eps, c, s, head_dim, k_slot + static_cast<int64_t>(h) * head_dim);
    }
    std::memcpy(v_cache + slot_mapping[t] * kv_row, k + kv_row, kv_row * sizeof(float));
  }
  return nullptr;
}

// gate_up [num_rows, 2 * width] (the gate's columns, then the up projection's) -> out [num_rows, width]:
// silu(gate) * up, with silu(g) = g / (1 + exp(-g)), as torch's F.silu.
void l5_silu_mul(const float* gate_up, int num_rows, int width, float* out) {
  for (int t = 0; t < num_rows; ++t) {
    const float* gate = gate_up + static_cast<int64_t>(t) * 2 * width;
    const float* up = gate + width;
    float* o = out + static_cast<int64_t>(t) * width;
    for (int i = 0; i < width; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

}  // extern "C"
