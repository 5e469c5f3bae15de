// x @ w for XLA:CPU with w packed once at load time, called through the XLA FFI (see
// matmul.py).
//
// XLA:CPU repacks the weight operand of every dot into its GEMM's layout, on every call, which
// at decode's few rows costs as much as the arithmetic. The weights never change, so they are
// packed once, as panels of 24 output columns: packed[p, k, c] = w[k, p * 24 + c], zero past
// N. A 4 x 24 register tile (12 accumulators; three panel loads and four broadcasts per k)
// keeps both FMA pipes busy (benchmarks/README.md compares it with XLA from 1 to 512 rows).
// Threads take ranges of panels, so at one row each streams its own part of the weights.
// Each output is one float32 sum over k in order, with an FMA per term.
//
// Inputs: x [M, K]; packed [P, K, 24]; attr columns = N <= 24 P. Output: [M, N].
// GroupedPackedMatmul: the same tiles over a mixture of experts' rows, each tile of rows
// against its expert's panels (packed [G, P, K, 24]).
//
// QuantizedMatmul takes the same panels held as GGUF-style block codes instead (Q4_0, Q4_1 and
// Q8_0 weights as the file stores them): w[k, c] = code * scale + offset, with one scale and
// offset per 32 k and column. The product is exact (a code of at most 8 bits times a float16
// scale has at most 19 significant bits), so one fused multiply-add rounds the weight exactly
// as the loader's dequantization does, bit for bit. Each panel is widened into a float32
// scratch panel and run through the same tile: the same sums as PackedMatmul on the
// dequantized weights, from 0.5 (4-bit) or 1 byte a weight, plus 8 bytes of scale and offset
// per 32, instead of 4. At decode's 1-3 rows (AVX2) the weights are widened in registers and
// multiplied at once instead (FusedTile), with the same sums bit for bit.
//
// Inputs: x [M, K]; codes [P, K / 2, 24] (4-bit, in GGUF's order: byte 16 b + j holds k = 32 b + j
// in its low nibble and 32 b + j + 16 in its high one) or [P, K, 24] (8-bit, two's complement);
// scales, offsets [P, K / 32, 24] float16 (as the file stores them: batch-1 decode streams the
// weights from memory, and float32 copies made them 0.75 instead of 0.625 bytes a 4-bit
// weight); attrs columns, bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "panels.h"
#include "parallel.h"

namespace ffi = xla::ffi;
using pagedjax::ForEachPanel;
using pagedjax::kBlock;
using pagedjax::kPanel;

namespace {


// out[r][c] = sum over k of x[r][k] * panel[k][c], for R rows and the first `cols` columns.
template <int R>
void Tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
          int64_t cols) {
  alignas(64) float tile[R][kPanel];
#if defined(PAGEDJAX_AVX512)
  // A row's 24 columns are one 16-float and one 8-float vector; 32 registers hold 8 rows.
  __m512 low[R];
  __m256 high[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) low[r] = _mm512_setzero_ps(), high[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* b = panel + k * kPanel;
    __m512 b0 = _mm512_loadu_ps(b);
    __m256 b1 = _mm256_loadu_ps(b + 16);
    __asm__("" : "+v"(b0), "+v"(b1));  // in registers, as in the AVX2 tile below
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
      low[r] = _mm512_fmadd_ps(_mm512_set1_ps(a), b0, low[r]);
      high[r] = _mm256_fmadd_ps(_mm256_set1_ps(a), b1, high[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(tile[r], low[r]);
    _mm256_store_ps(tile[r] + 16, high[r]);
  }
#elif defined(PAGEDJAX_AVX2)
  __m256 acc[R][3];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* b = panel + k * kPanel;
    __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), b2 = _mm256_loadu_ps(b + 16);
    // Pinned in registers: GCC would fold each into its four FMAs as a memory operand, and
    // the 16 loads per k, not the FMAs, would bound the tile.
    __asm__("" : "+x"(b0), "+x"(b1), "+x"(b2));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(a, b2, acc[r][2]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < 3; ++c) _mm256_store_ps(tile[r] + c * 8, acc[r][c]);
#else  // portable loops for compilers without AVX2 and FMA
  for (int r = 0; r < R; ++r) std::fill(tile[r], tile[r] + kPanel, 0.f);
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) tile[r][c] = std::fma(a, panel[k * kPanel + c], tile[r][c]);
    }
