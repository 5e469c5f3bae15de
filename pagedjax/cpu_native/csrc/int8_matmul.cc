// x @ w for block-quantized weights (Q4_0, Q4_1, Q8_0) with each row's activations quantized
// to int8 per 32 inputs, as llama.cpp multiplies them (EngineConfig.int8_activations; see
// matmul.py). Opt-in: the result is not the float32 product, but it is one function of the row
// (batch invariant) and the same bits on every instruction-set level.
//
// Per row and block b of 32 inputs: d = max|x| / 127, q = round(x / d) in [-127, 127] (d = 0:
// q = 0), s = d * sum(q). Per output column c, with w = code * scale + offset:
//   y[c] = sum over blocks, in order, of  fma(offset[b, c], s, fma(isum, d * scale[b, c], y))
// where isum = sum over the block of q * code is exact in int32. AVX-512 VNNI (vpdpbusd) sums
// 64 byte products per instruction, AVX2 32 (vpmaddubsw + vpmaddwd, which cannot saturate
// here: 4-bit codes, and 8-bit ones as |code| times q with code's sign), against 16 float
// FMAs: the integer sums are the same at every level, and so are the float steps after them.
//
// Inputs: x [M, K]; codes [P, K / 32, Q, 24, 4] ("dot panels", matmul.int8_panels): 8-bit,
// Q = 8, byte (b, j, c, i) is column c's int8 code for k = 32 b + 4 j + i; 4-bit, Q = 4, the
// byte holds k = 32 b + 4 j + i in its low nibble and 32 b + 4 (j + 4) + i in its high one;
// scales, offsets [P, K / 32, 24] float16; attrs columns, bits. Output: [M, N].
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "panels.h"
#include "parallel.h"

namespace ffi = xla::ffi;
using pagedjax::kBlock;
using pagedjax::kPanel;

namespace {

// A row's activations, quantized: q [K] int8, and per block d and s (float) and sum(q).
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
};

// Quantizes row x [K] into row `row` of `out` (scalar: the same result at every level, and a
// small part of a call: one pass over M x K floats).
void QuantizeRow(const float* x, int64_t K, Quantized& out, int64_t row) {
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
    int8_t* q = out.q.data() + row * K + b * kBlock;
    int32_t sum = 0;
    for (int64_t k = 0; k < kBlock; ++k) {
      const float v = std::clamp(std::nearbyint(xb[k] * inverse), -127.f, 127.f);
      q[k] = static_cast<int8_t>(v);
      sum += q[k];
    }
    out.d[row * blocks + b] = d;
    out.sum[row * blocks + b] = sum;
    out.s[row * blocks + b] = d * static_cast<float>(sum);
  }
}

// The tile's arithmetic after a block's integer sums: y = fma(offset, s, fma(isum, d * scale,
// y)), per column, for the scalar paths and the vector tails alike.
inline float Fold(float y, int32_t isum, float d, float scale, float offset, float s) {
  return std::fma(offset, s, std::fma(static_cast<float>(isum), d * scale, y));
}

#if defined(PAGEDJAX_AVX512) && defined(__AVX512VNNI__)
// R rows x one panel: columns 0-15 in a 16-lane vector, 16-23 in an 8-lane one, as int32 sums
// per block, then folded into float32 accumulators. At one row a block's quads go to A = 4
// separate sums, added at the end (integers: the same sum), so that vpdpbusd's
// latency is not paid once per quad.
template <int R, int kBits>
void Tile(const Quantized& xq, int64_t row0, int64_t K, const uint8_t* codes,
          const uint16_t* scales, const uint16_t* offsets, float* out, int64_t ldo, int64_t cols) {
  const int64_t blocks = K / kBlock;
  constexpr int kQuads = kBits == 4 ? 4 : 8;  // 4-byte groups of codes per block and column
  constexpr int A = R == 1 ? 4 : 1;
  const __m512i nibble = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(char(0x80));
  __m512 y_lo[R];
  __m256 y_hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) y_lo[r] = _mm512_setzero_ps(), y_hi[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i i_lo[R][A];
    __m256i i_hi[R][A];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int a = 0; a < A; ++a)
        i_lo[r][a] = _mm512_setzero_si512(), i_hi[r][a] = _mm256_setzero_si256();
    const uint8_t* block = codes + b * kQuads * kPanel * 4;
    // Adds quad j's products (k = 32 b + 4 j + i) of unsigned codes to every row's sums.
    const auto add = [&](__m512i lo, __m256i hi, int j) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq.q.data() + (row0 + r) * K + b * kBlock + 4 * j, 4);
        i_lo[r][j % A] = _mm512_dpbusd_epi32(i_lo[r][j % A], lo, _mm512_set1_epi32(four));
        i_hi[r][j % A] = _mm256_dpbusd_epi32(i_hi[r][j % A], hi, _mm256_set1_epi32(four));
      }
    };
