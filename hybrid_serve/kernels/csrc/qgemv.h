// The quantized weights' products with int8 activations (kernels/quant.py: `round_activations`):
// every activation row is rounded to int8 per block of kActBlock values along k, Q8_0's rule
// with an fp32 scale,
//
//   d = max |x_block| / 127,   q = round_half_even(x * (127 / max |x_block|))   (0 for a zero block),
//
// and the GEMV sums integer dot products: per block, the 32 products of int8 (or int4) weights
// and int8 activations summed exactly in int32 (simd.h's `q8x8_dot` and `q4x8_dot`: AVX2
// maddubs/madd, VNNI vpdpbusd, NEON sdot, or the scalar body: the same integers), both formats
// a tile of 8 weight rows (weights.h) at a time, one fp32 lane per weight row: per
// block the 8 rows' exact dots (`q8x8_dot`; int4 `q4x8_dot`, started at -8 x the block's
// activation sum for the nibbles' offset), converted to fp32 and summed in k order with one
// fused multiply-add by the activation scale (int4: the weight scale times the activation
// scale): y = r_n ((I_0 s_0 + 0) + I_1 s_1 + ...), r_n the int8 row scale (int4: 1), the tiled
// GEMM's sum (qgemm.h) exactly, so a row's result is the same bits in the GEMV and in the GEMM.
// An int8 matrix's short last block (K % 32) is one more such step. The rows past the last tile
// take the same steps one at a time.
// Every row of activations is summed so whatever the row count (a verify row equals the same
// row decoded alone). So the product equals the dequantized weights times the rounded
// activations up to fp32 summation order, and is bit-identical at every ISA level
// (`test_cpu_levels.py`). The routed experts' GEMM (gemm.h) multiplies the rounded values
// (`round_rows`) in fp32.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "simd.h"
#include "weights.h"

namespace hs {

constexpr int64_t kActBlock = 32;

inline int64_t act_blocks(int64_t K) { return (K + kActBlock - 1) / kActBlock; }

// Rows of activations rounded to int8, block-major so that one block of every row lies
// together and a pass reaches row m's block at a fixed offset (32 m bytes) from one pointer:
// q [blocks][M][kActBlock] (a short last block's bytes past K zero), its scales d and sums of q
// [blocks][M].
struct QuantActs {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sums;
  int64_t M = 0, K = 0, blocks = 0;

  const int8_t* block(int64_t m, int64_t b) const { return q.data() + (b * M + m) * kActBlock; }
  float scale(int64_t m, int64_t b) const { return d[b * M + m]; }
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
  out.M = M;
  out.K = K;
  out.blocks = act_blocks(K);
  out.q.assign(out.blocks * M * kActBlock, 0);
  out.d.resize(M * out.blocks);
  out.sums.resize(M * out.blocks);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < out.blocks; ++b) {
      const int64_t k0 = b * kActBlock, n = std::min(kActBlock, K - k0);
      int8_t* q = out.q.data() + (b * M + m) * kActBlock;
      out.d[b * M + m] = quantize_block(x + m * K + k0, n, q);
      int32_t sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += q[i];
      out.sums[b * M + m] = sum;
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

// y[m, n] for the tiles of int8 weight rows [n0, n1) (multiples of kTile, n1 <= the tiled rows)
// and M <= kQPassRows rounded activation rows: each block's 256 bytes loaded once for all M rows
// (`q8x8_load`) and fetched kFetchAhead ahead; a short last block (K % 32 columns, row by row
// in the tile) summed a row at a time; the 8 row scales one load.
template <int M>
void qgemv_tiles_q8(const QuantActs& xa, int64_t m0, const int8_t* w, float* y, int64_t N,
                    int64_t n0, int64_t n1) {
  const int64_t K = xa.K, R = xa.M, full = K / kActBlock, t = K - full * kActBlock;
  const int64_t S = row_stride<int8_t>(K);
  for (int64_t n = n0; n < n1; n += kTile) {
    const int8_t* tile = w + n * S;
    simd::f8 acc[M];  // registers: the row loops unrolled (GCC keeps 16 rows in memory otherwise)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m] = simd::zero8();
    const int8_t* q = xa.block(m0, 0);  // block b's rows from q + b R kActBlock on
    const float* d = xa.d.data() + m0;
    const int32_t* sums = xa.sums.data() + m0;
    for (int64_t b = 0; b < full; ++b, q += R * kActBlock, d += R, sums += R) {
      const int8_t* blk = tile + b * kQ8Block;
      for (int64_t i = 0; i < kQ8Block; i += 64) simd::prefetch(blk + kFetchAhead + i);
      const simd::q8x8 wq = simd::q8x8_load(blk);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const simd::i32x8 dot = simd::q8x8_dot(wq, sums[m], q + m * kActBlock);
        acc[m] = simd::fma(simd::to_float(dot), simd::bcast8(d[m]), acc[m]);
      }
    }
    if (t > 0) {  // the short last block
      const int8_t* rest = tile + full * kQ8Block;
      for (int m = 0; m < M; ++m) {
        float dots[kTile];
        for (int64_t r = 0; r < kTile; ++r)
          dots[r] = float(dot_tail(rest + r * t, xa.block(m0 + m, full), t));
        acc[m] = simd::fma(simd::load8(dots), simd::bcast8(xa.scale(m0 + m, full)), acc[m]);
      }
    }
    const simd::f8 scale = simd::load8(reinterpret_cast<const float*>(tile + kTile * K));
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) simd::store8(y + m * N + n, simd::mul(acc[m], scale));
  }
}

