// Fused CPU kernels for hybridrec's embedding lookups and sparse updates (XLA FFI).
//
// PooledSum:         out[b, :] = sum_l w[b, l] * table[rows[b, l], :]   (w == 0 skips the row)
// JaggedPooledSum:   the same, read straight from a KJT's values / offsets.
// FusedUpdate:       one optimizer step from a (row, bag, scale) id stream and bag_grads.
// JaggedFusedUpdate: the same from a KJT's values / offsets and the pooled gradient read in
//                    place. Both group the ids by row with a parallel radix sort, sum each
//                    row's gradient once and apply the rule in place (table and state are
//                    aliased to the outputs; XLA donates them).
// QuantPooled:       pooled bags of packed (int8 / int4 / int2 / fp16) rows: the served lookup
//                    (also callable without XLA: HybridrecQuantServe, every block of a request).
// All are multi-threaded: bags split over OpenMP threads for the float lookups; for the
// updates the sort passes split the ids, and each thread owns a contiguous range of unique
// rows. The quantized lookup alone splits its bags over XLA's own CPU threads (`SplitBags`),
// not an OpenMP team (see there why).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define HYBRIDREC_QUANT_VECTOR 1  // the quantized lookup's 8-lane path
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

inline void axpy(float* __restrict acc, const float* __restrict row, float w, int64_t d) {
  for (int64_t k = 0; k < d; ++k) acc[k] += w * row[k];
}

// One bag at a time with the accumulator in registers: DIM known at compile time for the
// common widths, a runtime loop otherwise. Rows are prefetched PREFETCH ids ahead, across
// bag boundaries (the id matrix is contiguous).
constexpr int64_t PREFETCH = 16;

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
    const int64_t f = bag / stride, b = bag % stride;  // feature-major: one table's hot rows stay cached
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

// ---- the quantized pooled lookup ----------------------------------------------------------
// Bags of packed rows in FBGEMM's IntN TBE layout (sparse_jax/_quant.py): int8 / int4 / int2
// rows are [fp16 scale | fp16 bias | values, low bits first | padding], fp16 rows
// [fp16 values | padding]; every row is `width` bytes. Bag b is ids[off[b] : off[b + 1]],
// read straight from the packed bytes and dequantized in registers, in bag order:
//   int rows:  acc = (acc + w * bias) + (w * scale) * q     fp16 rows:  acc = acc + w * x
// then MEAN multiplies by fp32(1 / len) (len counts every id, skipped ones too); an empty bag
// is zeros. The `* q` and `* x` products are fused into the add (fma), as FBGEMM's kernel and
// XLA:CPU's compiled XLA form (`_quant._pooled`) both do; `w * bias` and `w * scale` are
// rounded on their own (XLA's form too). Unweighted, every product is exact and the result is
// bit for bit both; weighted, bit for bit the XLA form wherever XLA fused the same product. Ids outside
// [0, num_rows) (-1: FBGEMM's pruned row) are clamped (clamp = 1) or add nothing; a bag reads
// at most max_length ids (< 0: no bound), as the XLA form's static loop does.
// KIND: 8 / 4 / 2 (bits per value), 16 (fp16 rows). Dims 8 .. 128 (powers of two) keep the
// bag's sums in vector registers (PoolFixed: 16 columns a register with AVX-512, 8 with
// AVX2; int4 rows widen 8 or 16 bytes at once and keep even and odd columns apart); any other
// dim, or a build without AVX2 / F16C / FMA, sums in the output row (PoolAny). Prefetches
// are written in the loop itself: a helper function holding only prefetches is judged free
// of effects by GCC and its calls deleted.

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24, exact in fp32
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// `x` rounded to its own value here: a later add cannot contract the product into an fma.
#if defined(__x86_64__) || defined(__i386__)
#define HYBRIDREC_ROUNDED(x) asm("" : "+x"(x))
#elif defined(__aarch64__)
#define HYBRIDREC_ROUNDED(x) asm("" : "+w"(x))
#else
#define HYBRIDREC_ROUNDED(x) asm("" : "+m"(x))
#endif

inline uint16_t LoadU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// Value k of a packed row's values (bytes `v`), as fp32.
template <int KIND>
inline float ValueAt(const uint8_t* v, int64_t k) {
  if (KIND == 16) return HalfToFloat(LoadU16(v + 2 * k));
  constexpr int per_byte = 8 / KIND;
  constexpr unsigned mask = (1u << KIND) - 1u;
  return static_cast<float>((v[k / per_byte] >> ((k % per_byte) * KIND)) & mask);
}

#ifdef HYBRIDREC_QUANT_VECTOR
// Values k .. k + 7 of a packed row (k a multiple of 8), as 8 fp32 lanes.
template <int KIND>
inline __m256 Values8(const uint8_t* v, int64_t k) {
  if (KIND == 16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 2 * k)));
  if (KIND == 8) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + k))));
  // int4: 4 bytes hold the 8 values, int2: 2 bytes; value j is bits j*KIND .. of them
  uint32_t word = 0;
  std::memcpy(&word, v + k * KIND / 8, KIND);
  const __m256i shifts = KIND == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                   : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                                     _mm256_set1_epi32((1 << KIND) - 1));
  return _mm256_cvtepi32_ps(q);
}

// (w * scale, w * bias, 0, 0) of an int row, (w, 0, 0, 0) of an fp16 row: each product
// rounded on its own, as the XLA form does.
template <int KIND, bool WEIGHTED>
inline __m128 RowFactors(const uint8_t* row, const float* w, int64_t i) {
  if (KIND == 16) return _mm_set_ss(WEIGHTED ? w[i] : 1.0f);
  uint32_t head_bits;
  std::memcpy(&head_bits, row, 4);
  __m128 sb = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(head_bits)));  // scale, bias, 0, 0
  if (WEIGHTED) sb = _mm_mul_ps(sb, _mm_set1_ps(w[i]));
  HYBRIDREC_ROUNDED(sb);
  return sb;
}