#pragma GCC unroll 8
    for (int j = 0; j < kQuads; ++j) {
      const uint8_t* quad = block + j * kPanel * 4;
      const __m512i lo = _mm512_loadu_si512(quad);
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 64));
      if constexpr (kBits == 4) {
        add(_mm512_and_si512(lo, nibble), _mm256_and_si256(hi, _mm512_castsi512_si256(nibble)),
            j);
        add(_mm512_and_si512(_mm512_srli_epi16(lo, 4), nibble),
            _mm256_and_si256(_mm256_srli_epi16(hi, 4), _mm512_castsi512_si256(nibble)), j + 4);
      } else {  // int8 codes + 128 as unsigned bytes; 128 * sum(q) taken off below
        add(_mm512_xor_si512(lo, bias), _mm256_xor_si256(hi, _mm512_castsi512_si256(bias)), j);
      }
    }
    const __m512 s_lo = pagedjax::LoadHalf16(scales + b * kPanel);
    const __m256 s_hi = pagedjax::LoadHalf8(scales + b * kPanel + 16);
    const __m512 o_lo = pagedjax::LoadHalf16(offsets + b * kPanel);
    const __m256 o_hi = pagedjax::LoadHalf8(offsets + b * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * blocks + b;
#pragma GCC unroll 4
      for (int a = 1; a < A; ++a) {
        i_lo[r][0] = _mm512_add_epi32(i_lo[r][0], i_lo[r][a]);
        i_hi[r][0] = _mm256_add_epi32(i_hi[r][0], i_hi[r][a]);
      }
      if constexpr (kBits == 8) {
        const int32_t shift = 128 * xq.sum[at];
        i_lo[r][0] = _mm512_sub_epi32(i_lo[r][0], _mm512_set1_epi32(shift));
        i_hi[r][0] = _mm256_sub_epi32(i_hi[r][0], _mm256_set1_epi32(shift));
      }
      const __m512 d = _mm512_set1_ps(xq.d[at]), s = _mm512_set1_ps(xq.s[at]);
      y_lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_lo[r][0]), _mm512_mul_ps(d, s_lo), y_lo[r]);
      y_hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i_hi[r][0]),
                                _mm256_mul_ps(_mm512_castps512_ps256(d), s_hi), y_hi[r]);
      y_lo[r] = _mm512_fmadd_ps(o_lo, s, y_lo[r]);
      y_hi[r] = _mm256_fmadd_ps(o_hi, _mm512_castps512_ps256(s), y_hi[r]);
    }
  }
  alignas(64) float tile[kPanel];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(tile, y_lo[r]);
    _mm256_store_ps(tile + 16, y_hi[r]);
    std::memcpy(out + r * ldo, tile, cols * sizeof(float));
  }
}
constexpr int kRows = 4;

#elif defined(PAGEDJAX_AVX2)
// The products of 8 columns' 4-byte groups and one row's 4 activations, summed per column:
// 4-bit codes are unsigned; 8-bit ones signed, multiplied as |code| by q with code's sign.
template <int kBits>
inline __m256i Dot4(__m256i code, __m256i four) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kBits == 4) return _mm256_madd_epi16(_mm256_maddubs_epi16(code, four), ones);
  const __m256i magnitude = _mm256_abs_epi8(code), signed_q = _mm256_sign_epi8(four, code);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_q), ones);
}

template <int R, int kBits>
void Tile(const Quantized& xq, int64_t row0, int64_t K, const uint8_t* codes,
          const uint16_t* scales, const uint16_t* offsets, float* out, int64_t ldo, int64_t cols) {
  const int64_t blocks = K / kBlock;
  constexpr int kQuads = kBits == 4 ? 4 : 8;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 y[R][3];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < 3; ++c) y[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i isum[R][3];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
      for (int c = 0; c < 3; ++c) isum[r][c] = _mm256_setzero_si256();
    const uint8_t* block = codes + b * kQuads * kPanel * 4;
    const auto add = [&](const __m256i (&code)[3], int j) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq.q.data() + (row0 + r) * K + b * kBlock + 4 * j, 4);
        const __m256i q = _mm256_set1_epi32(four);
#pragma GCC unroll 3
        for (int c = 0; c < 3; ++c)
          isum[r][c] = _mm256_add_epi32(isum[r][c], Dot4<kBits>(code[c], q));
      }
    };
    for (int j = 0; j < kQuads; ++j) {
      const __m256i* quad = reinterpret_cast<const __m256i*>(block + j * kPanel * 4);
      const __m256i raw[3] = {_mm256_loadu_si256(quad), _mm256_loadu_si256(quad + 1),
                              _mm256_loadu_si256(quad + 2)};
      if constexpr (kBits == 4) {
        add({_mm256_and_si256(raw[0], nibble), _mm256_and_si256(raw[1], nibble),
             _mm256_and_si256(raw[2], nibble)}, j);
        add({_mm256_and_si256(_mm256_srli_epi16(raw[0], 4), nibble),
             _mm256_and_si256(_mm256_srli_epi16(raw[1], 4), nibble),
             _mm256_and_si256(_mm256_srli_epi16(raw[2], 4), nibble)}, j + 4);
      } else {
        add(raw, j);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * blocks + b;
      const __m256 d = _mm256_set1_ps(xq.d[at]), s = _mm256_set1_ps(xq.s[at]);
#pragma GCC unroll 3
      for (int c = 0; c < 3; ++c) {
        const __m256 scale = pagedjax::LoadHalf8(scales + b * kPanel + 8 * c);
        const __m256 offset = pagedjax::LoadHalf8(offsets + b * kPanel + 8 * c);
        y[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][c]), _mm256_mul_ps(d, scale),
                                  y[r][c]);
        y[r][c] = _mm256_fmadd_ps(offset, s, y[r][c]);
      }
    }
  }
  alignas(32) float tile[kPanel];
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 3
    for (int c = 0; c < 3; ++c) _mm256_store_ps(tile + 8 * c, y[r][c]);
    std::memcpy(out + r * ldo, tile, cols * sizeof(float));
  }
}
constexpr int kRows = 2;

