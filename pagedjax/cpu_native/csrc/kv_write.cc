// The write of a step's new K/V rows into a 16- or 8-bit KV pool, in place, for XLA:CPU (see
// attention.py's write_kv_cpu).
//
// XLA:CPU scatters into a bf16 or fp8 array by converting the whole array to a wider float and
// back (its float normalization), and a bitcast to integers around the scatter costs a copy of
// the pool: either way each layer's write of one token passes over the whole pool (timings in
// benchmarks/README.md). The pools are aliased to the outputs, so XLA hands the kernel the
// pool's own buffers.
//
// Inputs: k, v pools [L, Hkv, NB, bs, D]; k_rows, v_rows [T, Hkv, D] in the pool's dtype
// (already rounded or quantized as kv_cache.write_kv does); slots [T] (block * bs + offset;
// negative or past the pool: dropped); layer [1] (out of range: nothing written).
// Outputs: the k and v pools, aliased to the inputs.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Copies row t of `rows` (each KV head's D elements) into slot `slots[t]` of `layer`.
void WriteRows(const ffi::AnyBuffer& rows, const int32_t* slots, int64_t layer,
               ffi::AnyBuffer::Dimensions dims, size_t width, char* pool) {
  const int64_t num_kv_heads = dims[1], num_blocks = dims[2], bs = dims[3], D = dims[4];
  const int64_t num_tokens = rows.dimensions()[0], row_bytes = D * width;
  const char* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_blocks * bs) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t page = (layer * num_kv_heads + h) * num_blocks + slot / bs;
      std::memcpy(pool + (page * bs + slot % bs) * row_bytes,
                  src + (t * num_kv_heads + h) * row_bytes, row_bytes);
    }
  }
}

ffi::Error KvWriteImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer k_rows,
                       ffi::AnyBuffer v_rows, ffi::Buffer<ffi::S32> slots,
                       ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> k_out,
                       ffi::Result<ffi::AnyBuffer> v_out) {
  const auto dims = k.dimensions(), row_dims = k_rows.dimensions();
  if (dims.size() != 5 || row_dims.size() != 3 || row_dims[1] != dims[1] ||
      row_dims[2] != dims[4] || slots.element_count() != size_t(row_dims[0]))
    return ffi::Error::InvalidArgument("kv_write: unexpected shapes");
  const auto dtype = k.element_type();
  if (v.element_type() != dtype || k_rows.element_type() != dtype ||
      v_rows.element_type() != dtype)
    return ffi::Error::InvalidArgument("kv_write: the rows must be in the pool's dtype");
  const size_t width = ffi::ByteWidth(dtype);
  const int64_t l = layer.typed_data()[0];
  struct Pair {
    const ffi::AnyBuffer &pool, &rows;
    ffi::Result<ffi::AnyBuffer>& out;
  };
  for (Pair pair : {Pair{k, k_rows, k_out}, Pair{v, v_rows, v_out}}) {
    char* pool = static_cast<char*>(pair.out->untyped_data());
    // Aliased, the output is the pool's buffer; copied first should XLA ever hand another.
    if (pool != pair.pool.untyped_data())
      std::memcpy(pool, pair.pool.untyped_data(), pair.pool.size_bytes());
    if (l >= 0 && l < dims[0]) WriteRows(pair.rows, slots.typed_data(), l, dims, width, pool);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // k pool
                                  .Arg<ffi::AnyBuffer>()  // v pool
                                  .Arg<ffi::AnyBuffer>()  // k rows
                                  .Arg<ffi::AnyBuffer>()  // v rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::AnyBuffer>()  // k pool
                                  .Ret<ffi::AnyBuffer>());  // v pool
