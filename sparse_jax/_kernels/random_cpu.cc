// jax's random bits on CPU (XLA FFI), for only the rows that are used: table rows drawn with
// partitionable threefry2x32 (jax's default), element (r, j) of a `[rows, dim]` draw being
// threefry2x32 of the flat index n = r * dim + j (as the words n >> 32, n & 0xffffffff)
// under the key, the two output words xor-ed: what `jax.random.bits(key, (rows, dim))`
// gives, so `jax.random.uniform` computed from them is bit for bit the same.
//
// RowBits: a managed table's fresh rows (sparse_jax/managed/_reset.py): row i of `rows`
//   (up to the first `fill`) gets row i of a `[len(rows), dim]` draw; the rows past `fill`
//   stay 0.
// TableBits: rows `first .. first + count` of a `[num_rows, dim]` draw (the output's shape
//   is `[count, dim]`): a table's initial rows (sparse_jax/_uniform_init.py), whole or only
//   those a device holds, with no counter arrays and no whole-table temporaries.
// ResetRows: RowBits turned into `jax.random.uniform`'s floats and written straight into the
//   rows of a float32 table they are drawn for (in place: the table is aliased to the
//   output), one block of the table at a time: only the rows used are touched, where XLA's
//   draw, conversion and scatter each pass over all `len(rows)` rows.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline uint32_t Rotl(uint32_t v, uint32_t r) { return (v << r) | (v >> (32 - r)); }

// Threefry-2x32, 20 rounds (Random123's; jax's `threefry2x32`): the pair hashed under the key.
inline void Threefry2x32(uint32_t k0, uint32_t k1, uint32_t& x0, uint32_t& x1) {
  static constexpr uint32_t kRot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  x0 += ks[0];
  x1 += ks[1];
  for (uint32_t block = 0; block < 5; ++block) {
    for (int r = 0; r < 4; ++r) {
      x0 += x1;
      x1 = Rotl(x1, kRot[block & 1][r]);
      x1 ^= x0;
    }
    x0 += ks[(block + 1) % 3];
    x1 += ks[(block + 2) % 3] + block + 1;
  }
}

// o[i * dim + j] = bits of element (first + i, j), for i < count; threads over rows.
void DrawRows(uint32_t k0, uint32_t k1, uint64_t first, int64_t count, int64_t dim, uint32_t* o) {
#pragma omp parallel for schedule(static) if (count * dim >= (1 << 16))
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t base = (first + static_cast<uint64_t>(i)) * static_cast<uint64_t>(dim);
    uint32_t* row = o + i * dim;
    for (int64_t j = 0; j < dim; ++j) {
      const uint64_t n = base + static_cast<uint64_t>(j);
      uint32_t x0 = static_cast<uint32_t>(n >> 32), x1 = static_cast<uint32_t>(n);
      Threefry2x32(k0, k1, x0, x1);
      row[j] = x0 ^ x1;
    }
  }
}

ffi::Error RowBitsImpl(ffi::Buffer<ffi::U32> key, ffi::Buffer<ffi::S32> rows,
                       ffi::Result<ffi::Buffer<ffi::U32>> out, int32_t fill) {
  const int32_t* r = rows.typed_data();
  const int64_t k = rows.element_count();
  const int64_t dim = k == 0 ? 0 : out->element_count() / k;
  uint32_t* o = out->typed_data();
  int64_t used = 0;
  while (used < k && r[used] != fill) ++used;
  DrawRows(key.typed_data()[0], key.typed_data()[1], 0, used, dim, o);
  std::memset(o + used * dim, 0, sizeof(uint32_t) * (k - used) * dim);
  return ffi::Error::Success();
}

ffi::Error TableBitsImpl(ffi::Buffer<ffi::U32> key, ffi::Result<ffi::Buffer<ffi::U32>> out,
                         int64_t first) {
  const auto dims = out->dimensions();
  if (dims.size() != 2 || first < 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "HybridrecTableBits: the output must be [count, dim] and first >= 0");
  DrawRows(key.typed_data()[0], key.typed_data()[1], static_cast<uint64_t>(first), dims[0], dims[1],
           out->typed_data());
  return ffi::Error::Success();
}

// `jax.random.uniform`'s float from 32 random bits, op for op: the top 23 bits as a float in
// [1, 2), minus 1, times the span plus `lo` (XLA:CPU contracts that multiply-add into one
// fused operation, so `fma` gives its bits), then at least `lo`.
inline float BitsToUniform(uint32_t bits, float lo, float span) {
  uint32_t word = (bits >> 9) | 0x3F800000u;
  float f;
  std::memcpy(&f, &word, sizeof f);
  return std::max(lo, std::fma(f - 1.0f, span, lo));
}

