// Ragged paged attention for XLA:CPU, called through the XLA FFI (see attention.py): every
// row of a step, decode rows and prefill chunks, read from the paged pool in place.
//
// XLA:CPU cannot fuse a page gather into a dot: the XLA loops copy every page of a tile, then
// run small batched matmuls over the copy. Here work items are shared among XLA's intra-op
// threads, prefill tiles first (benchmarks/README.md has the numbers):
//
// - A decode row (q_len 1), per KV head, takes two passes over its pages, both bound by memory
//   bandwidth. The next page is prefetched into L2 a slice at a time, interleaved with the
//   arithmetic on this one (whole pages prefetched two ahead did not overlap reads with
//   arithmetic):
//   1. scores of every key for the group's query heads, 8 keys per dot (one reduction for 8);
//   2. after an exact max and a vectorized exp, probabilities times V, with the group's
//      accumulators held in registers while a V row is read once for all of them.
//   Softmax runs in float32 and needs no rescaling, since pass 1 saw every score.
// - A prefill tile (up to kQueryTile queries of one sequence, per KV head: the group's heads
//   x the tile's queries as rows) runs flash attention page by page: scores as a matmul
//   against the page transposed, an online softmax in float32 (running max and sum, the
//   accumulators rescaled when the max grows), probabilities times V as a second matmul;
//   both matmuls in register blocks of kTileRows rows x 16 columns.
//
// Pools of float32, bfloat16, float16 or float8_e4m3fn: a float32 pool is read in place; the
// others are widened to float32 a slice of rows at a time (8 keys for a decode row, a page for
// a prefill tile) into a per-thread buffer, and the loops above run on that. Widening is exact
// (bf16 is float32's high half; fp16 and e4m3fn decode exactly, fp8 then times its layer and
// head's scale as the XLA path dequantizes), so the result is that of a float32 pool holding
// the same values. The narrower pools read fewer bytes, which is what a long decode row waits
// on.
//
// Batch invariant (attr invariant = 1): every query of a prefill chunk runs the decode path
// over the keys up to its position, so its result is one function of its query, keys and
// values, whether it came in a decode step, a prefill chunk of any length, or a verify row
// beside others. The dense forward for training (`pagedjax/cpu_native/dense.py`) runs the
// same rows, so its logprobs are the engine's bit for bit. Prefill pays: its queries no
// longer share a tile's reads of each page.
//
// Inputs:
//   q [T, Hq, D]; k, v [L, Hkv, NB, bs, D]; k_scale, v_scale [L, Hkv] (read for fp8 only);
//   layer [1]; window [1] (<= 0: none); block_tables [S, W]; seq_lens [S]; query_start_loc [S + 1]
//   attrs: scale, soft_cap, invariant (0 or 1)
// Output: [T, Hq, D]; rows of padding tokens are zero.
// D must be a multiple of 8 and Hq / Hkv at most 8 (attention.supports checks both).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "float16.h"
#include "parallel.h"
#include "row_math.h"

#if defined(__F16C__) && !defined(PAGEDJAX_AVX2)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 8;
constexpr int64_t kSliceKeys = 8;  // keys per slice of a decode row's pages: one Dot8
// Query tokens of one prefill work item: a tile shares each page's transpose and reads among
// its rows, and a chunk of a few hundred tokens still makes several items per KV head.
constexpr int64_t kQueryTile = 64;
constexpr int kTileRows = 6;  // rows of the prefill matmuls' register blocks

// The step's arrays; k and v point at the pool's storage type (AttendOne<T> and AttendTile<T>).
struct Step {
  const float* q;
  const void* k;
  const void* v;
  const float* k_scale;  // [L, Hkv]: an fp8 pool's value = stored * scale
  const float* v_scale;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  float* out;
  int64_t num_tokens, num_seqs, width, num_kv_heads, num_blocks, block_size, head_dim, group, layer;
  int32_t window;
  float scale, soft_cap;
};

