// Sampling for XLA:CPU, called through the XLA FFI (see sampling.py): per row, temperature,
// then top-k, top-p and min-p as in `pagedjax.sampler.truncate`, then one draw by inverse CDF
// from 53 random bits. XLA:CPU runs 32 masked bisection passes per truncation rule, draws a
// noise value per token from threefry and runs exp on one thread; here each row is a few
// vectorizable passes.
//
// Truncation keeps the tokens at or above one threshold logit, ties at it kept: top-k the k-th
// largest; top-p, over the top-k distribution, the smallest logit whose tokens and all larger
// ones reach mass p; min-p probabilities of at least min_p x the top one. A row whose
// temperature is 0 takes the argmax (the first index of the largest).
//
// Inputs: logits [S, V] f32 (penalties and bias applied); temperature, top_p, min_p [S] f32;
// top_k [S] s32 (0: off); bits [S, 2] u32. Outputs: tokens [S] s32; threshold [S] f32 (the
// smallest kept scaled logit, for tests; +inf for greedy rows).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "parallel.h"
#include "row_math.h"

namespace ffi = xla::ffi;

namespace {

using pagedjax::ArgMax;
using pagedjax::ExpSum;

// The row's first largest value's index (NaNs never win).
int32_t FirstMax(const float* x, int64_t n) {
  bool finite = true;
  return int32_t(ArgMax(x, n, &finite).index);
}

// The largest threshold t (one of the values) such that the values >= t hold mass >= target;
// `candidates` are (value, mass) pairs of every value that may be it.
float ThresholdReaching(std::vector<std::pair<float, double>>& candidates, double target) {
  std::sort(candidates.begin(), candidates.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  double mass = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    mass += candidates[i].second;
    const bool last_of_ties =
        i + 1 == candidates.size() || candidates[i + 1].first < candidates[i].first;
    if (last_of_ties && mass >= target) return candidates[i].first;
  }
  return candidates.empty() ? -INFINITY : candidates.back().first;
}

int32_t SampleRow(const float* logits, int64_t vocab, float temperature, int32_t top_k,
                  float top_p, float min_p, const uint32_t* bits, float* threshold_out) {
  if (!(temperature > 0)) {
    *threshold_out = INFINITY;
    return FirstMax(logits, vocab);
  }
  thread_local std::vector<float> scaled, sorted, weight;
  thread_local std::vector<std::pair<float, double>> candidates;
  scaled.resize(vocab);
  weight.resize(vocab);
  for (int64_t i = 0; i < vocab; ++i) scaled[i] = logits[i] / temperature;
  bool finite = true;
  const float max = ArgMax(scaled.data(), vocab, &finite).value;
  float threshold = -INFINITY;
  if (top_k > 0 && top_k < vocab) {
    sorted.assign(scaled.begin(), scaled.end());
    for (float& v : sorted) v = std::isnan(v) ? -INFINITY : v;  // NaN breaks nth_element's order
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(),
                     std::greater<float>());
    threshold = sorted[top_k - 1];
  }
  const double total = ExpSum(scaled.data(), vocab, max, threshold, weight.data());
  if (top_p < 1.f) {
    // Only values whose probability is at least `floor` can be the threshold, once the values
    // at or above floor reach p; lower it until they do.
    const double target = double(top_p) * total;
    for (double floor = 1e-4; ; floor *= 1e-4) {
      candidates.clear();
      double mass = 0;
      for (int64_t i = 0; i < vocab; ++i) {
        if (weight[i] > 0 && weight[i] >= floor) {  // the top token's weight is 1
          candidates.emplace_back(scaled[i], weight[i]);
          mass += weight[i];
        }
      }
      if (mass >= target || floor < 1e-45) {  // below every float: all weights in
        threshold = std::max(threshold, ThresholdReaching(candidates, target));
        break;
      }
    }
  }
  if (min_p > 0.f) {  // probability >= min_p x the top's: e^(x - max) >= min_p
    float lowest = INFINITY;
    for (int64_t i = 0; i < vocab; ++i)
      if (weight[i] > 0 && weight[i] >= double(min_p)) lowest = std::min(lowest, scaled[i]);
    threshold = std::max(threshold, lowest);
  }
  *threshold_out = threshold;
  // One draw by inverse CDF over the kept tokens in index order.
  double kept = 0;
  for (int64_t i = 0; i < vocab; ++i) kept += scaled[i] >= threshold ? weight[i] : 0.0;
  const uint64_t random = (uint64_t(bits[0]) << 21) ^ (uint64_t(bits[1]) >> 11);  // 53 bits
  const double u = double(random) * 0x1.0p-53 * kept;
  double cumulative = 0;
  int64_t last = -1;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!(scaled[i] >= threshold) || weight[i] == 0) continue;
    cumulative += weight[i];
    last = i;
    if (cumulative > u) return int32_t(i);
  }
  return last >= 0 ? int32_t(last) : FirstMax(logits, vocab);  // rounding at the very end
}

ffi::Error RandomSampleImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                            ffi::Buffer<ffi::F32> temperature, ffi::Buffer<ffi::S32> top_k,
                            ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                            ffi::Buffer<ffi::U32> bits, ffi::ResultBuffer<ffi::S32> tokens,
                            ffi::ResultBuffer<ffi::F32> thresholds) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || bits.dimensions().size() != 2 || bits.dimensions()[1] != 2)
    return ffi::Error::InvalidArgument("random_sample: logits [S, V] and bits [S, 2] expected");
  const int64_t rows = dims[0], vocab = dims[1];
  pagedjax::ParallelFor(pool, rows, [&](int64_t r) {
    tokens->typed_data()[r] = SampleRow(
        logits.typed_data() + r * vocab, vocab, temperature.typed_data()[r],
        top_k.typed_data()[r], top_p.typed_data()[r], min_p.typed_data()[r],
        bits.typed_data() + 2 * r, thresholds->typed_data() + r);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RandomSample, RandomSampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature
                                  .Arg<ffi::Buffer<ffi::S32>>()   // top_k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p
                                  .Arg<ffi::Buffer<ffi::F32>>()   // min_p
                                  .Arg<ffi::Buffer<ffi::U32>>()   // bits
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens
                                  .Ret<ffi::Buffer<ffi::F32>>());  // thresholds
