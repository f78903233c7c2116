// The quantized weights' products with int8 activations (kernels/quant.py: `round_activations`):
// every activation row is rounded to int8 per block of kActBlock values along k, Q8_0's rule
// with an fp32 scale,
//
//   d = max |x_block| / 127,   q = round_half_even(x * (127 / max |x_block|))   (0 for a zero block),
//
// and the GEMV sums integer dot products: per block, the 32 products of int8 (or int4) weights
// and int8 activations summed exactly in int32 (simd.h's `dot` and `q4x8_dot`: AVX2
// maddubs/madd, VNNI vpdpbusd, NEON sdot, or the scalar body: the same integers).
// - int8: each block's int32 lanes converted to fp32 and multiplied by the block's activation
//   scale into 8 fp32 lanes with one fused multiply-add per block, in two chains: even blocks
//   and odd blocks, a pair per step (`f8x2`: one 512-bit register at the AVX-512 levels); then
//   the two chains added, a last odd block, the lanes in simd.h's fixed order; the row's sum
//   then scaled by its row scale.
// - int4: a tile of 8 weight rows (weights.h) at a time, one fp32 lane per weight row: per
//   block the 8 rows' exact dots (`q4x8_dot`, started at -8 x the block's activation sum for
//   the nibbles' offset), converted to fp32 and summed in k order with one fused multiply-add
//   by the weight scale times the activation scale: y = (I_0 s_0 + 0) + I_1 s_1 + ..., the
//   tiled GEMM's sum (qgemm.h) exactly, so an int4 row's result is the same bits in the GEMV
//   and in the GEMM. The rows past the last tile take the same steps one at a time.
// Every row of activations is summed so whatever the row count (a verify row equals the same
// row decoded alone). So the product equals the dequantized weights times the rounded
// activations up to fp32 summation order, and is bit-identical at every ISA level
// (`test_cpu_levels.py`). The tiled integer GEMM past 8 rows (qgemm.h) rounds the activations
// the same way and sums the same integers and scales block by block; the routed experts' GEMM
// (gemm.h) multiplies the rounded values (`round_rows`) in fp32.
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

// Rows of activations rounded to int8: q [M, K] (row stride K), d [M, act_blocks(K)] and each
// block's sum of q (sums, alike).
struct QuantActs {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sums;
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
  out.sums.resize(M * out.blocks);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < out.blocks; ++b) {
      const int64_t k0 = b * kActBlock, n = std::min(kActBlock, K - k0);
      int8_t* q = out.q.data() + m * K + k0;
      out.d[m * out.blocks + b] = quantize_block(x + m * K + k0, n, q);
      int32_t sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += q[i];
      out.sums[m * out.blocks + b] = sum;
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

// y[m, n] for the tiles of int4 weight rows [n0, n1) (multiples of kQ4Tile, n1 <= the tiled
// rows) and M <= kPassRows rounded activation rows: each block's nibbles unpacked once for all
// M rows, its 8 scales one load, its bytes fetched kFetchAhead ahead.
template <int M>
void qgemv_tiles_q4(const QuantActs& xa, int64_t m0, const uint8_t* w, float* y, int64_t N,
                    int64_t n0, int64_t n1) {
  static_assert(kQ4Group == kActBlock, "an int4 group is one activation block");
  const int64_t K = xa.K, G = xa.blocks, S = row_stride<uint8_t>(K);
  const int8_t* q = xa.q.data() + m0 * K;
  const float* d = xa.d.data() + m0 * G;
  const int32_t* sums = xa.sums.data() + m0 * G;
  for (int64_t n = n0; n < n1; n += kQ4Tile) {
    const uint8_t* tile = w + n * S;
    simd::f8 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = simd::zero8();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* blk = tile + g * kQ4Block;
      for (int64_t b = 0; b < kQ4Block; b += 64) simd::prefetch(blk + kFetchAhead + b);
      const simd::q4x8 wq = simd::q4x8_unpack(blk);
      const simd::f8 ws = simd::load8_bf16(reinterpret_cast<const c10::BFloat16*>(blk + 128));
      for (int m = 0; m < M; ++m) {
        const simd::i32x8 dot = simd::q4x8_dot(wq, -8 * sums[m * G + g], q + m * K + g * kActBlock);
        acc[m] = simd::fma(simd::to_float(dot), simd::mul(ws, simd::bcast8(d[m * G + g])), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) simd::store8(y + m * N + n, acc[m]);
  }
}

// y[m, n] for the int4 rows [n0, n1) past the tiles and all M rows: the same integers and steps
// as a tile's lane, a row at a time.
inline void qgemv_tail_q4(const QuantActs& xa, int64_t M, const uint8_t* w, float* y, int64_t N,
                          int64_t n0, int64_t n1) {
  const int64_t K = xa.K, G = xa.blocks;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        uint8_t nib[kQ4Group / 2];
        const float scale = q4_group(w, N, K, n, g, nib);
        const int8_t* a = xa.q.data() + m * K + g * kActBlock;
        int32_t dot = 0;
        for (int64_t j = 0; j < kQ4Group / 2; ++j)
          dot += (int32_t(nib[j] & 15) - 8) * a[j] + (int32_t(nib[j] >> 4) - 8) * a[j + 16];
        sum = simd::fma1(float(dot), scale * xa.d[m * G + g], sum);
      }
      y[m * N + n] = sum;
    }
}