// Asks for every cache line of `bytes` from `p` so that they arrive while this page is used:
// into L2 (prefetcht1), not L1. A float32 page ahead is half of L1, so lines prefetched there
// evict the slices in use or are evicted before they are read; from L2 the core's own
// prefetcher brings them on.
inline void Prefetch(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64)
    __builtin_prefetch(static_cast<const char*>(p) + i, /*rw=*/0, /*locality=*/2);
}

// The pool's storage types besides float32: one struct each, so that overloads tell bf16 and
// fp16 apart (both are 16-bit words).
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};
struct Float8E4M3FN {
  uint8_t bits;
};

inline float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Exact scalar conversions: the portable path, and the tails of the vector ones.
inline float ToFloat(BFloat16 x) { return FromBits(uint32_t(x.bits) << 16); }

inline float ToFloat(Float16 x) { return pagedjax::HalfToFloat(x.bits); }

// e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no inf; S.1111.111 is NaN.
inline float ToFloat(Float8E4M3FN x) {
  const uint32_t magnitude = x.bits & 0x7F;
  float f;
  if (magnitude == 0x7F) f = NAN;
  else if (magnitude < 8) f = float(magnitude) * 0x1p-9f;  // subnormal: mantissa * 2^-9
  else f = FromBits((magnitude << 20) + ((127 - 7) << 23));  // rebias the exponent 7 -> 127
  return x.bits & 0x80 ? -f : f;
}

// out[i] = x[i] as float32 for i < n, exactly; an fp8 value times `scale` (other types ignore
// it), one float32 rounding as the XLA path's dequantization.
inline void Widen(const BFloat16* x, int64_t n, float, float* out) {
  int64_t i = 0;
#ifdef PAGEDJAX_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
  }
#endif
  for (; i < n; ++i) out[i] = ToFloat(x[i]);
}

inline void Widen(const Float16* x, int64_t n, float, float* out) {
  int64_t i = 0;
#ifdef __F16C__  // exact, subnormals included
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + i))));
#endif
  for (; i < n; ++i) out[i] = ToFloat(x[i]);
}

inline void Widen(const Float8E4M3FN* x, int64_t n, float scale, float* out) {
  int64_t i = 0;
#ifdef __F16C__
  // An e4m3fn byte's bits moved into an fp16's (the sign on top, exponent and mantissa just
  // under fp16's top exponent bit) are its value times 2^-8, subnormals included, which F16C
  // widens exactly; times 256 * scale then rounds as value * scale does (times a power of two
  // is exact). Faster than ToFloat's cases as compares and blends, or a table gather.
  const __m256 scales = _mm256_set1_ps(scale * 256.f);
  for (; i + 8 <= n; i += 8) {
    const __m128i bytes = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(x + i)));
    // Sign-extended and shifted left 7, the sign fills bits 15 and 14: bit 14 is cleared.
    __m128i half = _mm_and_si128(_mm_slli_epi16(bytes, 7), _mm_set1_epi16(int16_t(0xBF80)));
    // S.1111.111 (NaN) would read as 1.875 * 2^-8: made all ones, an fp16 NaN.
    const __m128i is_nan =
        _mm_cmpeq_epi16(_mm_and_si128(half, _mm_set1_epi16(0x7FFF)), _mm_set1_epi16(0x3F80));
    half = _mm_or_si128(half, is_nan);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(half), scales));
  }
#endif
  for (; i < n; ++i) out[i] = ToFloat(x[i]) * scale;
}

// n values from x as float32: x itself for a float32 pool, else x widened into `buffer`.
template <typename T>
inline const float* AsFloat(const T* x, int64_t n, float scale, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    Widen(x, n, scale, buffer);
    return buffer;
  }
}

#ifdef PAGEDJAX_AVX2