#endif
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, tile[r], cols * sizeof(float));
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
#ifdef PAGEDJAX_AVX512
constexpr int kRows = 8;  // rows per register tile
constexpr TileFn kTile[kRows + 1] = {nullptr, Tile<1>, Tile<2>, Tile<3>, Tile<4>,
                                     Tile<5>, Tile<6>, Tile<7>, Tile<8>};
#else
constexpr int kRows = 4;
constexpr TileFn kTile[kRows + 1] = {nullptr, Tile<1>, Tile<2>, Tile<3>, Tile<4>};
#endif

// out [M, N] = x [M, K] @ the panels, where panel(p) gives panel p as float32 [K, 24] (called
// once per panel, on the thread that multiplies it).
template <typename PanelFn>
void MultiplyPanels(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                    float* out, const PanelFn& panel) {
  ForEachPanel(pool, N, [&](int64_t p) {
    const float* weights = panel(p);
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    for (int64_t m = 0; m < M; m += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, M - m);
      kTile[rows](x + m * K, K, weights, K, out + m * N + p * kPanel, N, cols);
    }
  });
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> packed, int64_t columns,
                            ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), p_dims = packed.dimensions();
  if (x_dims.size() != 2 || p_dims.size() != 3 || p_dims[2] != kPanel || p_dims[1] != x_dims[1])
    return ffi::Error::InvalidArgument("packed_matmul: expected x [M, K], packed [P, K, 24]");
  if (columns <= 0 || columns > p_dims[0] * kPanel || out->dimensions()[1] != columns)
    return ffi::Error::InvalidArgument("packed_matmul: columns out of the packed range");
  const float* weights = packed.typed_data();
  const int64_t K = x_dims[1];
  MultiplyPanels(pool, x.typed_data(), x_dims[0], K, columns, out->typed_data(),
                 [&](int64_t p) { return weights + p * K * kPanel; });
  return ffi::Error::Success();
}

// A mixture of experts' rows sorted by expert in tiles (kernels_pallas/grouped_matmul.py):
// out [P, N] = each tile's rows of x [P, K] times its group's panels, packed [G, Pn, K, 24],
// read where they lie. Only a tile's first counts[t] rows hold assignments: the rest, and
// every row of a tile whose count is 0, are zeros, so padding costs no arithmetic. Threads
// take (tile, range of panels) items; each output is PackedMatmul's sum over k in order.
ffi::Error GroupedPackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                   ffi::Buffer<ffi::F32> packed, ffi::Buffer<ffi::S32> groups,
                                   ffi::Buffer<ffi::S32> counts, int64_t columns,
                                   ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), p_dims = packed.dimensions();
  if (x_dims.size() != 2 || p_dims.size() != 4 || p_dims[3] != kPanel || p_dims[2] != x_dims[1])
    return ffi::Error::InvalidArgument(
        "grouped_packed_matmul: expected x [P, K], packed [G, Pn, K, 24]");
  const int64_t tiles = groups.element_count(), P = x_dims[0], K = x_dims[1];
  if (tiles == 0 || P % tiles || counts.element_count() != tiles)
    return ffi::Error::InvalidArgument("grouped_packed_matmul: rows are not whole tiles");
  if (columns <= 0 || columns > p_dims[1] * kPanel || out->dimensions()[1] != columns)
    return ffi::Error::InvalidArgument("grouped_packed_matmul: columns out of the packed range");
  const int64_t tile = P / tiles, N = columns, G = p_dims[0], panels = p_dims[1];
  const int32_t* group_of = groups.typed_data();
  const int32_t* count_of = counts.typed_data();
  float* result = out->typed_data();
  int64_t used = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = std::clamp<int64_t>(count_of[t], 0, tile);
    used += rows > 0;
    std::fill(result + (t * tile + rows) * N, result + (t + 1) * tile * N, 0.f);
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = std::clamp<int64_t>(used * panels / (4 * threads), 1, 32);
  const int64_t chunks = (panels + per_item - 1) / per_item;
  pagedjax::ParallelFor(pool, tiles * chunks, [&](int64_t item) {
    const int64_t t = item / chunks, first = (item % chunks) * per_item;
    const int64_t end = t * tile + std::clamp<int64_t>(count_of[t], 0, tile);
    const int64_t g = std::clamp<int64_t>(group_of[t], 0, G - 1);  // never foreign memory
    for (int64_t p = first; end > t * tile && p < std::min(panels, first + per_item); ++p) {
      const float* weights = packed.typed_data() + (g * panels + p) * K * kPanel;
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      for (int64_t m = t * tile; m < end; m += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, end - m);
        kTile[rows](x.typed_data() + m * K, K, weights, K, result + m * N + p * kPanel, N, cols);
      }
    }
  });
  return ffi::Error::Success();
}

