// Greedy sampling for XLA:CPU, called through the XLA FFI (see sampling.py): per row of
// logits, whether every raw logit is finite, and the argmax after a sparse logit bias, in one
// pass over the row. XLA:CPU runs argmax as a variadic (value, index) reduction that it does
// not vectorize, plus a second pass for the finite check; here one vectorized pass does both.
//
// The bias is applied without writing the row: the argmax of the raw row, if that token has
// no bias, competes with each biased token's raw + bias (ties: the lower index, as jnp.argmax).
// If the raw argmax has a bias (e.g. a banned end-of-sequence token the model wants), the row
// is copied, biased and searched again.
//
// Inputs: logits [S, V] f32; bias_ids [S, B] s32 (-1: none; repeated ids add up); bias_values
// [S, B] f32. Outputs: tokens [S] s32; finite [S] pred (the raw row has no NaN or inf).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "row_math.h"

namespace ffi = xla::ffi;

namespace {

using pagedjax::ArgMax;
using pagedjax::Best;

ffi::Error GreedySampleImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                            ffi::Buffer<ffi::S32> bias_ids, ffi::Buffer<ffi::F32> bias_values,
                            ffi::ResultBuffer<ffi::S32> tokens,
                            ffi::ResultBuffer<ffi::PRED> finite) {
  const auto dims = logits.dimensions(), bias_dims = bias_ids.dimensions();
  if (dims.size() != 2 || bias_dims.size() != 2 || bias_dims[0] != dims[0])
    return ffi::Error::InvalidArgument("greedy_sample: logits [S, V] and bias [S, B] expected");
  const int64_t rows = dims[0], vocab = dims[1], width = bias_dims[1];
  const float* x = logits.typed_data();
  const int32_t* ids = bias_ids.typed_data();
  const float* values = bias_values.typed_data();
  int32_t* out = tokens->typed_data();
  bool* out_finite = finite->typed_data();
  pagedjax::ParallelFor(pool, rows, [&](int64_t r) {
    const float* row = x + r * vocab;
    const int32_t* row_ids = ids + r * width;
    const float* row_values = values + r * width;
    bool all_finite = vocab > 0;
    Best best = ArgMax(row, vocab, &all_finite);
    out_finite[r] = all_finite;
    auto biased = [&](int64_t token) {  // the token's logit after every bias entry for it
      float v = row[token];
      for (int64_t b = 0; b < width; ++b)
        if (row_ids[b] == token) v += row_values[b];
      return v;
    };
    bool top_biased = false;
    for (int64_t b = 0; b < width; ++b) top_biased |= row_ids[b] == best.index;
    if (top_biased) {  // rare: search a biased copy of the row
      thread_local std::vector<float> copy;
      copy.assign(row, row + vocab);
      for (int64_t b = 0; b < width; ++b)
        if (row_ids[b] >= 0 && row_ids[b] < vocab) copy[row_ids[b]] += row_values[b];
      bool unused = true;
      best = ArgMax(copy.data(), vocab, &unused);
    } else {
      for (int64_t b = 0; b < width; ++b) {
        const int64_t token = row_ids[b];
        if (token < 0 || token >= vocab) continue;
        const float v = biased(token);
        if (v > best.value || (v == best.value && token < best.index)) best = {v, token};
      }
    }
    out[r] = int32_t(best.index);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GreedySample, GreedySampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()   // bias ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias values
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens
                                  .Ret<ffi::Buffer<ffi::PRED>>());  // finite