inline float HorizontalSum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[i] = q . k[i * D ...] for the 8 rows of k.
inline void Dot8(const float* q, const float* k, int64_t D, float* out) {
  __m256 a[8];
  #pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    #pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i * D + d), a[i]);
  }
  // Lane i of the result is the sum of a[i]: three rounds of pairwise adds.
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                      _mm256_permute2f128_ps(s0123, s4567, 0x31)));
}

inline float Dot(const float* a, const float* b, int64_t D) {
  __m256 s = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8)
    s = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s);
  return HorizontalSum(s);
}

using pagedjax::Exp;

// x[i] = exp(x[i] - m) for i < n; returns their sum.
inline float ExpShiftedSum(float* x, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = HorizontalSum(sum);
  if (i < n) {  // the tail, through the same Exp
    alignas(32) float tail[8];
    std::fill(tail, tail + 8, -INFINITY);
    std::copy(x + i, x + n, tail);
    const __m256 e = Exp(_mm256_sub_ps(_mm256_load_ps(tail), mv));
    _mm256_store_ps(tail, e);
    std::copy(tail, tail + (n - i), x + i);
    total += HorizontalSum(e);
  }
  return total;
}

// The fixed-count loops below carry `#pragma GCC unroll`: unrolled early, the __m256 arrays
// live in registers; otherwise GCC stores them to the stack every row.

// x[i] *= scale for i < n; returns their max (-inf for n = 0).
inline float ScaleMax(float* x, int64_t n, float scale) {
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + i), sv);
    _mm256_storeu_ps(x + i, y);
    mv = _mm256_max_ps(mv, y);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (; i < n; ++i) m = std::max(m, x[i] *= scale);
  return m;
}

// out[r][c] (+)= sum over k < K of a[r * lda + k] * b[k * ldb + c], for R rows and NV * 8
// columns, with the R x NV accumulators in registers: decode's probabilities x V (R = the
// group) and the prefill tiles' scores and probabilities x V (R = kTileRows).
template <int R, int NV>
inline void MatmulBlock(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K,
                        float* out, int64_t ldo, bool accumulate) {
  __m256 acc[R][NV];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int c = 0; c < NV; ++c)
      acc[r][c] = accumulate ? _mm256_loadu_ps(out + r * ldo + c * 8) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 row[NV];
    #pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) row[c] = _mm256_loadu_ps(b + k * ldb + c * 8);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * lda + k);
      #pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_fmadd_ps(ar, row[c], acc[r][c]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(out + r * ldo + c * 8, acc[r][c]);
}

#else  // portable loops for compilers without AVX2 and FMA

inline float Dot(const float* a, const float* b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

inline void Dot8(const float* q, const float* k, int64_t D, float* out) {
  #pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) out[i] = Dot(q, k + i * D, D);
}

inline float ExpShiftedSum(float* x, int64_t n, float m) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += (x[i] = std::exp(x[i] - m));
  return total;
}

inline float ScaleMax(float* x, int64_t n, float scale) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i] *= scale);
  return m;
}

template <int R, int NV>
inline void MatmulBlock(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K,
                        float* out, int64_t ldo, bool accumulate) {
  for (int r = 0; r < R; ++r) {
    float* o = out + r * ldo;
    if (!accumulate) std::fill(o, o + NV * 8, 0.f);
    for (int64_t k = 0; k < K; ++k)
#pragma omp simd
      for (int c = 0; c < NV * 8; ++c) o[c] += a[r * lda + k] * b[k * ldb + c];
  }
}

#endif

// x[i] = the score of dot product x[i]: times scale, then soft-capped when soft_cap > 0;
// returns their max (-inf for n = 0). Without a cap, vectorized: as a scalar loop it was a
// fifth of a decode row's arithmetic.
inline float ScoresMax(float* x, int64_t n, float scale, float soft_cap) {
  if (soft_cap <= 0.f) return ScaleMax(x, n, scale);
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i)
    m = std::max(m, x[i] = soft_cap * std::tanh(x[i] * scale / soft_cap));
  return m;
}