// A bag's accumulator for a compile-time DIM, in vector registers: add(values, factors)
// applies one row (`acc = fma(w * scale, q, acc + w * bias)`, fp16 rows `fma(w, x, acc)`),
// store writes `acc * scale`.
template <int KIND, int64_t DIM>
struct Acc8 {  // 8 columns a register
  __m256 a[DIM / 8];
  void zero() {
    for (int64_t j = 0; j < DIM / 8; ++j) a[j] = _mm256_setzero_ps();
  }
  void add(const uint8_t* v, __m128 f) {
    const __m256 ws = _mm256_broadcastss_ps(f), wb = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
    for (int64_t j = 0; j < DIM / 8; ++j) {
      a[j] = _mm256_fmadd_ps(ws, Values8<KIND>(v, 8 * j), KIND == 16 ? a[j] : _mm256_add_ps(a[j], wb));
    }
  }
  void store(float* out, float scale) const {
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < DIM / 8; ++j) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(a[j], s));
  }
};

// int4, DIM a multiple of 16: 8 bytes widen to 8 lanes whose low nibbles are values 0, 2, ..,
// 14 and high nibbles 1, 3, .., 15; a[2j] / a[2j + 1] hold the even / odd columns of 16j ..
// 16j + 15, interleaved back when stored (each column: the same operations, same order).
template <int64_t DIM>
struct AccInt4Pairs {
  __m256 a[DIM / 8];
  void zero() {
    for (int64_t j = 0; j < DIM / 8; ++j) a[j] = _mm256_setzero_ps();
  }
  void add(const uint8_t* v, __m128 f) {
    const __m256 ws = _mm256_broadcastss_ps(f), wb = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t j = 0; j < DIM / 16; ++j) {
      const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8 * j)));
      a[2 * j] = _mm256_fmadd_ps(ws, _mm256_cvtepi32_ps(_mm256_and_si256(x, low4)), _mm256_add_ps(a[2 * j], wb));
      a[2 * j + 1] = _mm256_fmadd_ps(ws, _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4)), _mm256_add_ps(a[2 * j + 1], wb));
    }
  }
  void store(float* out, float scale) const {
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < DIM / 16; ++j) {
      const __m256 lo = _mm256_unpacklo_ps(a[2 * j], a[2 * j + 1]);  // columns 0-3 | 8-11
      const __m256 hi = _mm256_unpackhi_ps(a[2 * j], a[2 * j + 1]);  // columns 4-7 | 12-15
      _mm256_storeu_ps(out + 16 * j, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), s));
      _mm256_storeu_ps(out + 16 * j + 8, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), s));
    }
  }
};

#ifdef __AVX512F__
// int8 and fp16 rows, DIM a multiple of 16, on AVX-512: 16 columns a register.
template <int KIND, int64_t DIM>
struct Acc16 {
  __m512 a[DIM / 16];
  void zero() {
    for (int64_t j = 0; j < DIM / 16; ++j) a[j] = _mm512_setzero_ps();
  }
  void add(const uint8_t* v, __m128 f) {
    const __m512 ws = _mm512_broadcastss_ps(f), wb = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
    for (int64_t j = 0; j < DIM / 16; ++j) {
      const __m512 x =
          KIND == 16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32 * j)))
                     : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16 * j))));
      a[j] = _mm512_fmadd_ps(ws, x, KIND == 16 ? a[j] : _mm512_add_ps(a[j], wb));
    }
  }
  void store(float* out, float scale) const {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < DIM / 16; ++j) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(a[j], s));
  }
};

// int4, DIM a multiple of 32, on AVX-512: AccInt4Pairs with 16 bytes (32 columns) a step.
template <int64_t DIM>
struct AccInt4Pairs16 {
  __m512 a[DIM / 16];
  void zero() {
    for (int64_t j = 0; j < DIM / 16; ++j) a[j] = _mm512_setzero_ps();
  }
  void add(const uint8_t* v, __m128 f) {
    const __m512 ws = _mm512_broadcastss_ps(f), wb = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t j = 0; j < DIM / 32; ++j) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16 * j)));
      a[2 * j] = _mm512_fmadd_ps(ws, _mm512_cvtepi32_ps(_mm512_and_si512(x, low4)), _mm512_add_ps(a[2 * j], wb));
      a[2 * j + 1] = _mm512_fmadd_ps(ws, _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)), _mm512_add_ps(a[2 * j + 1], wb));
    }
  }
  void store(float* out, float scale) const {
    const __m512 s = _mm512_set1_ps(scale);
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t j = 0; j < DIM / 32; ++j) {
      _mm512_storeu_ps(out + 32 * j, _mm512_mul_ps(_mm512_permutex2var_ps(a[2 * j], first, a[2 * j + 1]), s));
      _mm512_storeu_ps(out + 32 * j + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a[2 * j], second, a[2 * j + 1]), s));
    }
  }
};
#endif
#endif

#ifndef QUANT_PREFETCH
#define QUANT_PREFETCH 32  // ids ahead (measured: 32 a little faster than 16 or 8 at 1M x 64, L20)
#endif