// scratch[k][c] = codes' weight at (k, c) for one panel, in float32.
void WidenPanel(const uint8_t* codes, const uint16_t* scales, const uint16_t* offsets, int64_t K,
                int bits, float* scratch) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint16_t* scale = scales + b * kPanel;
    const uint16_t* offset = offsets + b * kPanel;
    float* out = scratch + b * kBlock * kPanel;
#ifdef PAGEDJAX_AVX2
    const __m256 s[3] = {pagedjax::LoadHalf8(scale), pagedjax::LoadHalf8(scale + 8), pagedjax::LoadHalf8(scale + 16)};
    const __m256 o[3] = {pagedjax::LoadHalf8(offset), pagedjax::LoadHalf8(offset + 8), pagedjax::LoadHalf8(offset + 16)};
    if (bits == 4) {
      const uint8_t* q = codes + b * (kBlock / 2) * kPanel;
      const __m256i low = _mm256_set1_epi32(0x0F);
      float* high_out = out + kBlock / 2 * kPanel;
      for (int64_t j = 0; j < kBlock / 2; ++j, q += kPanel, out += kPanel, high_out += kPanel)
#pragma GCC unroll 3
        for (int c = 0; c < 3; ++c) {
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8 * c)));
          const __m256 low_k = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
          const __m256 high_k = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(low_k, s[c], o[c]));
          _mm256_storeu_ps(high_out + 8 * c, _mm256_fmadd_ps(high_k, s[c], o[c]));
        }
    } else {
      const int8_t* q = reinterpret_cast<const int8_t*>(codes) + b * kBlock * kPanel;
      for (int64_t k = 0; k < kBlock; ++k, q += kPanel, out += kPanel)
#pragma GCC unroll 3
        for (int c = 0; c < 3; ++c) {
          const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8 * c)));
          _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s[c], o[c]));
        }
    }
#else
    for (int64_t k = 0; k < kBlock; ++k)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int code =
            bits == 4 ? (codes[(b * kBlock / 2 + k % 16) * kPanel + c] >> (4 * (k / 16))) & 0x0F
                      : reinterpret_cast<const int8_t*>(codes)[(b * kBlock + k) * kPanel + c];
        // fma: the product is exact, so one rounding, as in the AVX2 path and the loader.
        out[k * kPanel + c] =
            std::fma(static_cast<float>(code), pagedjax::HalfToFloat(scale[c]),
                     pagedjax::HalfToFloat(offset[c]));
      }
#endif
  }
}

#ifdef PAGEDJAX_AVX2
// 8 code bytes, widened to int32 (zero-extended for uint8_t, sign-extended for int8_t).
template <typename Byte>
__m256i Bytes(const uint8_t* q) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return std::is_signed_v<Byte> ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

// Tile<R> over the panel that WidenPanel would write, without writing it: each k's 24 weights
// are widened in registers by the same FMA and used at once. At a few rows the widening is
// done once either way, and the scratch panel's store and reload cost more than the widening
// (benchmarks/README.md). The same sums bit for bit: one accumulator per
// row and column, k in order, an FMA per term, starting from zero. (At one row the three
// accumulators' FMA latency bounds it; two panels at once, for six, spilled the scales and
// offsets: slower on 4-bit codes, 7% faster on 8-bit.)
template <int R, int kBits>
void FusedTile(const float* x, int64_t ldx, const uint8_t* codes, const uint16_t* scales,
               const uint16_t* offsets, int64_t K, float* out, int64_t ldo, int64_t cols) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  __m256 acc[R][3];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < 3; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 s[3], o[3];
#pragma GCC unroll 3
    for (int c = 0; c < 3; ++c) {
      s[c] = pagedjax::LoadHalf8(scales + b * kPanel + 8 * c);
      o[c] = pagedjax::LoadHalf8(offsets + b * kPanel + 8 * c);
    }
    const float* xb = x + b * kBlock;
    // acc[r][c] += x[r][k] * w[k][c], w[k][c] widened from code[c] (int32).
    const auto term = [&](const __m256i (&code)[3], int64_t k) {
      __m256 w[3];
#pragma GCC unroll 3
      for (int c = 0; c < 3; ++c)
        w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code[c]), s[c], o[c]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(xb + r * ldx + k);
