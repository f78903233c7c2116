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
// fp32 lanes with one fused multiply-add per block, in two chains: even blocks and odd blocks,
// a pair per step (`f8x2`: one 512-bit register at the AVX-512 levels); then the two chains
// added, a last odd block, the lanes in simd.h's fixed order; an int8 row's sum is then scaled
// by its row scale. Every row of activations is summed so whatever the row count (a verify
// row equals the same row decoded alone). So the product equals the dequantized weights times
// the rounded activations up to fp32 summation order, and is bit-identical at every ISA level
// (`test_cpu_levels.py`). The tiled integer GEMM
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

// acc[m] += the integer dots of the block pair `wv` (blocks b and b + 1) with row m's blocks,
// times their scales s[m * ld + b] and s[m * ld + b + 1] (even blocks in the first f8, odd in
// the second).
template <int M>
inline void pair_step(simd::f8x2 (&acc)[M], simd::b32x2 wv, const int8_t* q, int64_t K,
                      const float* s, int64_t ld, int64_t b) {
  for (int m = 0; m < M; ++m) {
    const simd::i32x8x2 d = simd::dot(wv, simd::load64(q + m * K + b * kActBlock));
    acc[m] = simd::fma(simd::to_float(d), simd::bcast8x2(s + m * ld + b), acc[m]);
  }
}

// sum[m] = row m's two chains added, then (with `last`: the weights of whole block b, an odd
// one out) that block's scaled dot, then the lanes.
template <int M>
inline void fold_rows(const simd::f8x2 (&acc)[M], const simd::b32* last, const int8_t* q,
                      int64_t K, const float* s, int64_t ld, int64_t b, float* sum) {
  for (int m = 0; m < M; ++m) {
    simd::f8 t = simd::fold(acc[m]);
    if (last != nullptr) {
      const simd::i32x8 d = simd::dot(*last, simd::load32(q + m * K + b * kActBlock));
      t = simd::fma(simd::to_float(d), simd::bcast8(s[m * ld + b]), t);
    }
    sum[m] = simd::hsum(t);
  }
}

// y[m, n] for rows [n0, n1) of int8 weights and M <= kPassRows rounded activation rows.
template <int M>
void qgemv_rows_i8(const QuantActs& xa, int64_t m0, const int8_t* w, float* y, int64_t N,
                   int64_t n0, int64_t n1) {
  const int64_t K = xa.K, B = xa.blocks, full = K / kActBlock, stride = row_stride<int8_t>(K);
  const int8_t* q = xa.q.data() + m0 * K;
  const float* d = xa.d.data() + m0 * B;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * stride;
    fetch_ahead(wr, K);
    simd::f8x2 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = simd::zero8x2();
    int64_t b = 0;
    for (; b + 2 <= full; b += 2)
      pair_step<M>(acc, simd::load64(wr + b * kActBlock), q, K, d, B, b);
    float sum[M];
    if (b < full) {
      const simd::b32 last = simd::load32(wr + b * kActBlock);
      fold_rows<M>(acc, &last, q, K, d, B, b, sum);
      ++b;
    } else {
      fold_rows<M>(acc, nullptr, q, K, d, B, b, sum);
    }
    if (b < B) {  // a last block shorter than 32
      const int64_t k0 = b * kActBlock, len = K - k0;
      for (int m = 0; m < M; ++m)
        sum[m] = simd::fma1(float(dot_tail(wr + k0, q + m * K + k0, len)), d[m * B + b], sum[m]);
    }
    const float scale = row_scale(wr, K);
    for (int m = 0; m < M; ++m) y[m * N + n] = sum[m] * scale;
  }
}

// pair_step for int4: the pair's stored nibbles u (0..15) against the activations in one
// unsigned dot seeded with c = -8 x each lane's 4 activations (`nibble_offsets`): lane by lane
// the same integers as the signed dot of the nibbles - 8, without the sign trick.
template <int M>
inline void q4_pair_step(simd::f8x2 (&acc)[M], simd::b32x2 u, const int8_t* q,
                         const int32_t* c, int64_t K, const float* s, int64_t ld, int64_t g) {
  for (int m = 0; m < M; ++m) {
    const simd::i32x8x2 seed = simd::load_i32x8x2(c + m * (K / 4) + g * (kQ4Group / 4));
    const simd::i32x8x2 d = simd::dotu_add(seed, u, simd::load64(q + m * K + g * kActBlock));
    acc[m] = simd::fma(simd::to_float(d), simd::bcast8x2(s + m * ld + g), acc[m]);
  }
}