// ---- the quantized lookup's threads ------------------------------------------------------
// The quantized lookup is what a served model runs, beside torch's dense tower in the same
// process. Where torch was imported first (hybrid.serving's process), torch's bundled
// libgomp is the process's only OpenMP runtime (the kernel library's libgomp.so.1 resolves
// to it; /proc/self/maps shows no other), and a team's idle workers spin for their next
// region (GOMP_SPINCOUNT) on cores that torch's and JAX's threads need: on a loaded 2-core
// machine a lookup's team stalled the call for milliseconds (benchmarks/NOTES.md). So the
// lookup splits its bags over XLA's intra-op thread pool (JAX's own CPU threads, running
// in the process anyway, which block when idle) instead: chunks of 16 bags claimed from a shared
// counter by the calling thread and by helpers scheduled on the pool. The caller works
// until no chunk is left, so a helper the pool starts late (or never: a busy pool) costs
// nothing but its wake-up; a helper that starts after the caller closed the split returns
// without touching the bags. Each bag is pooled whole by one thread, in id order: the
// result is the same bit for bit whoever pools it.

// Ids per helper: one helper for each QUANT_IDS_PER_THREAD ids of the call beyond the first.
#ifndef QUANT_IDS_PER_THREAD
#define QUANT_IDS_PER_THREAD 4096
#endif

// The threads (caller included) for a call that reads `ids` ids, at most `most`.
inline int64_t QuantThreads(int64_t ids, int64_t most) {
  return std::max<int64_t>(1, std::min<int64_t>(std::max<int64_t>(1, most), ids / QUANT_IDS_PER_THREAD + 1));
}

// body(b) for every bag b < bags, over `threads` threads of `pool` (the caller one of them).
template <typename F>
void SplitBags(ffi::ThreadPool* pool, int64_t bags, int64_t threads, const F& body) {
  constexpr int64_t kChunk = 16;
  if (pool == nullptr || threads <= 1 || bags <= kChunk) {
    for (int64_t b = 0; b < bags; ++b) body(b);
    return;
  }
  struct Split {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> state{0};  // kClosed | helpers inside
    std::mutex m;
    std::condition_variable cv;
  };
  constexpr int64_t kClosed = int64_t{1} << 40;
  auto split = std::make_shared<Split>();
  auto chunks = [bags, &body](Split& s) {
    for (int64_t start; (start = s.next.fetch_add(kChunk)) < bags;) {
      const int64_t stop = std::min(bags, start + kChunk);
      for (int64_t b = start; b < stop; ++b) body(b);
    }
  };
  for (int64_t t = 1; t < threads; ++t) {
    pool->Schedule([split, chunks]() {
      Split& s = *split;
      int64_t st = s.state.load();
      do {
        if (st & kClosed) return;  // the caller is done: `body` may be gone
      } while (!s.state.compare_exchange_weak(st, st + 1));
      chunks(s);
      if (s.state.fetch_sub(1) - 1 == kClosed) {
        { std::lock_guard<std::mutex> lock(s.m); }
        s.cv.notify_all();
      }
    });
  }
  chunks(*split);
  Split& s = *split;
  if (s.state.fetch_or(kClosed) != 0) {  // helpers still pooling their last chunk
    std::unique_lock<std::mutex> lock(s.m);
    s.cv.wait(lock, [&s] { return s.state.load() == kClosed; });
  }
}

// Where a quantized lookup's bags run: `threads` threads of `pool` (the caller included).
struct QuantSplit {
  ffi::ThreadPool* pool;
  int64_t threads;
};

struct BagRange {
  int64_t start, end, stop;  // stop: end, or start + max_length
};

inline BagRange BagAt(const int32_t* off, int64_t b, int64_t n_ids, int64_t max_length) {
  const int64_t start = std::min<int64_t>(std::max<int64_t>(off[b], 0), n_ids);
  const int64_t end = std::min<int64_t>(std::max<int64_t>(off[b + 1], start), n_ids);
  return {start, end, max_length >= 0 ? std::min(end, start + max_length) : end};
}

// Every cache line of row ids[i + QUANT_PREFETCH], when there is one inside the table.
#define HYBRIDREC_PREFETCH_ROW(i)                                                  \
  if ((i) + QUANT_PREFETCH < ids_end) {                                           \
    const int64_t ahead = ids[(i) + QUANT_PREFETCH];                              \
    if (ahead >= 0 && ahead < num_rows) {                                         \
      const char* p = reinterpret_cast<const char*>(t + ahead * width);           \
      __builtin_prefetch(p);                                                      \
      for (int64_t line = 64; line < width; line += 64) __builtin_prefetch(p + line); \
      __builtin_prefetch(p + width - 1);                                          \
    }                                                                             \
  }

// The id at i bounded to the table: clamped, or -1 (skip it).
inline int64_t BoundedId(const int32_t* ids, int64_t i, int64_t num_rows, bool clamp) {
  const int64_t id = ids[i];
  if (id >= 0 && id < num_rows) return id;
  if (!clamp) return -1;
  return id < 0 ? 0 : num_rows - 1;
}

inline float MeanScale(bool mean, const BagRange& r) {
  return mean ? 1.0f / static_cast<float>(std::max<int64_t>(r.end - r.start, 1)) : 1.0f;
}

#ifdef HYBRIDREC_QUANT_VECTOR
// A compile-time DIM: the bag's sums stay in the registers of ACC.
template <typename ACC, int KIND, bool WEIGHTED>
void PoolFixed(const uint8_t* t, int64_t num_rows, int64_t width, const int32_t* ids, int64_t n_ids,
               const int32_t* off, int64_t bags, const float* w, float* o, int64_t dim, int64_t ostride, bool clamp, bool mean,
               int64_t max_length, const QuantSplit& split) {
  constexpr int64_t head = KIND == 16 ? 0 : 4;  // fp16 scale and bias in front
  const int64_t ids_end = std::min<int64_t>(std::max<int64_t>(off[bags], 0), n_ids);
  SplitBags(split.pool, bags, split.threads, [&](int64_t b) {
    const BagRange r = BagAt(off, b, n_ids, max_length);
    ACC acc;
    acc.zero();
    for (int64_t i = r.start; i < r.stop; ++i) {
      HYBRIDREC_PREFETCH_ROW(i)
      const int64_t id = BoundedId(ids, i, num_rows, clamp);
      if (id < 0) continue;
      const uint8_t* row = t + id * width;
      acc.add(row + head, RowFactors<KIND, WEIGHTED>(row, w, i));
    }
    acc.store(o + b * ostride, MeanScale(mean, r));
  });
}
#endif