// y[m, n] for the int8 rows [n0, n1) past the tiles and all M rows: the same integers and steps
// as a tile's lane, a row at a time.
inline void qgemv_tail_q8(const QuantActs& xa, int64_t M, const int8_t* w, float* y, int64_t N,
                          int64_t n0, int64_t n1) {
  const int64_t K = xa.K, B = xa.blocks, S = row_stride<int8_t>(K);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * S;
    const float scale = q8_row_scale(w, N, K, n);
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t k0 = b * kActBlock, len = std::min(kActBlock, K - k0);
        const int32_t dot = dot_tail(row + k0, xa.block(m, b), len);
        sum = simd::fma1(float(dot), xa.scale(m, b), sum);
      }
      y[m * N + n] = sum * scale;
    }
  }
}

// y[m, n] for the tiles of int4 weight rows [n0, n1) (multiples of kTile, n1 <= the tiled
// rows) and M <= kQPassRows rounded activation rows: each block's nibbles unpacked once for all
// M rows, its 8 scales one load, its bytes fetched kFetchAhead ahead.
template <int M>
void qgemv_tiles_q4(const QuantActs& xa, int64_t m0, const uint8_t* w, float* y, int64_t N,
                    int64_t n0, int64_t n1) {
  static_assert(kQ4Group == kActBlock, "an int4 group is one activation block");
  const int64_t K = xa.K, G = xa.blocks, R = xa.M, S = row_stride<uint8_t>(K);
  for (int64_t n = n0; n < n1; n += kTile) {
    const uint8_t* tile = w + n * S;
    simd::f8 acc[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m] = simd::zero8();
    const int8_t* q = xa.block(m0, 0);  // group g's rows from q + g R kActBlock on
    const float* d = xa.d.data() + m0;
    const int32_t* sums = xa.sums.data() + m0;
    for (int64_t g = 0; g < G; ++g, q += R * kActBlock, d += R, sums += R) {
      const uint8_t* blk = tile + g * kQ4Block;
      for (int64_t b = 0; b < kQ4Block; b += 64) simd::prefetch(blk + kFetchAhead + b);
      const simd::q4x8 wq = simd::q4x8_unpack(blk);
      const simd::f8 ws = simd::load8_bf16(reinterpret_cast<const c10::BFloat16*>(blk + 128));
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const simd::i32x8 dot = simd::q4x8_dot(wq, -8 * sums[m], q + m * kActBlock);
        acc[m] = simd::fma(simd::to_float(dot), simd::mul(ws, simd::bcast8(d[m])), acc[m]);
      }
    }
#pragma GCC unroll 16
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
        const int8_t* a = xa.block(m, g);
        int32_t dot = 0;
        for (int64_t j = 0; j < kQ4Group / 2; ++j)
          dot += (int32_t(nib[j] & 15) - 8) * a[j] + (int32_t(nib[j] >> 4) - 8) * a[j + 16];
        sum = simd::fma1(float(dot), scale * xa.scale(m, g), sum);
      }
      y[m * N + n] = sum;
    }
}

// Weight rows per block of the quantized GEMV (about 16 KB, in whole tiles).
template <typename W>
inline int64_t qblock_rows(int64_t K) {
  return (block_rows(K, 1) + kTile - 1) / kTile * kTile;
}