#pragma GCC unroll 3
        for (int c = 0; c < 3; ++c) acc[r][c] = _mm256_fmadd_ps(a, w[c], acc[r][c]);
      }
    };
    if constexpr (kBits == 4) {
      // Byte 16 b + j holds k = 32 b + j in its low nibble and 32 b + 16 + j in its high one:
      // the low nibbles first, then the high ones, each byte loaded twice.
      const uint8_t* q = codes + b * (kBlock / 2) * kPanel;
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        const uint8_t* row = q + j * kPanel;
        term({_mm256_and_si256(Bytes<uint8_t>(row), low),
              _mm256_and_si256(Bytes<uint8_t>(row + 8), low),
              _mm256_and_si256(Bytes<uint8_t>(row + 16), low)}, j);
      }
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        const uint8_t* row = q + j * kPanel;
        term({_mm256_srli_epi32(Bytes<uint8_t>(row), 4),
              _mm256_srli_epi32(Bytes<uint8_t>(row + 8), 4),
              _mm256_srli_epi32(Bytes<uint8_t>(row + 16), 4)}, kBlock / 2 + j);
      }
    } else {
      const uint8_t* q = codes + b * kBlock * kPanel;
      for (int64_t k = 0; k < kBlock; ++k) {
        const uint8_t* row = q + k * kPanel;
        term({Bytes<int8_t>(row), Bytes<int8_t>(row + 8), Bytes<int8_t>(row + 16)}, k);
      }
    }
  }
  alignas(32) float tile[R][kPanel];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < 3; ++c) _mm256_store_ps(tile[r] + 8 * c, acc[r][c]);
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, tile[r], cols * sizeof(float));
}

using FusedTileFn = void (*)(const float*, int64_t, const uint8_t*, const uint16_t*,
                             const uint16_t*, int64_t, float*, int64_t, int64_t);
// Up to 3 rows: at 4, the 12 accumulators, 6 scale and offset vectors and the temporaries
// spill out of the 16 vector registers, and the fused tile is no faster than the scratch panel.
constexpr int kFusedRows = 3;
constexpr FusedTileFn kFusedTile[2][kFusedRows + 1] = {
    {nullptr, FusedTile<1, 4>, FusedTile<2, 4>, FusedTile<3, 4>},
    {nullptr, FusedTile<1, 8>, FusedTile<2, 8>, FusedTile<3, 8>}};
#endif