// Any dim: the sums in the output row, 8 columns at a time where it can, then one by one.
template <int KIND, bool WEIGHTED>
void PoolAny(const uint8_t* t, int64_t num_rows, int64_t width, const int32_t* ids, int64_t n_ids,
             const int32_t* off, int64_t bags, const float* w, float* o, int64_t dim, int64_t ostride, bool clamp, bool mean,
             int64_t max_length, const QuantSplit& split) {
  constexpr int64_t head = KIND == 16 ? 0 : 4;
  const int64_t ids_end = std::min<int64_t>(std::max<int64_t>(off[bags], 0), n_ids);
  SplitBags(split.pool, bags, split.threads, [&](int64_t b) {
    const BagRange r = BagAt(off, b, n_ids, max_length);
    float* out = o + b * ostride;
    std::memset(out, 0, sizeof(float) * dim);
    for (int64_t i = r.start; i < r.stop; ++i) {
      HYBRIDREC_PREFETCH_ROW(i)
      const int64_t id = BoundedId(ids, i, num_rows, clamp);
      if (id < 0) continue;
      const uint8_t* row = t + id * width;
      const uint8_t* v = row + head;
      const float wi = WEIGHTED ? w[i] : 1.0f;
      float wb = 0.0f, ws = wi;  // fp16 rows: acc + w * x
      if (KIND != 16) {
        wb = wi * HalfToFloat(LoadU16(row + 2));
        ws = wi * HalfToFloat(LoadU16(row));
        HYBRIDREC_ROUNDED(wb);
        HYBRIDREC_ROUNDED(ws);
      }
      int64_t k = 0;
#ifdef HYBRIDREC_QUANT_VECTOR
      const __m256 vwb = _mm256_set1_ps(wb), vws = _mm256_set1_ps(ws);
      for (; k + 8 <= dim; k += 8) {
        const __m256 a = _mm256_loadu_ps(out + k);
        _mm256_storeu_ps(out + k, _mm256_fmadd_ps(vws, Values8<KIND>(v, k), KIND == 16 ? a : _mm256_add_ps(a, vwb)));
      }
#endif
      for (; k < dim; ++k) out[k] = std::fma(ws, ValueAt<KIND>(v, k), KIND == 16 ? out[k] : out[k] + wb);
    }
    if (mean) {
      const float scale = MeanScale(mean, r);
      for (int64_t k = 0; k < dim; ++k) out[k] *= scale;
    }
  });
}

template <int KIND, bool WEIGHTED>
void PoolQuantDim(const uint8_t* t, int64_t num_rows, int64_t width, const int32_t* ids, int64_t n_ids,
                  const int32_t* off, int64_t bags, const float* w, float* o, int64_t dim, int64_t ostride, bool clamp, bool mean,
                  int64_t max_length, const QuantSplit& split) {
#ifdef HYBRIDREC_QUANT_VECTOR
#ifdef __AVX512F__
#define HYBRIDREC_WIDE(D) (D % 16 == 0 && (KIND == 8 || KIND == 16))
#define HYBRIDREC_ACC(D)                                                                               \
  std::conditional_t<KIND == 4 && D % 32 == 0, AccInt4Pairs16<D>,                                       \
                     std::conditional_t<KIND == 4 && D % 16 == 0, AccInt4Pairs<D>,                        \
                                        std::conditional_t<HYBRIDREC_WIDE(D), Acc16<KIND, D>, Acc8<KIND, D>>>>
#else
#define HYBRIDREC_ACC(D) std::conditional_t<KIND == 4 && D % 16 == 0, AccInt4Pairs<D>, Acc8<KIND, D>>
#endif
#define HYBRIDREC_QUANT(D) \
  PoolFixed<HYBRIDREC_ACC(D), KIND, WEIGHTED>(t, num_rows, width, ids, n_ids, off, bags, w, o, dim, ostride, clamp, mean, max_length, split)
  switch (dim) {
    case 8: HYBRIDREC_QUANT(8); return;
    case 16: HYBRIDREC_QUANT(16); return;
    case 32: HYBRIDREC_QUANT(32); return;
    case 64: HYBRIDREC_QUANT(64); return;
    case 128: HYBRIDREC_QUANT(128); return;
    default: break;
  }
#undef HYBRIDREC_QUANT
#undef HYBRIDREC_ACC
#undef HYBRIDREC_WIDE
#endif
  PoolAny<KIND, WEIGHTED>(t, num_rows, width, ids, n_ids, off, bags, w, o, dim, ostride, clamp, mean, max_length, split);
}