// c[m * K / 4 + j] = -8 x (the sum of row m's activations 4j..4j+3): the int4 offset's share of
// each dot lane.
inline std::vector<int32_t> nibble_offsets(const int8_t* q, int64_t M, int64_t K) {
  std::vector<int32_t> c(M * K / 4);
  for (int64_t i = 0; i < M * K / 4; ++i)
    c[i] = -8 * (int32_t(q[4 * i]) + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
  return c;
}

// y[m, n] for rows [n0, n1) of int4 weights (groups of kQ4Group = kActBlock) and
// M <= kPassRows rows.
template <int M>
void qgemv_rows_q4(const QuantActs& xa, const int32_t* offsets, int64_t m0, const uint8_t* w,
                   float* y, int64_t N, int64_t n0, int64_t n1) {
  static_assert(kQ4Group == kActBlock, "an int4 group is one activation block");
  const int64_t K = xa.K, G = xa.blocks, stride = row_stride<uint8_t>(K);
  const int8_t* q = xa.q.data() + m0 * K;
  const float* d = xa.d.data() + m0 * G;
  std::vector<float> scale(G), sd(M * G);  // a row's scales; each block's scale by row of x
  const int32_t* c = offsets + m0 * (K / 4);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * stride;
    const auto* sc = reinterpret_cast<const c10::BFloat16*>(wr + K / 2);
    fetch_ahead(wr, stride);
    for (int64_t g = 0; g < G; ++g) scale[g] = load1(sc + g);  // vectorised by the compiler
    for (int m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) sd[m * G + g] = scale[g] * d[m * G + g];
    simd::f8x2 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = simd::zero8x2();
    auto nibbles = [&](int64_t g) { return simd::q4_nibbles(wr + g * kQ4Group / 2); };
    int64_t g = 0;
    for (; g + 2 <= G; g += 2)
      q4_pair_step<M>(acc, simd::join(nibbles(g), nibbles(g + 1)), q, c, K, sd.data(), G, g);
    float sum[M];
    if (g < G) {
      const simd::b32 last = simd::q4_unpack(wr + g * kQ4Group / 2);
      fold_rows<M>(acc, &last, q, K, sd.data(), G, g, sum);
    } else {
      fold_rows<M>(acc, nullptr, q, K, sd.data(), G, g, sum);
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = sum[m];
  }
}

template <typename W, int M>
inline void qgemv_any(const QuantActs& xa, const int32_t* offsets, int64_t m0, const W* w,
                      float* y, int64_t N, int64_t n0, int64_t n1) {
  if constexpr (std::is_same_v<W, uint8_t>) {
    qgemv_rows_q4<M>(xa, offsets, m0, w, y, N, n0, n1);
  } else {
    qgemv_rows_i8<M>(xa, m0, w, y, N, n0, n1);
  }
}

// skinny_range (gemv.h) for quantized weights: rows [n0, n1) in blocks, rows of x kPassRows at
// a time.
template <typename W>
void qskinny_range(int64_t M, const QuantActs& xa, const W* w, float* y, int64_t N, int64_t n0,
                   int64_t n1) {
  const int64_t nb = block_rows(xa.K, 1);
  std::vector<int32_t> offsets;  // int4: the nibbles' -8, once per call
  if constexpr (std::is_same_v<W, uint8_t>) offsets = nibble_offsets(xa.q.data(), M, xa.K);
  const int32_t* c = offsets.data();
  for (int64_t b0 = n0; b0 < n1; b0 += nb) {
    const int64_t b1 = std::min(n1, b0 + nb);
    for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
      float* ym = y + m0 * N;
      switch (std::min(kPassRows, M - m0)) {
        case 1: qgemv_any<W, 1>(xa, c, m0, w, ym, N, b0, b1); break;
        case 2: qgemv_any<W, 2>(xa, c, m0, w, ym, N, b0, b1); break;
        case 3: qgemv_any<W, 3>(xa, c, m0, w, ym, N, b0, b1); break;
        default: qgemv_any<W, 4>(xa, c, m0, w, ym, N, b0, b1);
      }
    }
  }
}

}  // namespace hs
