// Shared by the matmul kernels over weights packed in panels (packed_matmul.cc,
// int8_matmul.cc): the panel and block sizes, and the split of a matmul's panels among threads.
#pragma once

#include <algorithm>
#include <cstdint>

#include "float16.h"
#include "parallel.h"

namespace pagedjax {

constexpr int64_t kPanel = 24;  // output columns per panel: three 8-float vectors
constexpr int64_t kBlock = 32;  // k per scale and offset of a block-quantized weight

// Calls multiply(p) for every panel p of an [., N] output. Threads take ranges of panels:
// about four items per thread, and at most 32 panels each, since the item a thread finishes
// last is the other's idle time: uncapped, the LM head's large items left one thread idle for
// much of a decode step's call.
template <typename MultiplyFn>
void ForEachPanel(xla::ffi::ThreadPool& pool, int64_t N, const MultiplyFn& multiply) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = std::clamp<int64_t>(panels / (4 * threads), 1, 32);
  ParallelFor(pool, (panels + per_item - 1) / per_item, [&](int64_t item) {
    for (int64_t p = item * per_item; p < std::min(panels, (item + 1) * per_item); ++p)
      multiply(p);
  });
}

}  // namespace pagedjax
