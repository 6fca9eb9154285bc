// The DLRM interaction of a served dense tower, without torch (hybrid.serving calls it through
// ctypes, `hybrid/serving/_interaction.py`): TorchRec's `InteractionArch` forward,
// `[dense, upper triangle of the pairwise dots of (dense, f_1, ..., f_F)]`, one sample at a
// time with its F + 1 vectors in L1, instead of torch's concatenation, a batched matmul of
// [F + 1, D] blocks (MKL's per-matrix overhead: 0.25 ms for 512 samples of 9 x 64 on one
// thread here), its flattening and the gather of the triangle.
//
// HybridrecInteraction: sample b's vectors are v_0 = dense[b] and v_f = sparse[b, f - 1]
// (f = 1..F, `dim` floats each, contiguous in the sample's row); its output row holds
// v_0's `dim` values, then dot(v_i, v_j) for i < j, row-major (i = 0: j = 1..F, then i = 1,
// ...): `dim + F (F + 1) / 2` floats. Rows are `*_stride` floats apart. A dot sums in fp32,
// 16 lanes at a time where the compiler targets AVX-512 (else 8 partial sums), the lanes
// added in a fixed order: the same sample gives the same row in any batch. Returns 0, or 1
// when the sizes do not fit (nothing written).
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

inline float Dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
  if (k < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - k)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + k), _mm512_maskz_loadu_ps(tail, b + k), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int l = 0; l < 8; ++l) lane[l] += a[k + l] * b[k + l];
  for (int l = 0; k < n; ++k, ++l) lane[l] += a[k] * b[k];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
#endif
}

}  // namespace

extern "C" int64_t HybridrecInteraction(const float* dense, int64_t dense_stride, const float* sparse,
                                        int64_t sparse_stride, int64_t batch, int64_t features, int64_t dim,
                                        float* out, int64_t out_stride) {
  const int64_t pairs = features * (features + 1) / 2;
  if (batch < 0 || features < 0 || features >= 1024 || dim < 1 || dense_stride < dim ||
      sparse_stride < features * dim || out_stride < dim + pairs) {
    return 1;
  }
  const int64_t n = features + 1;
  const float* v[1024];  // the sample's vectors (F + 1 <= 1024: checked above)
  for (int64_t b = 0; b < batch; ++b) {
    v[0] = dense + b * dense_stride;
    for (int64_t f = 1; f < n; ++f) v[f] = sparse + b * sparse_stride + (f - 1) * dim;
    float* row = out + b * out_stride;
    std::memcpy(row, v[0], sizeof(float) * dim);
    float* dots = row + dim;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = i + 1; j < n; ++j) *dots++ = Dot(v[i], v[j], dim);
  }
  return 0;
}