// One pooled lookup of packed rows into out rows `ostride` floats apart (the served lookup's
// column block of `[bags, sum of dims]`, or a `[bags, dim]` output): the FFI handler and
// the direct entry below run this same code, so their results are bit for bit each other's.
void QuantPoolInto(const uint8_t* packed, int64_t num_rows, int64_t width, const int32_t* ids, int64_t n_ids,
                   const int32_t* off, int64_t bags, const float* weights, float* o, int64_t dim, int64_t ostride,
                   int32_t kind, bool weighted, bool clamp, bool mean, int64_t max_length, const QuantSplit& split) {
  if (num_rows == 0) {  // only pruned ids can be asked for: every bag is zeros
    for (int64_t b = 0; b < bags; ++b) std::memset(o + b * ostride, 0, sizeof(float) * dim);
    return;
  }
#define HYBRIDREC_QUANT_KIND(K)                                                                               \
  (weighted ? PoolQuantDim<K, true>(packed, num_rows, width, ids, n_ids, off, bags, weights, o, dim, ostride, \
                                    clamp, mean, max_length, split)                                           \
            : PoolQuantDim<K, false>(packed, num_rows, width, ids, n_ids, off, bags, weights, o, dim, ostride, \
                                     clamp, mean, max_length, split))
  switch (kind) {
    case 8: HYBRIDREC_QUANT_KIND(8); break;
    case 4: HYBRIDREC_QUANT_KIND(4); break;
    case 2: HYBRIDREC_QUANT_KIND(2); break;
    default: HYBRIDREC_QUANT_KIND(16); break;
  }
#undef HYBRIDREC_QUANT_KIND
}

// Why a (kind, dim, width) cannot be pooled, or nullptr.
inline const char* QuantShapeProblem(int64_t kind, int64_t dim, int64_t width) {
  const int64_t need = kind == 16 ? 2 * dim : 4 + dim * kind / 8;
  if ((kind != 16 && kind != 8 && kind != 4 && kind != 2) || width < need || (kind < 8 && dim % (8 / kind))) {
    return "rows too narrow for the dim, or an unknown kind";
  }
  return nullptr;
}

ffi::Error QuantPooledImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::S32> ids,
                           ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::F32> weights,
                           ffi::ResultBuffer<ffi::F32> out, int32_t kind, int32_t weighted, int32_t clamp,
                           int32_t mean, int64_t max_length) {
  const auto pdims = packed.dimensions();
  const auto odims = out->dimensions();
  if (pdims.size() != 2 || odims.size() != 2 || offsets.element_count() != odims[0] + 1) {
    return ffi::Error::InvalidArgument("QuantPooled: packed must be [rows, width], out [bags, dim], offsets [bags + 1]");
  }
  const int64_t num_rows = pdims[0], width = pdims[1], bags = odims[0], dim = odims[1];
  if (QuantShapeProblem(kind, dim, width) != nullptr) {
    return ffi::Error::InvalidArgument("QuantPooled: rows too narrow for the dim, or an unknown kind");
  }
  if (weighted && static_cast<int64_t>(weights.element_count()) != static_cast<int64_t>(ids.element_count())) {
    return ffi::Error::InvalidArgument("QuantPooled: one weight per id");
  }
  // the threads by this call's own ids (its bags' offsets may start anywhere in `ids`)
  const int64_t n_ids = ids.element_count();
  const int32_t* off = offsets.typed_data();
  const int64_t first = std::min<int64_t>(std::max<int64_t>(off[0], 0), n_ids);
  const int64_t last = std::min<int64_t>(std::max<int64_t>(off[bags], first), n_ids);
  const QuantSplit split{&pool, QuantThreads(last - first, pool.num_threads())};
  QuantPoolInto(packed.typed_data(), num_rows, width, ids.typed_data(), n_ids, off, bags, weights.typed_data(),
                out->typed_data(), dim, dim, kind, weighted != 0, clamp != 0, mean != 0, max_length, split);
  return ffi::Error::Success();
}

// ---- the fused update ---------------------------------------------------------------------
// Every id becomes a record: a 64-bit key (row << 32 | record index) and, by record index,
// where its gradient row starts and its scale. A stable LSD radix sort on the row's bits
// (the record index rides along) groups each row's records in their original order; each
// thread then takes a contiguous range of unique rows (ascending: table and state are read
// and written in address order), sums its rows' gradients in registers and applies the rule
// once per row. Summation order is the records' order whatever the thread count, so the
// result is deterministic. Ids that contribute nothing get row `num_rows`: they sort last
// and are never applied. No [rows] or [unique, dim] buffer is built; scratch is 16 bytes
// per id, reused across calls (per calling thread: several devices may call at once).

// Wall-clock nanoseconds of the last update's phases (build records, sort, apply), for the
// benchmarks' breakdown: HybridrecLastUpdatePhases copies them out.
std::atomic<int64_t> g_phase_ns[3];

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void RecordPhases(int64_t t0, int64_t t1, int64_t t2, int64_t t3) {
  g_phase_ns[0].store(t1 - t0);
  g_phase_ns[1].store(t2 - t1);
  g_phase_ns[2].store(t3 - t2);
}

struct Scratch {
  std::vector<uint64_t> keys, tmp;
  std::vector<int32_t> gofs;
  std::vector<float> scale;
  std::vector<int64_t> hist;
  void reserve(int64_t n) {
    if (static_cast<int64_t>(keys.size()) < n) {
      keys.resize(n);
      tmp.resize(n);
      gofs.resize(n);
      scale.resize(n);
    }
  }
};

Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

int ThreadsFor(int64_t work) {
  const int64_t most = std::max(1, omp_get_max_threads());
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(most, work / 16384 + 1)));
}

inline uint32_t RowOf(uint64_t key) { return static_cast<uint32_t>(key >> 32); }