// Rows of x per pass over a block of weight rows: a pass holds one block of a tile (a q8x8 or
// q4x8: 8 registers of 256 bits) and one 8-lane accumulator per row. With AVX-512's 32
// registers 16 rows fit, so up to 16 rows read each weight block once, from memory; with 16
// registers (AVX2, and NEON, whose block takes 16 of its 32) 4 rows, further passes finding the
// block in L1/L2. The sums do not depend on the pass (each row's lanes are its own).
constexpr int kQPassRows = simd::kLanes >= 16 ? 16 : 4;
// The integer GEMV's rows (decode_ops.h's `gemv_rows`), the tiled GEMM (qgemm.h) beyond,
// measured on Zen 4 (one thread, weights streamed, benchmarks.quant_linear's shapes):
// - where a pass holds 16 rows (AVX-512), up to 64: the GEMV ran 2x the GEMM at 9-17 rows,
//   1.25x at 64 and still at 256 with VNNI, 1.1-2.5x at 9-64 without; the prefill chunks
//   beyond keep the GEMM, whose activations are rounded in parallel;
// - with AVX2 (8 lanes, passes of 4), up to 16: 1.2-2.6x at 9-16 rows, even at 32, the GEMM
//   ahead for int8 at 64;
// - NEON (not measured): decode_ops.h's kGemvRows, 8.
constexpr int64_t kQGemvRows = kQPassRows >= 16 ? 64 : simd::kLanes == 8 ? 16 : 8;

template <int M>
inline void qgemv_pass(const QuantActs& xa, int64_t m0, const int8_t* w, float* y, int64_t N,
                       int64_t n0, int64_t n1) {
  qgemv_tiles_q8<M>(xa, m0, w, y, N, n0, n1);
}
template <int M>
inline void qgemv_pass(const QuantActs& xa, int64_t m0, const uint8_t* w, float* y, int64_t N,
                       int64_t n0, int64_t n1) {
  qgemv_tiles_q4<M>(xa, m0, w, y, N, n0, n1);
}

inline void qgemv_tail(const QuantActs& xa, int64_t M, const int8_t* w, float* y, int64_t N,
                       int64_t n0, int64_t n1) {
  qgemv_tail_q8(xa, M, w, y, N, n0, n1);
}
inline void qgemv_tail(const QuantActs& xa, int64_t M, const uint8_t* w, float* y, int64_t N,
                       int64_t n0, int64_t n1) {
  qgemv_tail_q4(xa, M, w, y, N, n0, n1);
}

// qgemv_pass<rows> for rows in [1, kQPassRows] (Ms: 0, 1, ..., kQPassRows - 1).
template <typename W, int... Ms>
inline void qgemv_pass_rows(int rows, std::integer_sequence<int, Ms...>, const QuantActs& xa,
                            int64_t m0, const W* w, float* y, int64_t N, int64_t n0, int64_t n1) {
  using Pass = void (*)(const QuantActs&, int64_t, const W*, float*, int64_t, int64_t, int64_t);
  static constexpr Pass passes[] = {static_cast<Pass>(&qgemv_pass<Ms + 1>)...};
  passes[rows - 1](xa, m0, w, y, N, n0, n1);
}

// skinny_range (gemv.h) for quantized weights: rows [n0, n1) in blocks (`qblock_rows`; n0 a
// multiple of kTile), the tiles' rows of x kQPassRows at a time, the rows past the tiles last.
template <typename W>
void qskinny_range(int64_t M, const QuantActs& xa, const W* w, float* y, int64_t N, int64_t n0,
                   int64_t n1) {
  const int64_t nb = qblock_rows<W>(xa.K);
  const int64_t last = std::min(n1, tiled_rows(N));  // the rows the passes take: the tiles'

  for (int64_t b0 = n0; b0 < last; b0 += nb) {
    const int64_t b1 = std::min(last, b0 + nb);
    for (int64_t m0 = 0; m0 < M; m0 += kQPassRows) {
      const int rows = int(std::min<int64_t>(kQPassRows, M - m0));
      qgemv_pass_rows<W>(rows, std::make_integer_sequence<int, kQPassRows>{}, xa, m0, w,
                         y + m0 * N, N, b0, b1);
    }
  }
  if (n1 > last) qgemv_tail(xa, M, w, y, N, std::max(n0, last), n1);
}

}  // namespace hs
