// The quantized weights' products with int8 activations (kernels/quant.py: `round_activations`):
// every activation row is rounded to int8 per block of kActBlock values along k, Q8_0's rule
// with an fp32 scale,
//
//   d = max |x_block| / 127,   q = round_half_even(x * (127 / max |x_block|))   (0 for a zero block),
//
// and the GEMV sums integer dot products: per block, the 32 products of int8 (or int4) weights
// and int8 activations summed exactly in int32 lanes (simd.h's `dot`: AVX2 maddubs/madd, VNNI
// vpdpbusd, NEON sdot, or the scalar body: the same integers), converted to fp32 and
// multiplied by the block's activation scale (int4: times the group's weight scale) into 8
// fp32 lanes with one fused multiply-add per block (1, 2 or 4 chains of blocks by row count),
// the chains and lanes then summed in simd.h's fixed order; an int8 row's sum is then scaled by
// its row scale. So the product equals the dequantized weights times the rounded activations
// up to fp32 summation order, and is bit-identical at every ISA level. The tiled integer GEMM
// past 8 rows (qgemm.h) rounds the activations the same way and sums the same integers and
// scales block by block; the routed experts' GEMM (gemm.h) multiplies the rounded values
// (`round_rows`) in fp32.
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
  if (n == kActBlock) return simd::quantize32(x, q) / 127.f;
  float amax = 0.f;
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

// acc[m][c] += (the integer dot of block b's weights `wv` with row m's block) * s[m * ld + b].
template <int M>
inline void block_step(simd::f8 (&acc)[M][kChains<M>], int c, simd::b32 wv, const int8_t* q,
                       int64_t K, const float* s, int64_t ld, int64_t b) {
  for (int m = 0; m < M; ++m) {
    const simd::i32x8 d = simd::dot(wv, simd::load32(q + m * K + b * kActBlock));
    acc[m][c] = simd::fma(simd::to_float(d), simd::bcast8(s[m * ld + b]), acc[m][c]);
  }
}

// sum[m] = the sum of row m's chains, lane by lane, then across the lanes.
template <int M>
inline void sum_chains(simd::f8 (&acc)[M][kChains<M>], float* sum) {
  for (int m = 0; m < M; ++m) {
    simd::f8 t = acc[m][0];
    for (int c = 1; c < kChains<M>; ++c) t = simd::add(t, acc[m][c]);
    sum[m] = simd::hsum(t);
  }
}

template <int M>
inline void zero_chains(simd::f8 (&acc)[M][kChains<M>]) {
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < kChains<M>; ++c) acc[m][c] = simd::zero8();
}

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
    constexpr int C = kChains<M>;
    simd::f8 acc[M][C];
    zero_chains<M>(acc);
    auto wblock = [&](int64_t i) { return simd::load32(wr + i * kActBlock); };
    for (; b + C <= full; b += C)
      for (int c = 0; c < C; ++c) block_step<M>(acc, c, wblock(b + c), q, K, d, B, b + c);
    for (; b < full; ++b) block_step<M>(acc, 0, wblock(b), q, K, d, B, b);
    sum_chains<M>(acc, sum);
    if (b < B) {  // a last block shorter than 32
      const int64_t k0 = b * kActBlock, len = K - k0;
      for (int m = 0; m < M; ++m)
        sum[m] = simd::fma1(float(dot_tail(wr + k0, q + m * K + k0, len)), d[m * B + b], sum[m]);
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
    const auto* sc = reinterpret_cast<const c10::BFloat16*>(wr + K / 2);
    fetch_ahead(wr, stride);
    for (int64_t g = 0; g < G; ++g) scale[g] = load1(sc + g);  // vectorised by the compiler
    for (int m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) sd[m * G + g] = scale[g] * d[m * G + g];
    float sum[M] = {};
    constexpr int C = kChains<M>;
    simd::f8 acc[M][C];
    zero_chains<M>(acc);
    auto wblock = [&](int64_t g) { return simd::q4_unpack(wr + g * kQ4Group / 2); };
    int64_t g = 0;
    for (; g + C <= G; g += C)
      for (int c = 0; c < C; ++c) block_step<M>(acc, c, wblock(g + c), q, K, sd.data(), G, g + c);
    for (; g < G; ++g) block_step<M>(acc, 0, wblock(g), q, K, sd.data(), G, g);
    sum_chains<M>(acc, sum);
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
