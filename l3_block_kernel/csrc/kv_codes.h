// One-byte KV codes on a CPU (L12): what an fp8 e4m3 or int8 code in the cache stands for, and
// a row of codes turned into floats. Shared by L3's and L4's CPU kernels.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kv_codes {

// The cache formats of paged_attention.h's KvCacheFormat: 0 float32 (q's dtype here), 1, 2 codes.
enum CacheFormat { kFloat32 = 0, kFp8E4m3 = 1, kInt8 = 2 };

struct Fp8E4m3 {
  uint8_t bits;
};

// e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, s 1111 111 is NaN.
inline float e4m3_to_float(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::numeric_limits<float>::quiet_NaN();
  const float magnitude = exponent == 0 ? std::ldexp(float(mantissa), -9)           // subnormal
                                        : std::ldexp(float(8 + mantissa), exponent - 10);  // (1 + m/8) 2^(e-7)
  return bits & 0x80 ? -magnitude : magnitude;
}

// All 256 codes decoded once: a table lookup per element in the hot loop.
inline const std::array<float, 256> kE4m3Values = [] {
  std::array<float, 256> values;
  for (int bits = 0; bits < 256; ++bits) values[bits] = e4m3_to_float(uint8_t(bits));
  return values;
}();

inline float to_float(Fp8E4m3 x) { return kE4m3Values[x.bits]; }
inline float to_float(int8_t x) { return x == -128 ? std::numeric_limits<float>::quiet_NaN() : float(x); }

// The K (or V) rows of one position for KV heads [h0, h0 + heads), as floats. A float32 cache is
// read in place. Codes are dequantized into `buffer`, float32(code) * scale exactly as L12's
// dequantize computes it, once per row for all the G query heads that read it: the dot products
// and updates below then run on floats as for a float32 cache (scales folded into q and the
// output instead would need the same per-element conversion, and differ from dequantize in the
// last bit).
inline const float* rows_as_float(const float* rows, const float* /*scales*/, int /*heads*/, int /*D*/, float* /*buffer*/) {
  return rows;
}

template <typename C>
const float* rows_as_float(const C* rows, const float* scales, int heads, int D, float* buffer) {
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < D; ++i) buffer[h * D + i] = to_float(rows[h * D + i]) * scales[h];
  }
  return buffer;
}

}  // namespace kv_codes