// MatmulBlock over `cols` columns (a multiple of 8): blocks of NV vectors, then single ones.
template <int R, int NV>
void Matmul(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float* out,
            int64_t ldo, int64_t cols, bool accumulate) {
  int64_t c = 0;
  for (; c + NV * 8 <= cols; c += NV * 8)
    MatmulBlock<R, NV>(a, lda, b + c, ldb, K, out + c, ldo, accumulate);
  for (; c < cols; c += 8) MatmulBlock<R, 1>(a, lda, b + c, ldb, K, out + c, ldo, accumulate);
}

// acc[j][d] += sum over the n keys t of p[j * stride + t] * v[t][d], for the G heads of a
// decode row, in column blocks of C vectors: the widest whose G x C accumulators, a V row
// chunk and a broadcast fit in 16 ymm registers.
template <int G>
void Accumulate(const float* p, int64_t stride, const float* v, int64_t n, int64_t D,
                float* acc) {
  constexpr int C = G == 1 ? 8 : G <= 3 ? 4 : G <= 6 ? 2 : 1;
  Matmul<G, C>(p, stride, v, D, n, acc, D, D, true);
}

using AccumulateFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*);
constexpr AccumulateFn kAccumulate[kMaxGroup + 1] = {
    nullptr,        Accumulate<1>, Accumulate<2>, Accumulate<3>, Accumulate<4>,
    Accumulate<5>, Accumulate<6>, Accumulate<7>, Accumulate<8>};

// Per-thread buffers, at least as large as a call needs. Decode: scores (then probabilities)
// of the group's heads, and accumulators. Prefill: also the tile's queries, a K page
// transposed, and the running max and sum of each query row. Both: K or V rows widened to
// float32 (pools of other dtypes).
struct Scratch {
  std::vector<float> scores, acc, queries, keys_t, max, sum, widened;
};