#else  // portable loops
template <int R, int kBits>
void Tile(const Quantized& xq, int64_t row0, int64_t K, const uint8_t* codes,
          const uint16_t* scales, const uint16_t* offsets, float* out, int64_t ldo, int64_t cols) {
  const int64_t blocks = K / kBlock;
  constexpr int kQuads = kBits == 4 ? 4 : 8;
  for (int r = 0; r < R; ++r) {
    const int8_t* q = xq.q.data() + (row0 + r) * K;
    float y[kPanel] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t isum[kPanel] = {};
      const uint8_t* block = codes + b * kQuads * kPanel * 4;
      for (int j = 0; j < kQuads; ++j)
        for (int64_t c = 0; c < kPanel; ++c)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = block[(j * kPanel + c) * 4 + i];
            const int64_t k = b * kBlock + 4 * j + i;
            if (kBits == 4) {
              isum[c] += q[k] * (byte & 0x0F) + q[k + 16] * (byte >> 4);
            } else {
              isum[c] += q[k] * static_cast<int8_t>(byte);
            }
          }
      const int64_t at = (row0 + r) * blocks + b;
      for (int64_t c = 0; c < kPanel; ++c)
        y[c] = Fold(y[c], isum[c], xq.d[at], pagedjax::HalfToFloat(scales[b * kPanel + c]),
                    pagedjax::HalfToFloat(offsets[b * kPanel + c]), xq.s[at]);
    }
    std::memcpy(out + r * ldo, y, cols * sizeof(float));
  }
}
constexpr int kRows = 1;
#endif

using TileFn = void (*)(const Quantized&, int64_t, int64_t, const uint8_t*, const uint16_t*,
                        const uint16_t*, float*, int64_t, int64_t);

template <int kBits, int... R>
constexpr auto Tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R) + 1>{nullptr, Tile<R + 1, kBits>...};
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F16> scales,
                          ffi::Buffer<ffi::F16> offsets, int64_t columns, int64_t bits,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), c_dims = codes.dimensions(), s_dims = scales.dimensions();
  if (x_dims.size() != 2 || c_dims.size() != 5 || s_dims.size() != 3)
    return ffi::Error::InvalidArgument("int8_matmul: expected x [M, K], codes [P, K/32, Q, 24, 4]");
  const int64_t M = x_dims[0], K = x_dims[1], N = columns, panels = c_dims[0];
  if ((bits != 4 && bits != 8) || K % kBlock || c_dims[1] != K / kBlock ||
      c_dims[2] != bits || c_dims[3] != kPanel || c_dims[4] != 4 || s_dims[0] != panels ||
      s_dims[1] != K / kBlock || s_dims[2] != kPanel ||
      offsets.element_count() != scales.element_count())
    return ffi::Error::InvalidArgument("int8_matmul: codes/scales/offsets do not match x");
  if (columns <= 0 || columns > panels * kPanel || out->dimensions()[1] != columns)
    return ffi::Error::InvalidArgument("int8_matmul: columns out of the packed range");
  Quantized xq;
  const int64_t blocks = K / kBlock;
  xq.q.resize(M * K);
  xq.d.resize(M * blocks), xq.s.resize(M * blocks), xq.sum.resize(M * blocks);
  pagedjax::ParallelFor(pool, M, [&](int64_t m) { QuantizeRow(x.typed_data() + m * K, K, xq, m); });
  static constexpr auto kTiles4 = Tiles<4>(std::make_integer_sequence<int, kRows>{});
  static constexpr auto kTiles8 = Tiles<8>(std::make_integer_sequence<int, kRows>{});
  const auto& tiles = bits == 4 ? kTiles4 : kTiles8;
  const int64_t code_stride = blocks * bits * kPanel * 4, scale_stride = blocks * kPanel;
  pagedjax::ForEachPanel(pool, N, [&](int64_t p) {
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    for (int64_t m = 0; m < M; m += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, M - m);
      tiles[rows](xq, m, K, codes.typed_data() + p * code_stride,
                  scales.typed_data() + p * scale_stride, offsets.typed_data() + p * scale_stride,
                  out->typed_data() + m * N + p * kPanel, N, cols);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes, dot panels
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales
                                  .Arg<ffi::Buffer<ffi::F16>>()  // offsets
                                  .Attr<int64_t>("columns")
                                  .Attr<int64_t>("bits")
                                  .Ret<ffi::Buffer<ffi::F32>>());