// Sorts keys[0, n) by RowOf (rows in [0, max_row]); returns the buffer holding the result.
uint64_t* SortByRow(uint64_t* keys, uint64_t* tmp, int64_t n, uint64_t max_row, int threads,
                    std::vector<int64_t>& hist) {
  const int bits = 64 - __builtin_clzll(max_row | 1);
  const int passes = (bits + 10) / 11;
  const int digit = (bits + passes - 1) / passes;
  const int64_t bins = int64_t{1} << digit;
  const uint64_t mask = static_cast<uint64_t>(bins - 1);
  hist.assign(static_cast<size_t>(threads) * bins, 0);
  uint64_t* src = keys;
  uint64_t* dst = tmp;
  for (int p = 0; p < passes; ++p) {
    const int shift = 32 + p * digit;
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t lo = n * tid / nt, hi = n * (tid + 1) / nt;
      int64_t* h = hist.data() + tid * bins;
      std::fill(h, h + bins, 0);
      for (int64_t i = lo; i < hi; ++i) ++h[(src[i] >> shift) & mask];
#pragma omp barrier
#pragma omp single
      {
        int64_t running = 0;
        for (int64_t d = 0; d < bins; ++d) {
          for (int t = 0; t < nt; ++t) {
            const int64_t c = hist[t * bins + d];
            hist[t * bins + d] = running;
            running += c;
          }
        }
      }
      for (int64_t i = lo; i < hi; ++i) dst[h[(src[i] >> shift) & mask]++] = src[i];
    }
    std::swap(src, dst);
  }
  return src;
}

// The first record at or after k that starts a new row (so thread ranges split between rows).
inline int64_t RunStart(const uint64_t* keys, int64_t n, int64_t k) {
  if (k <= 0) return 0;
  while (k < n && RowOf(keys[k]) == RowOf(keys[k - 1])) ++k;
  return k;
}

// Rule 0 = sgd, 1 = rowwise adagrad (state [rows]), 2 = adagrad (state [rows, dim]).
template <int64_t DIM>
void ApplySorted(const uint64_t* keys, int64_t n, uint32_t num_rows, const float* grad,
                 const int32_t* gofs, int64_t gmul, const float* scale, float* t, float* s,
                 int64_t dim, int rule, float lr, float eps, int threads) {
  const int64_t d = DIM > 0 ? DIM : dim;
  constexpr int64_t AHEAD = 8;  // records whose gradient row is prefetched
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = RunStart(keys, n, n * tid / nt), hi = RunStart(keys, n, n * (tid + 1) / nt);
    float acc_fixed[DIM > 0 ? DIM : 1];
    std::vector<float> acc_dyn(DIM > 0 ? 0 : d);
    float* acc = DIM > 0 ? acc_fixed : acc_dyn.data();
    int64_t i = lo;
    while (i < hi) {
      const uint32_t row = RowOf(keys[i]);
      if (row >= num_rows) break;  // ids that contribute nothing sort last
      for (int64_t k = 0; k < d; ++k) acc[k] = 0.0f;
      int64_t j = i;
      for (; j < hi && RowOf(keys[j]) == row; ++j) {
        if (j + AHEAD < hi) {
          const uint32_t ahead = static_cast<uint32_t>(keys[j + AHEAD]);
          const char* p = reinterpret_cast<const char*>(grad + static_cast<int64_t>(gofs[ahead]) * gmul);
          for (int64_t line = 0; line < d * 4; line += 64) __builtin_prefetch(p + line);
        }
        const uint32_t rec = static_cast<uint32_t>(keys[j]);
        const float a = scale[rec];
        const float* g = grad + static_cast<int64_t>(gofs[rec]) * gmul;
        for (int64_t k = 0; k < d; ++k) acc[k] += a * g[k];
      }
      if (j < hi) {  // the next row, and its state
        const int64_t next = RowOf(keys[j]);
        if (next < num_rows) {
          const char* p = reinterpret_cast<const char*>(t + next * d);
          for (int64_t line = 0; line < d * 4; line += 64) __builtin_prefetch(p + line, 1);
          if (rule == 1) __builtin_prefetch(s + next, 1);
        }
      }
      float* w = t + static_cast<int64_t>(row) * d;
      if (rule == 0) {
        for (int64_t k = 0; k < d; ++k) w[k] -= lr * acc[k];
      } else if (rule == 1) {
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 lanes: the sum vectorises
        int64_t k = 0;
        for (; k + 8 <= d; k += 8) {
          for (int q = 0; q < 8; ++q) part[q] += acc[k + q] * acc[k + q];
        }
        float sq = 0.0f;
        for (; k < d; ++k) sq += acc[k] * acc[k];
        sq += ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
        s[row] += sq / static_cast<float>(d);
        const float mult = lr / (std::sqrt(s[row]) + eps);
        for (k = 0; k < d; ++k) w[k] -= mult * acc[k];
      } else {
        float* sr = s + static_cast<int64_t>(row) * d;
        for (int64_t k = 0; k < d; ++k) {
          sr[k] += acc[k] * acc[k];
          w[k] -= lr * acc[k] / (std::sqrt(sr[k]) + eps);
        }
      }
      i = j;
    }
  }
}

void Apply(const uint64_t* keys, int64_t n, uint32_t num_rows, const float* grad, const int32_t* gofs,
           int64_t gmul, const float* scale, float* t, float* s, int64_t dim, int rule, float lr,
           float eps, int threads) {
#define HYBRIDREC_APPLY(D) ApplySorted<D>(keys, n, num_rows, grad, gofs, gmul, scale, t, s, dim, rule, lr, eps, threads)
  switch (dim) {
    case 8: HYBRIDREC_APPLY(8); break;
    case 16: HYBRIDREC_APPLY(16); break;
    case 32: HYBRIDREC_APPLY(32); break;
    case 64: HYBRIDREC_APPLY(64); break;
    case 128: HYBRIDREC_APPLY(128); break;
    default: HYBRIDREC_APPLY(0); break;
  }
#undef HYBRIDREC_APPLY
}

