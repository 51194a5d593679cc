// The engine's fused operations for a CPU in float32 (engine_ops.py builds and calls them).
//
// PyTorch runs the work between a layer's q/k/v product and its attention as about fifteen small
// operations: slice, view, RMSNorm (itself several), the weight, rotate-half's slices, negation and
// concatenation, two products and a sum, the split into q and k; and an RMSNorm as several more
// (torch's F.rms_norm on a CPU is a composite of square, mean, add, rsqrt and two products). Each
// costs microseconds of dispatch whatever its size, so for a few rows they cost far more than
// their arithmetic; here the same arithmetic is one call.

#include <cmath>
#include <cstdint>

extern "C" {

// qkv: num_rows rows of row_stride floats, each starting with num_heads heads of head_dim (q's
// heads, then k's; v's follow and are not read). weight [num_heads, head_dim]: each head's norm
// weight. cos, sin [num_rows, head_dim]: each row's rotary angles (both halves equal).
// out [num_rows, num_heads, head_dim]: each head x RMS-normalised in float32 (x / sqrt(mean(x^2) +
// eps)), times its weight, then rotated as rotate-half pairs dimension i with i + head_dim / 2:
//   out[i] = a[i] cos[i] - a[i + half] sin[i],   out[i + half] = a[i + half] cos[i + half] + a[i] sin[i + half]
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

void l5_qk_norm_rope(const float* qkv, int64_t row_stride, int num_rows, int num_heads, int head_dim,
                     const float* weight, float eps, const float* cos, const float* sin, float* out) {
  const int half = head_dim / 2;
  for (int t = 0; t < num_rows; ++t) {
    const float* c = cos + static_cast<int64_t>(t) * head_dim;
    const float* s = sin + static_cast<int64_t>(t) * head_dim;
    for (int h = 0; h < num_heads; ++h) {
      const float* x = qkv + t * row_stride + static_cast<int64_t>(h) * head_dim;
      const float* w = weight + static_cast<int64_t>(h) * head_dim;
      float* o = out + (static_cast<int64_t>(t) * num_heads + h) * head_dim;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < head_dim; ++i) sum += x[i] * x[i];
      const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(head_dim) + eps);
      for (int i = 0; i < half; ++i) {
        const float a = x[i] * inv_rms * w[i];
        const float b = x[i + half] * inv_rms * w[i + half];
        o[i] = a * c[i] - b * s[i];
        o[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
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
