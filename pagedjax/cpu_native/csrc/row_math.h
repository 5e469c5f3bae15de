// Row math shared by the C++ CPU kernels that work on whole vocabulary or score rows, which
// XLA:CPU runs as scalar loops: an 8-wide exp, a row's argmax, and a thresholded exp-sum.
#pragma once

#include <cmath>
#include <cstdint>

#include "parallel.h"

namespace pagedjax {

#ifdef PAGEDJAX_AVX2
// exp(x) as 2^n * exp(r) with n = round(x / ln 2) and a degree-7 polynomial for |r| <= ln2 / 2
// (within 2 ulp of expf); exp(x) for x < -87 (below float's normal range) is 0.
inline __m256 Exp(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

struct Best {
  float value;
  int64_t index;
};

// The first index of the row's largest value (NaNs never win); *finite: no NaN or inf.
inline Best ArgMax(const float* x, int64_t n, bool* finite) {
  Best best{-INFINITY, 0};
  int64_t i = 0;
#ifdef PAGEDJAX_AVX2
  if (n >= 8) {
    // Per lane: the largest value and the first index holding it, from -inf (a lane started
    // at a NaN would keep it); x * 0 sums to NaN if any x is NaN or inf.
    __m256 max = _mm256_set1_ps(-INFINITY), nan_if_not_finite = _mm256_setzero_ps();
    __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i eight = _mm256_set1_epi32(8);
    __m256i at = _mm256_sub_epi32(index, eight);
    for (i = 0; i + 8 <= n; i += 8) {
      at = _mm256_add_epi32(at, eight);
      const __m256 v = _mm256_loadu_ps(x + i);
      nan_if_not_finite = _mm256_fmadd_ps(v, _mm256_setzero_ps(), nan_if_not_finite);
      const __m256 greater = _mm256_cmp_ps(v, max, _CMP_GT_OQ);
      max = _mm256_blendv_ps(max, v, greater);
      index = _mm256_castps_si256(_mm256_blendv_ps(
          _mm256_castsi256_ps(index), _mm256_castsi256_ps(at), greater));
    }
    alignas(32) float values[8], checks[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, max);
    _mm256_store_ps(checks, nan_if_not_finite);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), index);
    best = {values[0], indices[0]};
    for (int lane = 0; lane < 8; ++lane) {
      *finite = *finite && checks[lane] == 0.f;
      if (values[lane] > best.value || (values[lane] == best.value && indices[lane] < best.index))
        best = {values[lane], indices[lane]};
    }
  }
#endif
  for (; i < n; ++i) {
    *finite = *finite && std::isfinite(x[i]);
    if (x[i] > best.value) best = {x[i], i};
  }
  return best;
}

// sum of e^(x - max) over x >= threshold (0 at -inf: banned tokens), summed in double (49k
// float32 terms in 8 lanes would lose about 1e-5 of it); each term into weight[i] (0 for
// the others) unless weight is null. With max the row's largest x, the top token weighs 1.
inline double ExpSum(const float* x, int64_t n, float max, float threshold, float* weight) {
  double total = 0;
  int64_t i = 0;
#ifdef PAGEDJAX_AVX2
  const __m256 shift = _mm256_set1_ps(max), lowest = _mm256_set1_ps(threshold);
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, lowest, _CMP_GE_OQ),
                                      _mm256_cmp_ps(v, minus_inf, _CMP_NEQ_OQ));
    const __m256 w = _mm256_and_ps(Exp(_mm256_sub_ps(v, shift)), keep);
    if (weight) _mm256_storeu_ps(weight + i, w);
    low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(w)));
    high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(low, high));
  total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
  for (; i < n; ++i) {
    const float w = x[i] >= threshold && x[i] > -INFINITY ? std::exp(x[i] - max) : 0.f;
    if (weight) weight[i] = w;
    total += w;
  }
  return total;
}

}  // namespace pagedjax
