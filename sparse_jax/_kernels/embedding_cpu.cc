// Fused CPU kernels for hybridrec's embedding lookups and sparse updates (XLA FFI).
//
// PooledSum:   out[b, :] = sum_l w[b, l] * table[rows[b, l], :]   (w == 0 skips the row)
// FusedUpdate: dedup the (row, bag, scale) stream with a row->slot map, sum
//              scale * bag_grads[bag] per unique row, then apply the row rule in place
//              (table and state are aliased to the outputs; XLA donates them).
// Both are multi-threaded (OpenMP): bags split over threads for PooledSum; for FusedUpdate
// each row is owned by one thread (a hash of the row), so no two threads touch a row.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline void axpy(float* __restrict acc, const float* __restrict row, float w, int64_t d) {
  for (int64_t k = 0; k < d; ++k) acc[k] += w * row[k];
}

// One bag at a time with the accumulator in registers: DIM known at compile time for the
// common widths, a runtime loop otherwise. Rows are prefetched PREFETCH ids ahead, across
// bag boundaries (the id matrix is contiguous).
constexpr int64_t PREFETCH = 8;

template <int64_t DIM>
void PoolBags(const float* t, int64_t num_rows, const int32_t* r, const float* w, float* o,
              int64_t bags, int64_t cap, int64_t dim) {
  const int64_t d = DIM > 0 ? DIM : dim;
  const int64_t total = bags * cap;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < bags; ++b) {
    float acc[DIM > 0 ? DIM : 1];
    float* out = o + b * d;
    if (DIM > 0) {
      for (int64_t k = 0; k < DIM; ++k) acc[k] = 0.0f;
    } else {
      std::memset(out, 0, sizeof(float) * d);
    }
    for (int64_t l = 0; l < cap; ++l) {
      const int64_t i = b * cap + l;
      if (i + PREFETCH < total) {
        const int64_t ahead = r[i + PREFETCH];
        if (ahead >= 0 && ahead < num_rows) {
          const char* p = reinterpret_cast<const char*>(t + ahead * d);
          for (int64_t line = 0; line < d * 4; line += 64) __builtin_prefetch(p + line);
        }
      }
      const float wl = w[i];
      const int64_t row = r[i];
      if (wl == 0.0f || row < 0 || row >= num_rows) continue;
      const float* src = t + row * d;
      if (DIM > 0) {
        for (int64_t k = 0; k < DIM; ++k) acc[k] += wl * src[k];
      } else {
        axpy(out, src, wl, d);
      }
    }
    if (DIM > 0) std::memcpy(out, acc, sizeof(float) * DIM);
  }
}

ffi::Error PooledSumImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> rows,
                         ffi::Buffer<ffi::F32> weights, ffi::ResultBuffer<ffi::F32> out) {
  const auto tdims = table.dimensions();
  const auto rdims = rows.dimensions();
  if (tdims.size() != 2 || rdims.size() != 2) {
    return ffi::Error::InvalidArgument("PooledSum: table must be [rows, dim] and rows [bags, cap]");
  }
  const int64_t num_rows = tdims[0], dim = tdims[1];
  const int64_t bags = rdims[0], cap = rdims[1];
  const float* t = table.typed_data();
  const int32_t* r = rows.typed_data();
  const float* w = weights.typed_data();
  float* o = out->typed_data();
  switch (dim) {
    case 8: PoolBags<8>(t, num_rows, r, w, o, bags, cap, dim); break;
    case 16: PoolBags<16>(t, num_rows, r, w, o, bags, cap, dim); break;
    case 32: PoolBags<32>(t, num_rows, r, w, o, bags, cap, dim); break;
    case 64: PoolBags<64>(t, num_rows, r, w, o, bags, cap, dim); break;
    case 128: PoolBags<128>(t, num_rows, r, w, o, bags, cap, dim); break;
    default: PoolBags<0>(t, num_rows, r, w, o, bags, cap, dim); break;
  }
  return ffi::Error::Success();
}