// The buffer row holding table row `row` of the block `[row_offset, row_offset + num_rows)`
// stored from buffer row `buffer_row` on, or -1 when the block does not hold it (or the
// buffer's `height` rows end before it): the reset kernels' rows.
inline int64_t BlockRow(int32_t row, int64_t buffer_row, int64_t row_offset, int64_t num_rows,
                        int64_t height) {
  const int64_t at = buffer_row + static_cast<int64_t>(row) - row_offset;
  if (row < row_offset || row >= row_offset + num_rows || at < 0 || at >= height) return -1;
  return at;
}

// Row i of `rows` (before the first `fill`) gets row i of the `[len(rows), dim]` uniform
// draw, columns `col_offset .. col_offset + num_cols`, written at buffer row `buffer_row +
// rows[i] - row_offset` when it lies in the block `[row_offset, row_offset + num_rows)` and
// `here` (this device stores the block); every other row keeps its values.
ffi::Error ResetRowsImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::U32> key,
                         ffi::Buffer<ffi::F32> bounds, ffi::Buffer<ffi::S32> rows,
                         ffi::Buffer<ffi::PRED> here, ffi::Result<ffi::Buffer<ffi::F32>> out,
                         int32_t fill, int64_t dim, int64_t buffer_row, int64_t row_offset,
                         int64_t num_rows, int64_t col_offset, int64_t num_cols) {
  const auto dims = table.dimensions();
  if (dims.size() != 2 || num_cols > dims[1] || col_offset + num_cols > dim || num_cols < 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "HybridrecResetRows: the table must be [rows, width >= num_cols] and the "
                      "block's columns within the draw's dim");
  float* o = out->typed_data();
  if (o != table.typed_data())  // not aliased: start from the table's values
    std::memcpy(o, table.typed_data(), sizeof(float) * table.element_count());
  if (!*here.typed_data()) return ffi::Error::Success();
  const int64_t width = dims[1], height = dims[0];
  const int32_t* r = rows.typed_data();
  const int64_t k = rows.element_count();
  int64_t used = 0;
  while (used < k && r[used] != fill) ++used;
  const uint32_t k0 = key.typed_data()[0], k1 = key.typed_data()[1];
  const float lo = bounds.typed_data()[0], span = bounds.typed_data()[1] - lo;
#pragma omp parallel for schedule(static) if (used * num_cols >= (1 << 16))
  for (int64_t i = 0; i < used; ++i) {
    const int64_t at = BlockRow(r[i], buffer_row, row_offset, num_rows, height);
    if (at < 0) continue;
    const uint64_t base = static_cast<uint64_t>(i) * static_cast<uint64_t>(dim) +
                          static_cast<uint64_t>(col_offset);
    float* row = o + at * width;
    for (int64_t j = 0; j < num_cols; ++j) {
      const uint64_t n = base + static_cast<uint64_t>(j);
      uint32_t x0 = static_cast<uint32_t>(n >> 32), x1 = static_cast<uint32_t>(n);
      Threefry2x32(k0, k1, x0, x1);
      row[j] = BitsToUniform(x0 ^ x1, lo, span);
    }
  }
  return ffi::Error::Success();
}

// The reset's other half: row `buffer_row + rows[i] - row_offset` of a per-row state
// buffer (an optimizer's moments: `[R, ...]`, any dtype) set to zero for each i before the
// first `fill` whose row lies in the block `[row_offset, row_offset + num_rows)`, when
// `here`; every other row keeps its values. (XLA's form, a select and a scatter over every
// entry of `rows`, fill included, took ~0.1-0.2 ms at 65,536 entries.)
ffi::Error ZeroRowsImpl(ffi::AnyBuffer state, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::PRED> here,
                        ffi::Result<ffi::AnyBuffer> out, int32_t fill, int64_t buffer_row,
                        int64_t row_offset, int64_t num_rows) {
  const auto dims = state.dimensions();
  if (dims.size() < 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "HybridrecZeroRows: the state must have a row axis ([rows, ...])");
  char* o = static_cast<char*>(out->untyped_data());
  if (o != state.untyped_data())  // not aliased: start from the state's values
    std::memcpy(o, state.untyped_data(), state.size_bytes());
  if (!*here.typed_data() || dims[0] == 0) return ffi::Error::Success();
  const int64_t height = dims[0];
  const size_t row_bytes = state.size_bytes() / static_cast<size_t>(height);
  const int32_t* r = rows.typed_data();
  const int64_t k = rows.element_count();
  for (int64_t i = 0; i < k && r[i] != fill; ++i) {
    const int64_t at = BlockRow(r[i], buffer_row, row_offset, num_rows, height);
    if (at < 0) continue;
    std::memset(o + at * row_bytes, 0, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecZeroRows, ZeroRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fill")
                                  .Attr<int64_t>("buffer_row")
                                  .Attr<int64_t>("row_offset")
                                  .Attr<int64_t>("num_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecResetRows, ResetRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fill")
                                  .Attr<int64_t>("dim")
                                  .Attr<int64_t>("buffer_row")
                                  .Attr<int64_t>("row_offset")
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("col_offset")
                                  .Attr<int64_t>("num_cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecRowBits, RowBitsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Attr<int32_t>("fill"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecTableBits, TableBitsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("first"));
