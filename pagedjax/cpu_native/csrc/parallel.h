// Shared by the C++ CPU kernels (csrc/*.cc): the instruction-set switches, and a parallel loop
// over XLA's intra-op thread pool.
//
// build.py compiles the sources once per level (-march=x86-64-v4, -v3, or the baseline):
// PAGEDJAX_AVX512 adds AVX-512 code paths where they pay, on top of PAGEDJAX_AVX2's; without
// either the portable loops run. Every path computes each matmul output as the same float32
// sum in the same order, so the levels' matmuls agree bit for bit.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDJAX_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define PAGEDJAX_AVX512 1
#endif
#endif

namespace pagedjax {

// Calls work(i) for every i in [0, n), on this thread and up to num_threads - 1 of the pool's,
// which take items from a shared counter; returns when every call has finished.
template <typename Work>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, const Work& work) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  // Owned with the helpers: one may start after this returns, and then finds nothing left and
  // never calls `work` (whose captures may be gone by then).
  auto counters = std::make_shared<Counters>();
  auto drain = [counters, n, &work] {
    for (int64_t i; (i = counters->next.fetch_add(1)) < n;) {
      work(i);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(drain)(drain));  // a copy each
  drain();
  while (counters->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace pagedjax