// One query row by the decode path: query `index` of sequence s's q_len (a decode row: the
// only one), KV head h, on a pool of T; it sees the keys up to its own position.
template <typename T>
void AttendOne(const Step& st, int64_t s, int64_t h, int64_t index, Scratch& scratch) {
  const int64_t D = st.head_dim, g = st.group, bs = st.block_size;
  const int64_t begin = st.query_start_loc[s], q_len = st.query_start_loc[s + 1] - begin;
  const int64_t row = begin + index, num_q_heads = st.num_kv_heads * g;
  if (row < 0 || row >= st.num_tokens || index >= q_len) return;
  // Clipped into the block table and the pool, as the XLA path clips its gathers: tables are
  // checked where they are built, and a bad one must not read outside the pool.
  const int64_t len = std::min<int64_t>(st.seq_lens[s] - q_len + index + 1, st.width * bs);
  const int64_t start = st.window > 0 ? std::max<int64_t>(0, len - st.window) : 0;
  const int64_t span = len - start;  // keys seen, and the stride of a head's scores
  float* o = st.out + (row * num_q_heads + h * g) * D;
  if (span <= 0) return;
  const float* q = st.q + (row * num_q_heads + h * g) * D;
  const int64_t head_pages = (st.layer * st.num_kv_heads + h) * st.num_blocks;
  const int32_t* table = st.tables + s * st.width;
  float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
  float* widened = scratch.widened.data();
  const float k_scale = st.k_scale[st.layer * st.num_kv_heads + h];
  const float v_scale = st.v_scale[st.layer * st.num_kv_heads + h];
  const T* k_pool = static_cast<const T*>(st.k);
  const T* v_pool = static_cast<const T*>(st.v);
  // Blocks first_block..last_block hold keys start..len-1; a block's page in a pool.
  const int64_t first_block = start / bs, last_block = (len - 1) / bs, page_size = bs * D;
  auto page = [&](const T* pool, int64_t block) {
    return pool + (head_pages + std::clamp<int64_t>(table[block], 0, st.num_blocks - 1)) *
                      page_size;
  };
  // Before slice t (of `count` keys) of a page: the same slice of the next page, or all that
  // is left of it before the last slice.
  auto next_page = [&](const T* pool, int64_t block) {
    return block < last_block ? page(pool, block + 1) : nullptr;
  };
  auto prefetch_slice = [&](const T* next, int64_t t, int64_t count) {
    if (next)
      Prefetch(next + t * D, (t + kSliceKeys >= count ? bs - t : kSliceKeys) * D * sizeof(T));
  };

  // Pass 1: scores[j * span + key - start].
  Prefetch(page(k_pool, first_block), page_size * sizeof(T));
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t lo = std::max(start, b * bs), count = std::min(len, b * bs + bs) - lo;
    const T* k = page(k_pool, b) + (lo - b * bs) * D;
    const T* next = next_page(k_pool, b);
    float* sb = scores + (lo - start);
    int64_t t = 0;
    for (; t + kSliceKeys <= count; t += kSliceKeys) {
      prefetch_slice(next, t, count);
      const float* keys = AsFloat(k + t * D, kSliceKeys * D, k_scale, widened);
      for (int64_t j = 0; j < g; ++j) Dot8(q + j * D, keys, D, sb + j * span + t);
    }
    if (t < count) {
      prefetch_slice(next, t, count);
      const float* keys = AsFloat(k + t * D, (count - t) * D, k_scale, widened);
      for (int64_t u = 0; t + u < count; ++u)
        for (int64_t j = 0; j < g; ++j) sb[j * span + t + u] = Dot(q + j * D, keys + u * D, D);
    }
  }
  Prefetch(page(v_pool, first_block), page_size * sizeof(T));

  // Softmax per head, exact: pass 1 saw every score.
  float total[kMaxGroup];
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * span;
    total[j] = ExpShiftedSum(sj, span, ScoresMax(sj, span, st.scale, st.soft_cap));
  }

  // Pass 2: acc[j] = sum over keys of p[j][key] * v[key].
  std::fill(acc, acc + g * D, 0.f);
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t lo = std::max(start, b * bs), count = std::min(len, b * bs + bs) - lo;
    const T* v = page(v_pool, b) + (lo - b * bs) * D;
    const T* next = next_page(v_pool, b);
    for (int64_t t = 0; t < count; t += kSliceKeys) {
      prefetch_slice(next, t, count);
      const int64_t n = std::min(kSliceKeys, count - t);
      kAccumulate[g](scores + (lo - start) + t, span, AsFloat(v + t * D, n * D, v_scale, widened),
                     n, D, acc);
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    const float inv = total[j] > 0.f ? 1.f / total[j] : 0.f;
    for (int64_t d = 0; d < D; ++d) o[j * D + d] = acc[j * D + d] * inv;
  }
}

// Rounds n up to a multiple of m.
inline int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// out[d][t] = k[t][d] for t < count, d < D (a multiple of 8), zero for count <= t < the next
// multiple of 8; out's rows are ldo apart. Whole 8 x 8 blocks by register shuffles, since a
// tile transposes every page it reads and scalar copies cost as much as a share of its matmul.
inline void Transpose(const float* k, int64_t count, int64_t D, float* out, int64_t ldo) {
  int64_t t = 0;
#ifdef PAGEDJAX_AVX2
  for (; t + 8 <= count; t += 8)
    for (int64_t d = 0; d < D; d += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(k + (t + i) * D + d);
      // Pairs, then quads within each 128-bit lane, then the lanes: row i of the result is
      // column d + i of the 8 keys.
      __m256 a[8], b[8];
#pragma GCC unroll 4
      for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        a[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
#pragma GCC unroll 2
      for (int i = 0; i < 8; i += 4) {
        b[i] = _mm256_shuffle_ps(a[i], a[i + 2], 0x44);
        b[i + 1] = _mm256_shuffle_ps(a[i], a[i + 2], 0xEE);
        b[i + 2] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0x44);
        b[i + 3] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(out + (d + i) * ldo + t, _mm256_permute2f128_ps(b[i], b[i + 4], 0x20));
        _mm256_storeu_ps(out + (d + i + 4) * ldo + t,
                         _mm256_permute2f128_ps(b[i], b[i + 4], 0x31));
      }
    }
#endif
  for (int64_t d = 0; d < D; ++d) {
    float* column = out + d * ldo;
    for (int64_t u = t; u < count; ++u) column[u] = k[u * D + d];
    std::fill(column + count, column + RoundUp(count, 8), 0.f);
  }
}

