// Paged decode attention for XLA:CPU, called through the XLA FFI (see cpu_decode.py).
//
// XLA:CPU cannot fuse a page gather into a dot: the XLA path copies every page of a decode
// tile, then runs batched matmuls with 3-8 columns over the copy, and reaches about 3 GB/s of
// K/V. Here each (sequence, KV head) pair walks its block table and reads every K/V row once,
// in place, for all query heads of its group, with an online softmax in float32; pairs are
// shared among XLA's intra-op threads.
//
// Inputs (float32 pool only; other dtypes take the XLA path):
//   q [T, Hq, D]; k, v [L, Hkv, NB, bs, D]; layer [1]; window [1] (<= 0: none);
//   block_tables [S, W]; seq_lens [S]; query_start_loc [S + 1]
// Output: [T, Hq, D]; rows of sequences whose q_len is 1 are written, all others are zero.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Step {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  float* out;
  int64_t num_tokens, num_seqs, width, num_kv_heads, num_blocks, block_size, head_dim, group, layer;
  int32_t window;
  float scale, soft_cap;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void AttendOne(const Step& st, int64_t item, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t s = item / st.num_kv_heads, h = item % st.num_kv_heads;
  if (st.query_start_loc[s + 1] - st.query_start_loc[s] != 1) return;  // not a decode row
  const int64_t D = st.head_dim, g = st.group, bs = st.block_size;
  const int64_t row = st.query_start_loc[s], num_q_heads = st.num_kv_heads * g;
  if (row < 0 || row >= st.num_tokens) return;
  // Clipped into the block table and the pool, as the XLA path clips its gathers: tables are
  // checked where they are built, and a bad one must not read outside the pool.
  const int64_t len = std::min<int64_t>(st.seq_lens[s], st.width * st.block_size);
  const int64_t start = st.window > 0 ? std::max<int64_t>(0, len - st.window) : 0;
  const float* q = st.q + (row * num_q_heads + h * g) * D;
  const int64_t head_pages = (st.layer * st.num_kv_heads + h) * st.num_blocks;
  float m[8], total[8];
  std::fill(m, m + g, -INFINITY);
  std::fill(total, total + g, 0.f);
  std::fill(acc.begin(), acc.begin() + g * D, 0.f);

  for (int64_t first = start; first < len;) {
    const int64_t page = std::clamp<int64_t>(st.tables[s * st.width + first / bs], 0,
                                             st.num_blocks - 1);
    const int64_t offset = first % bs, n = std::min(bs - offset, len - first);
    const float* k_rows = st.k + ((head_pages + page) * bs + offset) * D;
    const float* v_rows = st.v + ((head_pages + page) * bs + offset) * D;
    for (int64_t t = 0; t < n; ++t) {
      const float* key = k_rows + t * D;
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = q + j * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qj[d] * key[d];
        float score = dot * st.scale;
        if (st.soft_cap > 0.f) score = st.soft_cap * std::tanh(score / st.soft_cap);
        scores[j * bs + t] = score;
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      const float* sj = scores.data() + j * bs;
      float m_new = m[j];
      for (int64_t t = 0; t < n; ++t) m_new = std::max(m_new, sj[t]);
      const float alpha = std::exp(m[j] - m_new);
      float* a = acc.data() + j * D;
      total[j] *= alpha;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      for (int64_t t = 0; t < n; ++t) {
        const float p = std::exp(sj[t] - m_new);
        const float* value = v_rows + t * D;
        total[j] += p;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * value[d];
      }
      m[j] = m_new;
    }
    first += n;
  }
  float* o = st.out + (row * num_q_heads + h * g) * D;
  for (int64_t j = 0; j < g; ++j) {
    const float inv = total[j] > 0.f ? 1.f / total[j] : 0.f;
    for (int64_t d = 0; d < D; ++d) o[j * D + d] = acc[j * D + d] * inv;
  }
}

// Takes (sequence, head) pairs until none is left; every thread runs this.
void Drain(Step& st, int64_t num_items) {
  std::vector<float> scores(st.group * st.block_size), acc(st.group * st.head_dim);
  for (int64_t i; (i = st.next.fetch_add(1)) < num_items;) {
    AttendOne(st, i, scores, acc);
    st.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq_lens,
                           ffi::Buffer<ffi::S32> query_start_loc, float scale, float soft_cap,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions(), k_dims = k.dimensions(), t_dims = tables.dimensions();
  if (q_dims.size() != 3 || k_dims.size() != 5 || t_dims.size() != 2)
    return ffi::Error::InvalidArgument("paged_decode: unexpected ranks");
  const int64_t group = q_dims[1] / k_dims[1];
  if (group < 1 || group > 8 || q_dims[1] % k_dims[1] != 0)
    return ffi::Error::InvalidArgument("paged_decode: query heads per KV head must be 1-8");
  // Shared with helper tasks that may start after this call returns: owned by all of them.
  auto st = std::make_shared<Step>();
  st->q = q.typed_data();
  st->k = k.typed_data();
  st->v = v.typed_data();
  st->tables = tables.typed_data();
  st->seq_lens = seq_lens.typed_data();
  st->query_start_loc = query_start_loc.typed_data();
  st->out = out->typed_data();
  st->num_tokens = q_dims[0];
  st->num_seqs = t_dims[0];
  st->width = t_dims[1];
  st->num_kv_heads = k_dims[1];
  st->num_blocks = k_dims[2];
  st->block_size = k_dims[3];
  st->head_dim = k_dims[4];
  st->group = group;
  st->layer = std::clamp<int64_t>(layer.typed_data()[0], 0, k_dims[0] - 1);
  st->window = window.typed_data()[0];
  st->scale = scale;
  st->soft_cap = soft_cap;
  std::fill(st->out, st->out + q_dims[0] * q_dims[1] * q_dims[2], 0.f);

  const int64_t num_items = st->num_seqs * st->num_kv_heads;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([st, num_items] { Drain(*st, num_items); });
  Drain(*st, num_items);
  // Every pair was taken; wait for the helpers still finishing theirs (a helper that starts
  // late finds nothing left and touches no buffer).
  while (st->done.load(std::memory_order_acquire) < num_items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query start loc
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
