// Logprobs of given tokens for XLA:CPU, called through the XLA FFI (see sampling.py): per
// row of logits, log-softmax at the row's token, the token's rank, and the k most likely
// tokens with their logprobs. XLA:CPU runs the log-softmax's exp-and-sum as a scalar loop on
// one thread; here the exp is an 8-wide polynomial and rows run on the intra-op pool.
//
// Ranks are 1 + the number of logits strictly greater than the token's (the log-softmax is a
// shift of the row, so this is the rank among logprobs without the ties its rounding makes).
// The top k come in descending order, ties to the lower index (as lax.top_k).
//
// Inputs: logits [R, V] f32; tokens [R] s32. Outputs: logprobs [R] f32; ranks [R] s32;
// top_ids [R, K] s32; top_logprobs [R, K] f32 (K >= 0).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "row_math.h"

namespace ffi = xla::ffi;

namespace {

using pagedjax::ArgMax;
using pagedjax::ExpSum;

int32_t CountGreater(const float* x, int64_t n, float value) {
  int64_t count = 0, i = 0;
#ifdef PAGEDJAX_AVX2
  const __m256 v = _mm256_set1_ps(value);
  for (; i + 8 <= n; i += 8) {
    const __m256 greater = _mm256_cmp_ps(_mm256_loadu_ps(x + i), v, _CMP_GT_OQ);
    count += __builtin_popcount(_mm256_movemask_ps(greater));
  }
#endif
  for (; i < n; ++i) count += x[i] > value;
  return int32_t(count);
}

// The k largest values and their indices, descending, ties to the lower index.
void TopK(const float* x, int64_t n, int64_t k, float* values, int32_t* indices) {
  int64_t held = 0;
  auto offer = [&](int64_t i) {
    if (held == k && !(x[i] > values[k - 1])) return;
    int64_t at = std::min(held, k - 1);  // the slot freed at the end
    while (at > 0 && x[i] > values[at - 1]) {
      values[at] = values[at - 1];
      indices[at] = indices[at - 1];
      --at;
    }
    values[at] = x[i];
    indices[at] = int32_t(i);
    held = std::min(held + 1, k);
  };
  int64_t i = 0;
#ifdef PAGEDJAX_AVX2
  for (; i + 8 <= n; i += 8) {
    if (held == k) {  // most blocks hold nothing above the k-th value: skip them whole
      const __m256 above = _mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(values[k - 1]),
                                         _CMP_GT_OQ);
      if (_mm256_movemask_ps(above) == 0) continue;
    }
    for (int64_t j = i; j < i + 8; ++j) offer(j);
  }
#endif
  for (; i < n; ++i) offer(i);
  for (; held < k; ++held) {  // fewer than k values in the row (V < K)
    values[held] = -INFINITY;
    indices[held] = 0;
  }
}

ffi::Error TokenLogprobsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                             ffi::Buffer<ffi::S32> tokens, ffi::ResultBuffer<ffi::F32> logprobs,
                             ffi::ResultBuffer<ffi::S32> ranks,
                             ffi::ResultBuffer<ffi::S32> top_ids,
                             ffi::ResultBuffer<ffi::F32> top_logprobs) {
  const auto dims = logits.dimensions(), top_dims = top_ids->dimensions();
  if (dims.size() != 2 || tokens.dimensions().size() != 1 || tokens.dimensions()[0] != dims[0] ||
      top_dims.size() != 2 || top_dims[0] != dims[0])
    return ffi::Error::InvalidArgument(
        "token_logprobs: logits [R, V], tokens [R] and top [R, K] expected");
  const int64_t rows = dims[0], vocab = dims[1], k = top_dims[1];
  const float* x = logits.typed_data();
  const int32_t* token = tokens.typed_data();
  float* out_logprobs = logprobs->typed_data();
  int32_t* out_ranks = ranks->typed_data();
  int32_t* out_top_ids = top_ids->typed_data();
  float* out_top_logprobs = top_logprobs->typed_data();
  pagedjax::ParallelFor(pool, rows, [&](int64_t r) {
    const float* row = x + r * vocab;
    bool finite = true;
    const float max = ArgMax(row, vocab, &finite).value;
    const float log_sum = float(std::log(ExpSum(row, vocab, max, -INFINITY, nullptr)));
    const float chosen = token[r] >= 0 && token[r] < vocab ? row[token[r]] : NAN;
    out_logprobs[r] = (chosen - max) - log_sum;
    out_ranks[r] = 1 + CountGreater(row, vocab, chosen);
    if (k == 0) return;
    float* values = out_top_logprobs + r * k;
    TopK(row, vocab, k, values, out_top_ids + r * k);
    for (int64_t j = 0; j < k; ++j) values[j] = (values[j] - max) - log_sum;
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenLogprobs, TokenLogprobsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tokens
                                  .Ret<ffi::Buffer<ffi::F32>>()   // logprobs
                                  .Ret<ffi::Buffer<ffi::S32>>()   // ranks
                                  .Ret<ffi::Buffer<ffi::S32>>()   // top ids
                                  .Ret<ffi::Buffer<ffi::F32>>());  // top logprobs