// One prefill tile: query tokens first .. first + kQueryTile - 1 of sequence s (q_len > 1),
// for the g query heads of KV head h, as flash attention: per page of keys, scores of all the
// tile's rows (a matmul against the page transposed), an online softmax in float32 (running
// max and sum, accumulators rescaled when the max grows), then probabilities times V.
// The g x n query rows are ordered head-major (row j * n + r) and padded to kTileRows.
template <typename T>
void AttendTile(const Step& st, int64_t s, int64_t h, int64_t first, Scratch& scratch) {
  const int64_t D = st.head_dim, g = st.group, bs = st.block_size;
  const int64_t num_q_heads = st.num_kv_heads * g;
  const int64_t begin = std::clamp<int64_t>(st.query_start_loc[s], 0, st.num_tokens);
  const int64_t end = std::clamp<int64_t>(st.query_start_loc[s + 1], begin, st.num_tokens);
  const int64_t q_len = end - begin, n = std::min(kQueryTile, q_len - first);
  if (n <= 0) return;
  const int64_t len = std::min<int64_t>(st.seq_lens[s], st.width * bs);
  const int64_t pos0 = len - q_len + first;  // position of the tile's first query
  const int64_t last_key = std::min(len - 1, pos0 + n - 1);  // inclusive
  const int64_t first_key = st.window > 0 ? std::max<int64_t>(0, pos0 - st.window + 1) : 0;
  if (last_key < first_key || last_key < 0) return;  // nothing visible: the rows stay zero
  const int64_t rows = g * n, padded_rows = RoundUp(rows, kTileRows);
  const int64_t cols = RoundUp(bs, 8);  // a page's keys, as whole vectors
  float* queries = scratch.queries.data();
  float* keys_t = scratch.keys_t.data();
  float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
  float* max = scratch.max.data();
  float* sum = scratch.sum.data();
  float* widened = scratch.widened.data();
  for (int64_t j = 0; j < g; ++j)
    for (int64_t r = 0; r < n; ++r) {
      const float* q = st.q + ((begin + first + r) * num_q_heads + h * g + j) * D;
      std::copy(q, q + D, queries + (j * n + r) * D);
    }
  std::fill(queries + rows * D, queries + padded_rows * D, 0.f);
  std::fill(acc, acc + padded_rows * D, 0.f);
  std::fill(max, max + padded_rows, -INFINITY);
  std::fill(sum, sum + padded_rows, 0.f);
  const int64_t head_pages = (st.layer * st.num_kv_heads + h) * st.num_blocks;
  const int32_t* table = st.tables + s * st.width;
  const float k_scale = st.k_scale[st.layer * st.num_kv_heads + h];
  const float v_scale = st.v_scale[st.layer * st.num_kv_heads + h];
  const T* k_pool = static_cast<const T*>(st.k);
  const T* v_pool = static_cast<const T*>(st.v);
  auto page = [&](const T* pool, int64_t block) {
    return pool + (head_pages + std::clamp<int64_t>(table[block], 0, st.num_blocks - 1)) *
                      bs * D;
  };

  for (int64_t b = first_key / bs; b <= last_key / bs; ++b) {
    const int64_t lo = std::max(first_key, b * bs);
    const int64_t count = std::min(last_key + 1, b * bs + bs) - lo;
    const float* k = AsFloat(page(k_pool, b) + (lo - b * bs) * D, count * D, k_scale, widened);
    const int64_t width = RoundUp(count, 8);
    Transpose(k, count, D, keys_t, cols);
    for (int64_t r = 0; r < padded_rows; r += kTileRows)
      Matmul<kTileRows, 2>(queries + r * D, D, keys_t, cols, D, scores + r * cols, cols, width,
                           false);
    // Online softmax per row. Row i sees keys lo + t for t in [t_begin, t_end) (causal, the
    // window, the page's end); the others get probability 0.
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t pos = pos0 + i % n;
      const int64_t t_begin = st.window > 0 ? std::max<int64_t>(0, pos - st.window + 1 - lo) : 0;
      const int64_t t_end = std::min(count, pos - lo + 1);
      float* row = scores + i * cols;
      if (t_end <= t_begin) {  // no key of this page is visible to this row
        std::fill(row, row + width, 0.f);
        continue;
      }
      float* seen = row + t_begin;
      const int64_t num_seen = t_end - t_begin;
      const float row_max = ScoresMax(seen, num_seen, st.scale, st.soft_cap);
      const float new_max = std::max(max[i], row_max);
      const float alpha = std::exp(max[i] - new_max);  // 0 while max[i] is -inf
      sum[i] = sum[i] * alpha + ExpShiftedSum(seen, num_seen, new_max);
      max[i] = new_max;
      std::fill(row, seen, 0.f);
      std::fill(row + t_end, row + width, 0.f);
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= alpha;
    }
    // V after the transpose is done with K's rows: the two share the widening buffer.
    const float* v = AsFloat(page(v_pool, b) + (lo - b * bs) * D, count * D, v_scale, widened);
    for (int64_t r = 0; r < padded_rows; r += kTileRows)
      Matmul<kTileRows, 2>(scores + r * cols, cols, v, D, count, acc + r * D, D, D, true);
  }
  for (int64_t j = 0; j < g; ++j)
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = j * n + r;
      const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
      float* o = st.out + ((begin + first + r) * num_q_heads + h * g + j) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] * inv;
    }
}

