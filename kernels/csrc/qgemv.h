// The quantized weights' products with int8 activations (kernels/quant.py: `round_activations`):
// every activation row is rounded to int8 per block of kActBlock values along k, Q8_0's rule
// with an fp32 scale,
//
//   d = max |x_block| / 127,   q = round_half_even(x * (127 / max |x_block|))   (0 for a zero block),
//
// and the GEMV sums integer dot products: per block, the 32 products of int8 (or int4) weights
// and int8 activations summed exactly in int32 (AVX2: `maddubs` of |w| and sign(w) * q, pairs of
// at most 2 * 127 * 127 < 2^15, then `madd` with ones), converted to fp32 and scaled by the
// block's activation scale (int4: times the group's weight scale), the blocks summed in fp32;
// an int8 row's sum is then scaled by its row scale. So the product equals the dequantized
// weights times the rounded activations up to fp32 summation order. Larger products (gemm.cpp)
// round the activations the same way (`round_rows`) and multiply their fp32 values.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "weights.h"

namespace hs {

constexpr int64_t kActBlock = 32;

inline int64_t act_blocks(int64_t K) { return (K + kActBlock - 1) / kActBlock; }

// Rows of activations rounded to int8: q [M, K] (row stride K) and d [M, act_blocks(K)].
struct QuantActs {
  std::vector<int8_t> q;
  std::vector<float> d;
  int64_t K = 0, blocks = 0;
};

// n <= kActBlock values x -> q[0..n) and the block's scale (the rule above).
inline float quantize_block(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
#ifdef HS_AVX2
  if (n == kActBlock) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    amax = _mm_cvtss_f32(h);
    const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i r[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 s = _mm256_round_ps(_mm256_mul_ps(v[i], id),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r[i] = _mm256_cvtps_epi32(s);
    }
    // packs interleave the 128-bit lanes: 0-3 8-11 4-7 12-15 | 16-19 24-27 20-23 28-31 as
    // dwords of 4 bytes; one dword permutation restores the order
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                         _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return amax / 127.f;
  }
#endif
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));
  return amax / 127.f;
}

// x [M, K] -> its rounded rows.
inline void quantize_rows(const float* x, int64_t M, int64_t K, QuantActs& out) {
  out.K = K;
  out.blocks = act_blocks(K);
  out.q.resize(M * K);
  out.d.resize(M * out.blocks);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < out.blocks; ++b) {
      const int64_t k0 = b * kActBlock;
      out.d[m * out.blocks + b] = quantize_block(x + m * K + k0, std::min(kActBlock, K - k0),
                                                 out.q.data() + m * K + k0);
    }
}

// x [M, K] -> y [M, K], each row's values after rounding (q * d), as the tiled GEMM takes them.
inline void round_rows(const float* x, int64_t M, int64_t K, float* y) {
  int8_t q[kActBlock];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += kActBlock) {
      const int64_t n = std::min(kActBlock, K - k0);
      const float d = quantize_block(x + m * K + k0, n, q);
      for (int64_t i = 0; i < n; ++i) y[m * K + k0 + i] = float(q[i]) * d;
    }
}

#ifdef HS_AVX2
// The 8 int32 partial sums of the 32 products w[i] * a[i] (bytes), exact.
inline __m256i dot32(__m256i w_abs, __m256i w, __m256i a) {
  const __m256i p16 = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a, w));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
#endif

// The exact integer dot product of n bytes.
template <typename A>
inline int32_t dot_tail(const A* w, const int8_t* a, int64_t n) {
  int32_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += int32_t(w[i]) * int32_t(a[i]);
  return s;
}

// Independent sums per row of x: one FMA chain per row would stall a lone row on the FMA's
// latency (one block per 4-5 cycles), so 1 and 2 rows take 4 and 2 chains over alternate blocks.
template <int M>
constexpr int kChains = M == 1 ? 4 : M == 2 ? 2 : 1;

#ifdef HS_AVX2
// The 32 weights of an int4 group as bytes -8..7, elements in order.
inline __m256i q4_group(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(8));
}

// acc[m][c] += (the integer dot of block b's weights `wv` with row m's block) * s[m * ld + b].
template <int M>
inline void block_step(__m256 (&acc)[M][kChains<M>], int c, __m256i wv, const int8_t* q,
                       int64_t K, const float* s, int64_t ld, int64_t b) {
  const __m256i wa = _mm256_sign_epi8(wv, wv);
  for (int m = 0; m < M; ++m) {
    const __m256i av =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * K + b * kActBlock));
    acc[m][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(wa, wv, av)),
                                _mm256_set1_ps(s[m * ld + b]), acc[m][c]);
  }
}

template <int M>
inline void sum_chains(__m256 (&acc)[M][kChains<M>], float* sum) {
  for (int m = 0; m < M; ++m) {
    __m256 t = acc[m][0];
    for (int c = 1; c < kChains<M>; ++c) t = _mm256_add_ps(t, acc[m][c]);
    sum[m] = simd::hsum8(t);
  }
}
#endif