ffi::Error CheckUpdateBuffers(const ffi::Buffer<ffi::F32>& table, const ffi::Buffer<ffi::F32>& state,
                              int32_t rule) {
  if (table.dimensions().size() != 2) return ffi::Error::InvalidArgument("FusedUpdate: table must be [rows, dim]");
  const int64_t rows = table.dimensions()[0], dim = table.dimensions()[1];
  if (rows >= (int64_t{1} << 31)) return ffi::Error::InvalidArgument("FusedUpdate: more than 2^31 - 1 rows");
  const int64_t want = rule == 1 ? rows : rule == 2 ? rows * dim : -1;
  if (want >= 0 && static_cast<int64_t>(state.element_count()) != want) {
    return ffi::Error::InvalidArgument("FusedUpdate: optimizer state does not match the table");
  }
  return ffi::Error::Success();
}

void CopyInputs(const ffi::Buffer<ffi::F32>& table, const ffi::Buffer<ffi::F32>& state, float* t, float* s) {
  if (t != table.typed_data()) std::memcpy(t, table.typed_data(), table.size_bytes());
  if (s != state.typed_data()) std::memcpy(s, state.typed_data(), state.size_bytes());
}

// The id stream form: per id its row, bag (a row of bag_grads [bags, dim]) and scale.
ffi::Error FusedUpdateImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> state,
                           ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> bags,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bag_grads,
                           ffi::ResultBuffer<ffi::F32> table_out,
                           ffi::ResultBuffer<ffi::F32> state_out, int32_t rule, float lr,
                           float eps) {
  if (auto err = CheckUpdateBuffers(table, state, rule); err.failure()) return err;
  const int64_t num_rows = table.dimensions()[0], dim = table.dimensions()[1];
  const int64_t n = rows.element_count();
  const int64_t num_bags = bag_grads.dimensions()[0];
  float* t = table_out->typed_data();
  float* s = state_out->typed_data();
  CopyInputs(table, state, t, s);
  const int32_t* r = rows.typed_data();
  const int32_t* bg = bags.typed_data();
  const float* sc = scale.typed_data();
  Scratch& x = scratch();
  x.reserve(n);
  const int threads = ThreadsFor(n);
  uint64_t* keys = x.keys.data();
  const int64_t t0 = NowNs();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = r[i];
    const bool ok = row >= 0 && row < num_rows && bg[i] >= 0 && bg[i] < num_bags && sc[i] != 0.0f;
    keys[i] = (static_cast<uint64_t>(ok ? row : num_rows) << 32) | static_cast<uint64_t>(i);
  }
  const int64_t t1 = NowNs();
  const uint64_t* sorted = SortByRow(keys, x.tmp.data(), n, num_rows, threads, x.hist);
  const int64_t t2 = NowNs();
  Apply(sorted, n, static_cast<uint32_t>(num_rows), bag_grads.typed_data(), bg, dim, sc, t, s, dim, rule, lr,
        eps, threads);
  RecordPhases(t0, t1, t2, NowNs());
  return ffi::Error::Success();
}

// The jagged form: ids straight from a KJT's values / offsets (as JaggedPooledSum reads
// them) and the pooled gradient [stride, total_dim] read in place: feature f's gradient
// for sample b starts at b * total_dim + col_off[f]. Ids outside the table are clamped
// (clamp = 1) or contribute nothing; mean[f] divides by the bag's length.
ffi::Error JaggedFusedUpdateImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> state,
                                 ffi::Buffer<ffi::S32> values, ffi::Buffer<ffi::S32> offsets,
                                 ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> key,
                                 ffi::Buffer<ffi::S32> row_off, ffi::Buffer<ffi::S32> nrows,
                                 ffi::Buffer<ffi::S32> mean, ffi::Buffer<ffi::S32> col_off,
                                 ffi::Buffer<ffi::F32> grad, ffi::ResultBuffer<ffi::F32> table_out,
                                 ffi::ResultBuffer<ffi::F32> state_out, int64_t stride, int32_t clamp,
                                 int32_t weighted, int32_t rule, float lr, float eps) {
  if (auto err = CheckUpdateBuffers(table, state, rule); err.failure()) return err;
  const int64_t num_rows = table.dimensions()[0], dim = table.dimensions()[1];
  if (grad.dimensions().size() != 2 || grad.dimensions()[0] != stride) {
    return ffi::Error::InvalidArgument("JaggedFusedUpdate: the pooled gradient must be [stride, total_dim]");
  }
  const int64_t total_dim = grad.dimensions()[1];
  if (stride * total_dim >= (int64_t{1} << 31)) {
    return ffi::Error::InvalidArgument("JaggedFusedUpdate: pooled gradient has 2^31 or more elements");
  }
  float* t = table_out->typed_data();
  float* s = state_out->typed_data();
  CopyInputs(table, state, t, s);
  const int64_t features = key.element_count();
  const int32_t* v = values.typed_data();
  const int32_t* off = offsets.typed_data();
  const float* w = weights.typed_data();
  const int32_t *k = key.typed_data(), *ro = row_off.typed_data(), *nr = nrows.typed_data();
  const int32_t *mn = mean.typed_data(), *co = col_off.typed_data();
  std::vector<int64_t> base(features + 1, 0);  // first record of each feature
  for (int64_t f = 0; f < features; ++f) {
    base[f + 1] = base[f] + (off[(static_cast<int64_t>(k[f]) + 1) * stride] - off[static_cast<int64_t>(k[f]) * stride]);
  }
  const int64_t n = base[features];
  Scratch& x = scratch();
  x.reserve(n);
  const int threads = ThreadsFor(n);
  uint64_t* keys = x.keys.data();
  int32_t* gofs = x.gofs.data();
  float* sc = x.scale.data();
  const int64_t t0 = NowNs();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t bag = 0; bag < features * stride; ++bag) {
    const int64_t f = bag / stride, b = bag % stride;  // feature-major: records are written in order
    const int64_t first = off[static_cast<int64_t>(k[f]) * stride];
    const int64_t seg = static_cast<int64_t>(k[f]) * stride + b;
    const int64_t start = off[seg], end = off[seg + 1];
    const int64_t rows_f = nr[f];
    const float len = static_cast<float>(end - start);
    const int32_t g0 = static_cast<int32_t>(b * total_dim + co[f]);
    for (int64_t i = start; i < end; ++i) {
      const int64_t rec = base[f] + (i - first);
      int64_t id = v[i];
      bool ok = true;
      if (id < 0 || id >= rows_f) {
        if (clamp) {
          id = id < 0 ? 0 : rows_f - 1;
        } else {
          ok = false;
        }
      }
      const float a = weighted ? w[i] : 1.0f;
      keys[rec] = (static_cast<uint64_t>(ok ? id + ro[f] : num_rows) << 32) | static_cast<uint64_t>(rec);
      gofs[rec] = g0;
      sc[rec] = mn[f] ? a / len : a;
    }
  }
  const int64_t t1 = NowNs();
  const uint64_t* sorted = SortByRow(keys, x.tmp.data(), n, num_rows, threads, x.hist);
  const int64_t t2 = NowNs();
  Apply(sorted, n, static_cast<uint32_t>(num_rows), grad.typed_data(), gofs, 1, sc, t, s, dim, rule, lr, eps,
        threads);
  RecordPhases(t0, t1, t2, NowNs());
  return ffi::Error::Success();
}

}  // namespace