// A work item: {sequence, KV head, first query of the tile, or -1 - i for query i by the
// decode path}.
struct Item {
  int32_t seq, head, first;
};

// Runs the items on XLA's intra-op threads, on a pool of T.
template <typename T>
void AttendAll(ffi::ThreadPool& pool, const Step& step, const std::vector<Item>& items) {
  const int64_t cols = RoundUp(step.block_size, 8);
  const int64_t rows = RoundUp(step.group * kQueryTile, kTileRows);
  const size_t num_scores = std::max(step.group * step.width * step.block_size, rows * cols);
  const size_t num_acc = rows * step.head_dim;
  // Widened rows: a decode slice or a prefill tile's page (none for a float32 pool).
  const size_t num_widened =
      std::is_same_v<T, float> ? 0 : std::max(kSliceKeys, step.block_size) * step.head_dim;
  pagedjax::ParallelFor(pool, items.size(), [&](int64_t i) {
    thread_local Scratch scratch;  // grown, never shrunk: no zero-fill per item
    if (scratch.scores.size() < num_scores) scratch.scores.resize(num_scores);
    if (scratch.acc.size() < num_acc) scratch.acc.resize(num_acc);
    if (scratch.widened.size() < num_widened) scratch.widened.resize(num_widened);
    const Item item = items[i];
    if (item.first < 0) return AttendOne<T>(step, item.seq, item.head, -1 - item.first, scratch);
    if (scratch.queries.size() < num_acc) scratch.queries.resize(num_acc);
    if (scratch.keys_t.size() < size_t(step.head_dim * cols))
      scratch.keys_t.resize(step.head_dim * cols);
    if (scratch.max.size() < size_t(rows)) scratch.max.resize(rows), scratch.sum.resize(rows);
    AttendTile<T>(step, item.seq, item.head, item.first, scratch);
  });
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                              ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> seq_lens,
                              ffi::Buffer<ffi::S32> query_start_loc, float scale,
                              float soft_cap, int64_t invariant,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions(), k_dims = k.dimensions(), t_dims = tables.dimensions();
  if (q_dims.size() != 3 || k_dims.size() != 5 || t_dims.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: unexpected ranks");
  if (v.element_type() != k.element_type() ||
      !std::equal(k_dims.begin(), k_dims.end(), v.dimensions().begin(), v.dimensions().end()))
    return ffi::Error::InvalidArgument("paged_attention: k and v pools differ");
  if (k_scale.element_count() != size_t(k_dims[0] * k_dims[1]) ||
      v_scale.element_count() != size_t(k_dims[0] * k_dims[1]))
    return ffi::Error::InvalidArgument("paged_attention: scales must be [layers, KV heads]");
  const int64_t group = q_dims[1] / k_dims[1];
  if (group < 1 || group > kMaxGroup || q_dims[1] % k_dims[1] != 0)
    return ffi::Error::InvalidArgument("paged_attention: query heads per KV head must be 1-8");
  if (k_dims[4] % 8 != 0)
    return ffi::Error::InvalidArgument("paged_attention: head_dim must be a multiple of 8");
  Step step;
  step.q = q.typed_data();
  step.k = k.untyped_data();
  step.v = v.untyped_data();
  step.k_scale = k_scale.typed_data();
  step.v_scale = v_scale.typed_data();
  step.tables = tables.typed_data();
  step.seq_lens = seq_lens.typed_data();
  step.query_start_loc = query_start_loc.typed_data();
  step.out = out->typed_data();
  step.num_tokens = q_dims[0];
  step.num_seqs = t_dims[0];
  step.width = t_dims[1];
  step.num_kv_heads = k_dims[1];
  step.num_blocks = k_dims[2];
  step.block_size = k_dims[3];
  step.head_dim = k_dims[4];
  step.group = group;
  step.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, k_dims[0] - 1);
  step.window = window.typed_data()[0];
  step.scale = scale;
  step.soft_cap = soft_cap;
  std::fill(step.out, step.out + q_dims[0] * q_dims[1] * q_dims[2], 0.f);

  // Work items, prefill tiles first (the larger ones, so that the threads finish together).
  // Batch invariant: every query by the decode path, the longest contexts first.
  std::vector<Item> items;
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t s = 0; s < step.num_seqs; ++s) {
      const int64_t q_len = step.query_start_loc[s + 1] - step.query_start_loc[s];
      if (pass == 0 && q_len > 1 && !invariant) {
        for (int64_t first = 0; first < q_len; first += kQueryTile)
          for (int64_t h = 0; h < step.num_kv_heads; ++h)
            items.push_back({int32_t(s), int32_t(h), int32_t(first)});
      } else if (pass == 1 && (q_len == 1 || (invariant && q_len > 1))) {
        for (int64_t i = q_len - 1; i >= 0; --i)
          for (int64_t h = 0; h < step.num_kv_heads; ++h)
            items.push_back({int32_t(s), int32_t(h), int32_t(-1 - i)});
      }
    }
  switch (k.element_type()) {
    case ffi::DataType::F32:
      AttendAll<float>(pool, step, items);
      break;
    case ffi::DataType::BF16:
      AttendAll<BFloat16>(pool, step, items);
      break;
    case ffi::DataType::F16:
      AttendAll<Float16>(pool, step, items);
      break;
    case ffi::DataType::F8E4M3FN:
      AttendAll<Float8E4M3FN>(pool, step, items);
      break;
    default:
      return ffi::Error::InvalidArgument(
          "paged_attention: pools must be float32, bfloat16, float16 or float8_e4m3fn");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k pool
                                  .Arg<ffi::AnyBuffer>()         // v pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query start loc
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("invariant")
                                  .Ret<ffi::Buffer<ffi::F32>>());