// Pooling straight from the jagged layout (no padded id matrix): sample b of feature f reads
// values[offsets[key[f] * B + b] : offsets[key[f] * B + b + 1]], whose table starts at
// row_offset[f] in the buffer and has num_rows[f] rows, and writes out[b, f * dim : ...]
// (the KeyedTensor layout). Ids outside the table are clamped (clamp = 1) or skipped;
// mean[f] divides by the bag's length; without per-id weights (weighted = 0) w is unused.
template <int64_t DIM>
void PoolJagged(const float* t, const int32_t* v, const int32_t* off, const float* w,
                const int32_t* key, const int32_t* row_off, const int32_t* nrows,
                const int32_t* mean, float* o, int64_t features, int64_t stride, int64_t dim,
                bool clamp, bool weighted) {
  const int64_t d = DIM > 0 ? DIM : dim;
#pragma omp parallel for schedule(static)
  for (int64_t bag = 0; bag < features * stride; ++bag) {
    const int64_t b = bag / features, f = bag % features;  // sample-major: writes stay local
    const int64_t seg = static_cast<int64_t>(key[f]) * stride + b;
    const int64_t start = off[seg], end = off[seg + 1];
    const int64_t feature_end = off[(static_cast<int64_t>(key[f]) + 1) * stride];
    const int64_t n = nrows[f];
    float acc[DIM > 0 ? DIM : 1];
    float* out = o + (b * features + f) * d;
    if (DIM > 0) {
      for (int64_t k = 0; k < DIM; ++k) acc[k] = 0.0f;
    } else {
      std::memset(out, 0, sizeof(float) * d);
    }
    for (int64_t i = start; i < end; ++i) {
      if (i + PREFETCH < feature_end) {
        const int64_t ahead = v[i + PREFETCH];
        if (ahead >= 0 && ahead < n) {
          const char* p = reinterpret_cast<const char*>(t + (ahead + row_off[f]) * d);
          for (int64_t line = 0; line < d * 4; line += 64) __builtin_prefetch(p + line);
        }
      }
      int64_t id = v[i];
      if (id < 0 || id >= n) {
        if (!clamp) continue;
        id = id < 0 ? 0 : n - 1;
      }
      const float wi = weighted ? w[i] : 1.0f;
      const float* src = t + (id + row_off[f]) * d;
      if (DIM > 0) {
        for (int64_t k = 0; k < DIM; ++k) acc[k] += wi * src[k];
      } else {
        axpy(out, src, wi, d);
      }
    }
    const float scale = (mean[f] && end > start) ? 1.0f / static_cast<float>(end - start) : 1.0f;
    if (DIM > 0) {
      for (int64_t k = 0; k < DIM; ++k) out[k] = acc[k] * scale;
    } else if (scale != 1.0f) {
      for (int64_t k = 0; k < d; ++k) out[k] *= scale;
    }
  }
}

ffi::Error JaggedPooledSumImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> values,
                               ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::F32> weights,
                               ffi::Buffer<ffi::S32> key, ffi::Buffer<ffi::S32> row_off,
                               ffi::Buffer<ffi::S32> nrows, ffi::Buffer<ffi::S32> mean,
                               ffi::ResultBuffer<ffi::F32> out, int64_t stride, int32_t clamp,
                               int32_t weighted) {
  const int64_t dim = table.dimensions()[1];
  const int64_t features = key.element_count();
  const float* t = table.typed_data();
  const int32_t* v = values.typed_data();
  const int32_t* off = offsets.typed_data();
  const float* w = weights.typed_data();
  float* o = out->typed_data();
#define HYBRIDREC_JAGGED(D)                                                                     \
  PoolJagged<D>(t, v, off, w, key.typed_data(), row_off.typed_data(), nrows.typed_data(),      \
                mean.typed_data(), o, features, stride, dim, clamp != 0, weighted != 0)
  switch (dim) {
    case 8: HYBRIDREC_JAGGED(8); break;
    case 16: HYBRIDREC_JAGGED(16); break;
    case 32: HYBRIDREC_JAGGED(32); break;
    case 64: HYBRIDREC_JAGGED(64); break;
    case 128: HYBRIDREC_JAGGED(128); break;
    default: HYBRIDREC_JAGGED(0); break;
  }
#undef HYBRIDREC_JAGGED
  return ffi::Error::Success();
}