#ifdef PAGEDJAX_AVX512
// A code row's 16 + 8 bytes widened to int32 (zero-extended for uint8_t, sign-extended for
// int8_t).
template <typename Byte>
__m512i Bytes16(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return std::is_signed_v<Byte> ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

// FusedTile for AVX-512 over G neighbouring panels at once (codes, scales and offsets of panel
// p + g at g times their strides): more independent accumulators than one panel's three, which
// at one row is what bounds the AVX2 tile (each accumulator's FMAs wait on the one before), and
// a row's 24 columns in two vectors instead of three. The same sums bit for bit: one
// accumulator per row and column, k in order, an FMA per term. `cols[g]`: panel g's columns.
template <int R, int G, int kBits>
void FusedTile512(const float* x, int64_t ldx, const uint8_t* codes, int64_t code_stride,
                  const uint16_t* scales, const uint16_t* offsets, int64_t scale_stride, int64_t K,
                  float* out, int64_t ldo, const int64_t* cols) {
  const __m512i low_nibble = _mm512_set1_epi32(0x0F);
  const __m256i low_nibble8 = _mm256_set1_epi32(0x0F);
  __m512 lo[R][G];
  __m256 hi[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) lo[r][g] = _mm512_setzero_ps(), hi[r][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m512 s_lo[G], o_lo[G];
    __m256 s_hi[G], o_hi[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const uint16_t* s = scales + g * scale_stride + b * kPanel;
      const uint16_t* o = offsets + g * scale_stride + b * kPanel;
      s_lo[g] = pagedjax::LoadHalf16(s), s_hi[g] = pagedjax::LoadHalf8(s + 16);
      o_lo[g] = pagedjax::LoadHalf16(o), o_hi[g] = pagedjax::LoadHalf8(o + 16);
    }
    const float* xb = x + b * kBlock;
    // Every row's accumulators += x[r][k] * w[k][.], panel g's weights widened from its codes.
    const auto term = [&](const __m512i (&code_lo)[G], const __m256i (&code_hi)[G], int64_t k) {
      __m512 w_lo[G];
      __m256 w_hi[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        w_lo[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code_lo[g]), s_lo[g], o_lo[g]);
        w_hi[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code_hi[g]), s_hi[g], o_hi[g]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(xb[r * ldx + k]);
        const __m256 a8 = _mm512_castps512_ps256(a);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          lo[r][g] = _mm512_fmadd_ps(a, w_lo[g], lo[r][g]);
          hi[r][g] = _mm256_fmadd_ps(a8, w_hi[g], hi[r][g]);
        }
      }
    };
    if constexpr (kBits == 4) {
      // As FusedTile: the low nibbles (k = j) first, then the high ones (k = 16 + j).
      const uint8_t* q = codes + b * (kBlock / 2) * kPanel;
      for (int half = 0; half < 2; ++half)
        for (int64_t j = 0; j < kBlock / 2; ++j) {
          __m512i code_lo[G];
          __m256i code_hi[G];
#pragma GCC unroll 4
          for (int g = 0; g < G; ++g) {
            const uint8_t* row = q + g * code_stride + j * kPanel;
            const __m512i a = Bytes16<uint8_t>(row);
            const __m256i c = Bytes<uint8_t>(row + 16);
            code_lo[g] = half ? _mm512_srli_epi32(a, 4) : _mm512_and_si512(a, low_nibble);
            code_hi[g] = half ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, low_nibble8);
          }
          term(code_lo, code_hi, half * (kBlock / 2) + j);
        }
    } else {
      const uint8_t* q = codes + b * kBlock * kPanel;
      for (int64_t k = 0; k < kBlock; ++k) {
        __m512i code_lo[G];
        __m256i code_hi[G];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const uint8_t* row = q + g * code_stride + k * kPanel;
          code_lo[g] = Bytes16<int8_t>(row);
          code_hi[g] = Bytes<int8_t>(row + 16);
        }
        term(code_lo, code_hi, k);
      }
    }
  }
  alignas(64) float tile[R][kPanel];
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(tile[r], lo[r][g]);
      _mm256_store_ps(tile[r] + 16, hi[r][g]);
    }
    for (int r = 0; r < R; ++r)
      std::memcpy(out + r * ldo + g * kPanel, tile[r], cols[g] * sizeof(float));
  }
}

using FusedTile512Fn = void (*)(const float*, int64_t, const uint8_t*, int64_t,
                                const uint16_t*, const uint16_t*, int64_t, int64_t, float*,
                                int64_t, const int64_t*);
// 4 to 8 rows (fewer take the AVX2 FusedTile, which is as fast there): at 4 rows 2 panels,
// then 1 panel up to 8 rows.
constexpr int kFused512Rows = 8;
template <int kBits>
constexpr FusedTile512Fn kFused512[kFused512Rows + 1] = {
    nullptr, nullptr, nullptr, nullptr,
    FusedTile512<4, 2, kBits>, FusedTile512<5, 1, kBits>, FusedTile512<6, 1, kBits>,
    FusedTile512<7, 1, kBits>, FusedTile512<8, 1, kBits>};
constexpr int kFused512Panels[kFused512Rows + 1] = {0, 0, 0, 0, 2, 1, 1, 1, 1};