// Weight rows per block of the quantized GEMV (about 16 KB; int4 in whole tiles).
template <typename W>
inline int64_t qblock_rows(int64_t K) {
  const int64_t nb = block_rows(K, 1);
  if constexpr (std::is_same_v<W, uint8_t>) return (nb + kQ4Tile - 1) / kQ4Tile * kQ4Tile;
  return nb;
}

template <int M>
inline void qgemv_pass(const QuantActs& xa, int64_t m0, const int8_t* w, float* y, int64_t N,
                       int64_t n0, int64_t n1) {
  qgemv_rows_i8<M>(xa, m0, w, y, N, n0, n1);
}
template <int M>
inline void qgemv_pass(const QuantActs& xa, int64_t m0, const uint8_t* w, float* y, int64_t N,
                       int64_t n0, int64_t n1) {
  qgemv_tiles_q4<M>(xa, m0, w, y, N, n0, n1);
}

// skinny_range (gemv.h) for quantized weights: rows [n0, n1) in blocks (`qblock_rows`; int4:
// n0 a multiple of kQ4Tile), rows of x kPassRows at a time; int4's rows past the tiles last.
template <typename W>
void qskinny_range(int64_t M, const QuantActs& xa, const W* w, float* y, int64_t N, int64_t n0,
                   int64_t n1) {
  const int64_t nb = qblock_rows<W>(xa.K);
  int64_t last = n1;  // the rows the passes take: int4's tiles only
  if constexpr (std::is_same_v<W, uint8_t>) last = std::min(n1, q4_tiled_rows(N));
  for (int64_t b0 = n0; b0 < last; b0 += nb) {
    const int64_t b1 = std::min(last, b0 + nb);
    for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
      float* ym = y + m0 * N;
      switch (std::min(kPassRows, M - m0)) {
        case 1: qgemv_pass<1>(xa, m0, w, ym, N, b0, b1); break;
        case 2: qgemv_pass<2>(xa, m0, w, ym, N, b0, b1); break;
        case 3: qgemv_pass<3>(xa, m0, w, ym, N, b0, b1); break;
        default: qgemv_pass<4>(xa, m0, w, ym, N, b0, b1);
      }
    }
  }
  if constexpr (std::is_same_v<W, uint8_t>)
    if (n1 > last) qgemv_tail_q4(xa, M, w, y, N, std::max(n0, last), n1);
}

}  // namespace hs