// rule: 0 = sgd, 1 = rowwise adagrad (state [rows]), 2 = adagrad (state [rows, dim]).
ffi::Error FusedUpdateImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> state,
                           ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> bags,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bag_grads,
                           ffi::ResultBuffer<ffi::F32> table_out,
                           ffi::ResultBuffer<ffi::F32> state_out, int32_t rule, float lr,
                           float eps) {
  const int64_t num_rows = table.dimensions()[0], dim = table.dimensions()[1];
  const int64_t n = rows.element_count();
  const int64_t num_bags = bag_grads.dimensions()[0];
  float* t = table_out->typed_data();
  float* s = state_out->typed_data();
  if (t != table.typed_data()) std::memcpy(t, table.typed_data(), table.size_bytes());
  if (s != state.typed_data()) std::memcpy(s, state.typed_data(), state.size_bytes());
  const int32_t* r = rows.typed_data();
  const int32_t* bg = bags.typed_data();
  const float* sc = scale.typed_data();
  const float* g = bag_grads.typed_data();
  std::vector<int32_t> slot_of;  // row -> slot (per call: concurrent calls from several devices)
  if (slot_of.size() < static_cast<size_t>(num_rows)) slot_of.assign(num_rows, -1);
  const int threads = std::max(1, omp_get_max_threads());
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    const uint64_t nt = static_cast<uint64_t>(omp_get_num_threads());
    // owner thread of a row: a multiply-shift hash (no division in the hot loops)
    auto mine = [&](int64_t row) {
      return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(row) * 0x9E3779B1u) * nt) >> 32) == tid;
    };
    // Counting sort of this thread's ids (the rows it owns) by unique row, so each
    // row's gradient is summed in registers and the rule applied once: no [rows, dim] or
    // [unique, dim] buffer is ever built.
    static thread_local std::vector<int32_t> unique, start, order;
    unique.clear();
    start.clear();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = r[i];
      if (row < 0 || row >= num_rows || sc[i] == 0.0f || bg[i] < 0 || bg[i] >= num_bags || !mine(row)) continue;
      int32_t slot = slot_of[row];
      if (slot < 0) {
        slot = slot_of[row] = static_cast<int32_t>(unique.size());
        unique.push_back(static_cast<int32_t>(row));
        start.push_back(0);
      }
      ++start[slot];
    }
    int32_t total = 0;
    for (auto& c : start) {  // counts -> exclusive prefix sums
      const int32_t count = c;
      c = total;
      total += count;
    }
    order.resize(total);
    start.push_back(total);
    std::vector<int32_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = r[i];
      if (row < 0 || row >= num_rows || sc[i] == 0.0f || bg[i] < 0 || bg[i] >= num_bags || !mine(row)) continue;
      order[fill[slot_of[row]]++] = static_cast<int32_t>(i);
    }
    std::vector<float> acc(dim);
    for (size_t u = 0; u < unique.size(); ++u) {
      const int64_t row = unique[u];
      if (u + 4 < unique.size()) {  // the row (and its state) four rows ahead
        const char* p = reinterpret_cast<const char*>(t + static_cast<int64_t>(unique[u + 4]) * dim);
        for (int64_t line = 0; line < dim * 4; line += 64) __builtin_prefetch(p, 1), p += 64;
        __builtin_prefetch(s + (rule == 2 ? static_cast<int64_t>(unique[u + 4]) * dim : unique[u + 4]), 1);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int32_t j = start[u]; j < start[u + 1]; ++j) {
        const int64_t i = order[j];
        axpy(acc.data(), g + static_cast<int64_t>(bg[i]) * dim, sc[i], dim);
      }
      float* w = t + row * dim;
      const float* gr = acc.data();
      if (rule == 0) {
        for (int64_t k = 0; k < dim; ++k) w[k] -= lr * gr[k];
      } else if (rule == 1) {
        float sq = 0.0f;
        for (int64_t k = 0; k < dim; ++k) sq += gr[k] * gr[k];
        s[row] += sq / static_cast<float>(dim);
        const float mult = lr / (std::sqrt(s[row]) + eps);
        for (int64_t k = 0; k < dim; ++k) w[k] -= mult * gr[k];
      } else {
        float* sr = s + row * dim;
        for (int64_t k = 0; k < dim; ++k) {
          sr[k] += gr[k] * gr[k];
          w[k] -= lr * gr[k] / (std::sqrt(sr[k]) + eps);
        }
      }
      slot_of[row] = -1;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecPooledSum, PooledSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecFusedUpdate, FusedUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("rule")
                                  .Attr<float>("lr")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecJaggedPooledSum, JaggedPooledSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("stride")
                                  .Attr<int32_t>("clamp")
                                  .Attr<int32_t>("weighted"));