// The fused tiles over all of x's kFusedRows < M <= kFused512Rows rows: threads take ranges
// of panel groups.
void FusedMatmul512(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N,
                    const uint8_t* codes, int64_t code_stride, const uint16_t* scales,
                    const uint16_t* offsets, int64_t scale_stride, int bits, float* out) {
  const int G = kFused512Panels[M];
  const FusedTile512Fn tile = bits == 4 ? kFused512<4>[M] : kFused512<8>[M];
  const FusedTile512Fn single = bits == 4 ? FusedTile512<1, 1, 4> : FusedTile512<1, 1, 8>;
  const int64_t panels = (N + kPanel - 1) / kPanel, groups = (panels + G - 1) / G;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = std::clamp<int64_t>(groups / (4 * threads), 1, 32 / G);
  pagedjax::ParallelFor(pool, (groups + per_item - 1) / per_item, [&](int64_t item) {
    for (int64_t group = item * per_item; group < std::min(groups, (item + 1) * per_item);
         ++group) {
      const int64_t first = group * G, count = std::min<int64_t>(G, panels - first);
      int64_t cols[4];
      for (int g = 0; g < count; ++g) cols[g] = std::min(kPanel, N - (first + g) * kPanel);
      if (count == G) {
        tile(x, K, codes + first * code_stride, code_stride, scales + first * scale_stride,
             offsets + first * scale_stride, scale_stride, K, out + first * kPanel, N, cols);
        continue;
      }
      // The last, partial group: each remaining panel alone, row by row.
      for (int g = 0; g < count; ++g)
        for (int64_t m = 0; m < M; ++m) {
          const int64_t p = first + g;
          single(x + m * K, K, codes + p * code_stride, code_stride, scales + p * scale_stride,
                 offsets + p * scale_stride, scale_stride, K, out + m * N + p * kPanel, N,
                 &cols[g]);
        }
    }
  });
}
#endif

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F16> scales,
                               ffi::Buffer<ffi::F16> offsets, int64_t columns, int64_t bits,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), c_dims = codes.dimensions(), s_dims = scales.dimensions();
  if (x_dims.size() != 2 || c_dims.size() != 3 || s_dims.size() != 3)
    return ffi::Error::InvalidArgument("quantized_matmul: expected x [M, K], 3-d codes/scales");
  const int64_t M = x_dims[0], K = x_dims[1], N = columns, panels = c_dims[0];
  if ((bits != 4 && bits != 8) || K % kBlock || c_dims[1] != K * bits / 8 ||
      c_dims[2] != kPanel || s_dims[0] != panels || s_dims[1] != K / kBlock ||
      s_dims[2] != kPanel || offsets.element_count() != scales.element_count())
    return ffi::Error::InvalidArgument("quantized_matmul: codes/scales/offsets do not match x");
  if (columns <= 0 || columns > panels * kPanel || out->dimensions()[1] != columns)
    return ffi::Error::InvalidArgument("quantized_matmul: columns out of the packed range");
  const int64_t code_stride = c_dims[1] * kPanel, scale_stride = s_dims[1] * kPanel;
#if defined(PAGEDJAX_AVX512)
  if (M > kFusedRows && M <= kFused512Rows) {  // decode's few rows: widened in registers
    FusedMatmul512(pool, x.typed_data(), M, K, N, codes.typed_data(), code_stride,
                   scales.typed_data(), offsets.typed_data(), scale_stride,
                   static_cast<int>(bits), out->typed_data());
    return ffi::Error::Success();
  }
#endif
#if defined(PAGEDJAX_AVX2)
  if (M > 0 && M <= kFusedRows) {  // decode's few rows: widened in registers
    const FusedTileFn tile = kFusedTile[bits == 8][M];
    ForEachPanel(pool, N, [&](int64_t p) {
      tile(x.typed_data(), K, codes.typed_data() + p * code_stride,
           scales.typed_data() + p * scale_stride, offsets.typed_data() + p * scale_stride, K,
           out->typed_data() + p * kPanel, N, std::min(kPanel, N - p * kPanel));
    });
    return ffi::Error::Success();
  }
#endif
  MultiplyPanels(pool, x.typed_data(), M, K, N, out->typed_data(), [&](int64_t p) {
    // Per thread, reused across calls: a [K, 24] panel (55 KB at K = 576) stays in L2.
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < K * kPanel) scratch.resize(K * kPanel);
    WidenPanel(codes.typed_data() + p * code_stride, scales.typed_data() + p * scale_stride,
               offsets.typed_data() + p * scale_stride, K, static_cast<int>(bits),
               scratch.data());
    return static_cast<const float*>(scratch.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales
                                  .Arg<ffi::Buffer<ffi::F16>>()  // offsets
                                  .Attr<int64_t>("columns")
                                  .Attr<int64_t>("bits")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // packed weight
                                  .Attr<int64_t>("columns")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedPackedMatmul, GroupedPackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // packed groups
                                  .Arg<ffi::Buffer<ffi::S32>>()  // each tile's group
                                  .Arg<ffi::Buffer<ffi::S32>>()  // each tile's rows in use
                                  .Attr<int64_t>("columns")
                                  .Ret<ffi::Buffer<ffi::F32>>());