// y[m, n] for rows [n0, n1) of int8 weights and M <= 8 rounded activation rows.
template <int M>
void qgemv_rows_i8(const QuantActs& xa, int64_t m0, const int8_t* w, float* y, int64_t N,
                   int64_t n0, int64_t n1) {
  const int64_t K = xa.K, B = xa.blocks, full = K / kActBlock, stride = row_stride<int8_t>(K);
  const int8_t* q = xa.q.data() + m0 * K;
  const float* d = xa.d.data() + m0 * B;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * stride;
    fetch_ahead(wr, K);
    float sum[M] = {};
    int64_t b = 0;
#ifdef HS_AVX2
    constexpr int C = kChains<M>;
    __m256 acc[M][C];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
    auto wblock = [&](int64_t i) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + i * kActBlock));
    };
    for (; b + C <= full; b += C)
      for (int c = 0; c < C; ++c) block_step<M>(acc, c, wblock(b + c), q, K, d, B, b + c);
    for (; b < full; ++b) block_step<M>(acc, 0, wblock(b), q, K, d, B, b);
    sum_chains<M>(acc, sum);
#endif
    for (; b < B; ++b) {  // the scalar build's blocks, and a last block shorter than 32
      const int64_t k0 = b * kActBlock, len = std::min(kActBlock, K - k0);
      for (int m = 0; m < M; ++m)
        sum[m] += float(dot_tail(wr + k0, q + m * K + k0, len)) * d[m * B + b];
    }
    const float scale = row_scale(wr, K);
    for (int m = 0; m < M; ++m) y[m * N + n] = sum[m] * scale;
  }
}

// y[m, n] for rows [n0, n1) of int4 weights (groups of kQ4Group = kActBlock) and M <= 8 rows.
template <int M>
void qgemv_rows_q4(const QuantActs& xa, int64_t m0, const uint8_t* w, float* y, int64_t N,
                   int64_t n0, int64_t n1) {
  static_assert(kQ4Group == kActBlock, "an int4 group is one activation block");
  const int64_t K = xa.K, G = xa.blocks, stride = row_stride<uint8_t>(K);
  const int8_t* q = xa.q.data() + m0 * K;
  const float* d = xa.d.data() + m0 * G;
  std::vector<float> scale(G), sd(M * G);  // a row's scales; each block's scale by row of x
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * stride;
    const auto* sc = reinterpret_cast<const at::BFloat16*>(wr + K / 2);
    fetch_ahead(wr, stride);
    for (int64_t g = 0; g < G; ++g) scale[g] = load1(sc + g);  // vectorised by the compiler
    for (int m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) sd[m * G + g] = scale[g] * d[m * G + g];
    float sum[M] = {};
#ifdef HS_AVX2
    constexpr int C = kChains<M>;
    __m256 acc[M][C];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + C <= G; g += C)
      for (int c = 0; c < C; ++c)
        block_step<M>(acc, c, q4_group(wr + (g + c) * kQ4Group / 2), q, K, sd.data(), G, g + c);
    for (; g < G; ++g) block_step<M>(acc, 0, q4_group(wr + g * kQ4Group / 2), q, K, sd.data(), G, g);
    sum_chains<M>(acc, sum);
#else
    for (int64_t g = 0; g < G; ++g) {
      int8_t wq[kQ4Group];
      for (int64_t j = 0; j < kQ4Group / 2; ++j) {
        const uint8_t byte = wr[g * kQ4Group / 2 + j];
        wq[j] = int8_t(int(byte & 15) - 8);
        wq[j + kQ4Group / 2] = int8_t(int(byte >> 4) - 8);
      }
      for (int m = 0; m < M; ++m)
        sum[m] += float(dot_tail(wq, q + m * K + g * kQ4Group, kQ4Group)) * sd[m * G + g];
    }
#endif
    for (int m = 0; m < M; ++m) y[m * N + n] = sum[m];
  }
}

template <typename W, int M>
inline void qgemv_any(const QuantActs& xa, int64_t m0, const W* w, float* y, int64_t N,
                      int64_t n0, int64_t n1) {
  if constexpr (std::is_same_v<W, uint8_t>) {
    qgemv_rows_q4<M>(xa, m0, w, y, N, n0, n1);
  } else {
    qgemv_rows_i8<M>(xa, m0, w, y, N, n0, n1);
  }
}

// skinny_range (gemv.h) for quantized weights: rows [n0, n1) in blocks, rows of x in eights.
template <typename W>
void qskinny_range(int64_t M, const QuantActs& xa, const W* w, float* y, int64_t N, int64_t n0,
                   int64_t n1) {
  const int64_t nb = block_rows(xa.K, 1);
  for (int64_t b0 = n0; b0 < n1; b0 += nb) {
    const int64_t b1 = std::min(n1, b0 + nb);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      float* ym = y + m0 * N;
      switch (std::min<int64_t>(8, M - m0)) {
        case 1: qgemv_any<W, 1>(xa, m0, w, ym, N, b0, b1); break;
        case 2: qgemv_any<W, 2>(xa, m0, w, ym, N, b0, b1); break;
        case 3: qgemv_any<W, 3>(xa, m0, w, ym, N, b0, b1); break;
        case 4: qgemv_any<W, 4>(xa, m0, w, ym, N, b0, b1); break;
        case 5: qgemv_any<W, 5>(xa, m0, w, ym, N, b0, b1); break;
        case 6: qgemv_any<W, 6>(xa, m0, w, ym, N, b0, b1); break;
        case 7: qgemv_any<W, 7>(xa, m0, w, ym, N, b0, b1); break;
        default: qgemv_any<W, 8>(xa, m0, w, ym, N, b0, b1);
      }
    }
  }
}

}  // namespace hs