extern "C" void HybridrecLastUpdatePhases(int64_t* out) {
  for (int i = 0; i < 3; ++i) out[i] = g_phase_ns[i].load();
}

// The served lookup without XLA (`hybrid.serving`'s direct lookup, called through ctypes):
// every output block of an artifact's lookup program in one call, each block pooled by the
// same code as the FFI handler (`QuantPoolInto`), so the scores are bit for bit the
// program's. `plan` holds kQuantPlanFields int64 per block: the packed table's address, its
// rows, its row bytes, kind, dim, first output column, feature index, clamp, mean, weighted.
// Block k pools feature f's bags `offsets[f * rung : f * rung + bags + 1]` (feature-major
// offsets of `n_offsets` = features * rung + 1 entries, as the program takes them) into the
// columns [col, col + dim) of `bags` output rows `out_stride` floats apart. A request of
// more than QUANT_SERVE_SPLIT_IDS ids pools its later blocks on one helper thread (started
// per call: ~40 us here, which a smaller request does not win back).
// Returns 0, or k + 1 for the first block whose plan or bags do not fit (nothing written).
constexpr int64_t kQuantPlanFields = 10;
#ifndef QUANT_SERVE_SPLIT_IDS
#define QUANT_SERVE_SPLIT_IDS 16384
#endif

extern "C" int64_t HybridrecQuantServe(const int64_t* plan, int64_t blocks, const int32_t* ids, int64_t n_ids,
                                       const int32_t* offsets, int64_t n_offsets, int64_t rung, int64_t bags,
                                       const float* weights, float* out, int64_t out_stride) {
  std::vector<int64_t> count(blocks);
  int64_t total = 0;
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t* p = plan + k * kQuantPlanFields;
    const int64_t kind = p[3], dim = p[4], col = p[5], f = p[6];
    if (p[0] == 0 || p[1] < 0 || QuantShapeProblem(kind, dim, p[2]) != nullptr || col < 0 ||
        col + dim > out_stride || f < 0 || bags < 0 || bags > rung || (f + 1) * rung + 1 > n_offsets ||
        (p[9] != 0 && weights == nullptr)) {
      return k + 1;
    }
    const int32_t* off = offsets + f * rung;
    const int64_t first = std::min<int64_t>(std::max<int64_t>(off[0], 0), n_ids);
    count[k] = std::min<int64_t>(std::max<int64_t>(off[bags], first), n_ids) - first;
    total += count[k];
  }
  const QuantSplit serial{nullptr, 1};
  auto pool = [&](int64_t from, int64_t to) {
    for (int64_t k = from; k < to; ++k) {
      const int64_t* p = plan + k * kQuantPlanFields;
      QuantPoolInto(reinterpret_cast<const uint8_t*>(p[0]), p[1], p[2], ids, n_ids, offsets + p[6] * rung, bags,
                    weights, out + p[5], p[4], out_stride, static_cast<int32_t>(p[3]), p[9] != 0, p[7] != 0,
                    p[8] != 0, -1, serial);
    }
  };
  int64_t split = blocks;  // blocks [split, blocks) go to the helper: about half the ids
  if (total > QUANT_SERVE_SPLIT_IDS && blocks > 1) {
    int64_t before = 0;
    for (split = 0; split < blocks - 1 && 2 * (before + count[split]) <= total; ++split) before += count[split];
    split = std::max<int64_t>(split, 1);
  }
  if (split == blocks) {
    pool(0, blocks);
    return 0;
  }
  std::thread helper(pool, split, blocks);
  pool(0, split);
  helper.join();
  return 0;
}

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecJaggedFusedUpdate, JaggedFusedUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("stride")
                                  .Attr<int32_t>("clamp")
                                  .Attr<int32_t>("weighted")
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecQuantPooled, QuantPooledImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("weighted")
                                  .Attr<int32_t>("clamp")
                                  .Attr<int32_t>("mean")
                                  .Attr<int64_t>("max_length"));
