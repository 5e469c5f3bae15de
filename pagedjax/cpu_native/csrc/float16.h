// float16 to float32, exactly: block-quantized weights' scales and offsets (panels.h's
// kernels) and float16 KV pools (paged_attention.cc).
#pragma once

#include <cstdint>
#include <cstring>

#include "parallel.h"

namespace pagedjax {

// A float16's value as float32, exactly (subnormals included): the portable path's reading of a
// block-quantized weight's scales and offsets, which the vector paths widen with F16C.
inline float HalfToFloat(uint16_t half) {
  const uint32_t sign = uint32_t(half & 0x8000) << 16, exp = (half >> 10) & 0x1F;
  const uint32_t mantissa = half & 0x3FF;
  if (exp == 0) {  // zero or subnormal: mantissa * 2^-24
    const float f = float(mantissa) * 0x1p-24f;
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 0x1F ? 0xFFu : exp + (127 - 15)) << 23 | mantissa << 13;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef PAGEDJAX_AVX2
inline __m256 LoadHalf8(const uint16_t* p) {  // 8 float16s as float32, exactly (F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
#ifdef PAGEDJAX_AVX512
inline __m512 LoadHalf16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

}  // namespace pagedjax
