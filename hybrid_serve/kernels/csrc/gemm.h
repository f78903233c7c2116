// The tiled GEMM for the decode batches above the GEMV's 8 rows and prefill; linear_ops.cpp
// holds its torch op (the routed experts run the GEMV at every size: routed_experts.cpp).
//
// y[m, n] = sum_k x[m, k] w[n, k]: fp32 activations, fp32, bf16, int8 or int4 weights (weights.h's
// formats), fp32 accumulation. `gemm_into` sends int8 and int4 matrices to the integer GEMM
// (qgemm.h); here fp32 and bf16 ones run, bf16 blocks widened to fp32 once an m block spans PC
// panels.
// The weight keeps its [N, K] row-major layout (no packed copy). x is packed once per call into
// panels of MR = 2 vectors of rows (8 with NEON, 16 with AVX2, 32 with AVX-512: simd.h), k-major
// ([panel][k][MR], rows past M zero), so a register tile is an outer product: each k step loads
// one panel row (two vectors) and broadcasts NR = 6 weights (bf16 two at a time, widened exactly
// in registers), 12 FMAs into 12 accumulators that hold a 6 x MR block of y^T (a last panel of at
// most one vector of rows takes half of it). Blocking: KC columns of k at a time (a panel's block
// stays in L1; at 8 lanes or fewer a lone panel takes whole rows), NC weight rows stay in L2 while every
// panel of an m block passes over them, and on the first panel's pass each tile prefetches the
// next tile's weights. Threads split the weight rows (at::parallel_for; nested inside another
// parallel region it runs on the calling thread). Every output is the same blocked fp32 sum in
// k order (`tile`), whatever M, the vector width and the rows beside it, so a row's result does
// not depend on its batch, nor on the ISA level (simd.h: each step one rounding).
// `benchmarks/gemm_shapes.py` times it beside MKL by row count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "qgemm.h"
#include "simd.h"
#include "weights.h"

namespace hs::tiled {


constexpr int MR = 2 * hs::simd::kLanes;  // rows of x per packed panel
constexpr int NR = 6;         // weight rows per register tile
constexpr int64_t KC = 256;   // k per cache block
constexpr int64_t NC = 48;    // weight rows per cache block (a multiple of NR)
constexpr int64_t PC = 4;     // panels per m block

template <typename W>
constexpr bool is_quantized = std::is_same_v<W, int8_t> || std::is_same_v<W, uint8_t>;

// x [M, K] (row stride ldx) -> xp [ceil(M / MR)][K][MR], rows past M zero.
inline void pack_panels(const float* x, int64_t ldx, int64_t M, int64_t K, float* xp) {
  for (int64_t p = 0; p * MR < M; ++p) {
    const int64_t rows = std::min<int64_t>(MR, M - p * MR);
    float* dst = xp + p * K * MR;
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t l = 0; l < rows; ++l) dst[k * MR + l] = x[(p * MR + l) * ldx + k];
      for (int64_t l = rows; l < MR; ++l) dst[k * MR + l] = 0.f;
    }
  }
}

inline int64_t panels(int64_t M) { return (M + MR - 1) / MR; }

// Room for P packed panels of K columns, left uninitialised (pack_panels writes every element).
inline std::unique_ptr<float[]> panel_buffer(int64_t P, int64_t K) {
  return std::unique_ptr<float[]>(new float[P * K * MR]);
}

using hs::simd::vec;
// acc[i][:] += w[i * ldw + k] * x, the weights broadcast: fp32 one at a time, bf16 in pairs (one
// 4-byte broadcast holds w[k] and w[k + 1], each widened exactly by a shift or a mask).
template <typename W, int R, int J>
inline void tile_steps(vec (&acc)[R][J], const W* w, int64_t ldw, const float* xp, int64_t k0,
                       int64_t k1) {
  namespace v = hs::simd;
  int64_t k = k0;
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    for (; k + 2 <= k1; k += 2) {
      vec xa[J];
      for (int j = 0; j < J; ++j) xa[j] = v::load(xp + k * MR + j * v::kLanes);
      for (int i = 0; i < R; ++i) {
        vec b0, b1;
        v::bcast_pair(w + i * ldw + k, b0, b1);
        for (int j = 0; j < J; ++j) acc[i][j] = v::fma(b0, xa[j], acc[i][j]);
        for (int j = 0; j < J; ++j)
          acc[i][j] = v::fma(b1, v::load(xp + (k + 1) * MR + j * v::kLanes), acc[i][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (; k < k1; ++k) {
    vec xv[J];
    for (int j = 0; j < J; ++j) xv[j] = v::load(xp + k * MR + j * v::kLanes);
    for (int i = 0; i < R; ++i) {
      const vec b = v::bcast(hs::load1(w + i * ldw + k));
      for (int j = 0; j < J; ++j) acc[i][j] = v::fma(b, xv[j], acc[i][j]);
    }
  }
}

// c [R][MR] (+)= w [R rows, stride ldw][kn] times the panel block xp [kn][MR]; `first` starts
// the sums at zero, otherwise they go on from c. Each run of KR k steps is summed from zero in
// registers and then added to c: a blocked sum, whose round-off grows like sqrt(KR) +
// sqrt(K / KR) instead of a plain k loop's sqrt(K). `next` (or null) is the weight block of the
// tile that runs after this one, fetched into cache meanwhile: runs of 1 KB per weight row are
// too short for the hardware prefetcher.
constexpr int64_t KR = 32;
template <typename W, int R, int J>
inline void tile(const W* w, int64_t ldw, const float* xp, int64_t kn, float* c, bool first,
                 const W* next) {
  for (int64_t k0 = 0; k0 < kn; k0 += KR) {
    const int64_t k1 = std::min(kn, k0 + KR);
    const bool start = first && k0 == 0;
    namespace v = hs::simd;
    vec acc[R][J];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < J; ++j) acc[i][j] = v::zero();
    if (next != nullptr)  // about one cache line per row per 16 k
      for (int i = 0; i < NR; ++i)
        for (int64_t k = k0; k < k1; k += 16) v::prefetch(next + i * ldw + k);
    tile_steps<W, R, J>(acc, w, ldw, xp, k0, k1);
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < J; ++j) {
        float* cp = c + i * MR + j * v::kLanes;
        v::store(cp, start ? acc[i][j] : v::add(v::load(cp), acc[i][j]));
      }
  }
}

// A tile of r <= NR weight rows by one panel's first kLanes * J rows of x (J = 1: a last panel
// of at most kLanes rows, half the work of a whole one).
template <typename W, int J>
inline void tile_rows(int r, const W* w, int64_t ldw, const float* xp, int64_t kn, float* c,
                      bool first, const W* next) {
  static_assert(NR == 6, "tile_rows lists the row counts 1..NR");
  switch (r) {
    case 6: return tile<W, 6, J>(w, ldw, xp, kn, c, first, next);
    case 5: return tile<W, 5, J>(w, ldw, xp, kn, c, first, next);
    case 4: return tile<W, 4, J>(w, ldw, xp, kn, c, first, next);
    case 3: return tile<W, 3, J>(w, ldw, xp, kn, c, first, next);
    case 2: return tile<W, 2, J>(w, ldw, xp, kn, c, first, next);
    default: return tile<W, 1, J>(w, ldw, xp, kn, c, first, next);
  }
}

template <typename W>
inline void any_tile(int r, int64_t rows, const W* w, int64_t ldw, const float* xp, int64_t kn,
                     float* c, bool first, const W* next) {
  if (rows > hs::simd::kLanes) return tile_rows<W, 2>(r, w, ldw, xp, kn, c, first, next);
  return tile_rows<W, 1>(r, w, ldw, xp, kn, c, first, next);
}

// Columns [k0, k0 + kn) of the bf16 rows [n0, n0 + rows) (row stride ldw) -> dst [rows][kn] fp32.
inline void widen_block(const c10::BFloat16* w, int64_t ldw, int64_t n0, int64_t rows, int64_t k0,
                        int64_t kn, float* dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < kn; ++k) dst[i * kn + k] = hs::load1(w + (n0 + i) * ldw + k0 + k);
}

// Output columns [n0, n1) of y [M, ldy] = x w[n0:n1, :K]^T on the calling thread, w fp32 or
// bf16 (row stride ldw), x given as its packed panels xp (pack_panels of M rows, K columns).
template <typename W>
inline void gemm_cols(const float* xp, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t M,
                      int64_t K, int64_t n0, int64_t n1) {
  static_assert(!is_quantized<W>, "int8 and int4 take qgemm.h's integer GEMM");
  alignas(64) float cbuf[NC / NR * PC * NR * MR];  // [tile][panel][NR][MR]
  const int64_t P = panels(M);
  // A lone panel reuses no weight block: with AVX2 it takes whole rows per tile, long runs for
  // the prefetcher. With AVX-512 its panel is twice as wide (a whole row of k is 96 KB at
  // K = 768, past L1), so it takes KC blocks, which keep the panel's block in L1. The sums are
  // the same either way. bf16 blocks are widened, one NC x KC block at a time, into `wide`
  // (`widen_block`) once the m block spans PC panels (the pair broadcasts' shift and mask per
  // weight and panel then cost more than one conversion per pass); widened or not, the sums
  // are the same, so rows still do not depend on their batch.
  const bool widen = std::is_same_v<W, c10::BFloat16> && P >= PC;
  const int64_t kc = P == 1 && hs::simd::kLanes <= 8 && !widen ? K : KC;
  std::unique_ptr<float[]> wide(widen ? new float[NC * KC] : nullptr);
  for (int64_t b0 = n0; b0 < n1; b0 += NC) {
    const int64_t b1 = std::min(n1, b0 + NC), tiles = (b1 - b0 + NR - 1) / NR;
    for (int64_t p0 = 0; p0 < P; p0 += PC) {
      const int64_t p1 = std::min(P, p0 + PC);
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t kn = std::min(kc, K - k0);
        const W* wb = w + b0 * ldw + k0;
        if constexpr (std::is_same_v<W, c10::BFloat16>)
          if (widen) widen_block(w, ldw, b0, b1 - b0, k0, kn, wide.get());
        for (int64_t p = p0; p < p1; ++p) {
          const float* xb = xp + (p * K + k0) * MR;
          const int64_t rows = std::min<int64_t>(MR, M - p * MR);
          for (int64_t t = 0; t < tiles; ++t) {
            const int r = int(std::min<int64_t>(NR, b1 - b0 - t * NR));
            float* c = cbuf + (t * PC + (p - p0)) * NR * MR;
            if (widen) {
              any_tile<float>(r, rows, wide.get() + t * NR * kn, kn, xb, kn, c, k0 == 0,
                              nullptr);
            } else {
              // the weights come from memory on the first panel's pass: fetch the next tile's
              const W* next = nullptr;
              if (p == p0)
                next = t + 1 < tiles ? wb + (t + 1) * NR * ldw : k0 + kc < K ? wb + kc : nullptr;
              any_tile(r, rows, wb + t * NR * ldw, ldw, xb, kn, c, k0 == 0, next);
            }
          }
        }
      }
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n = b0 + t * NR, r = std::min<int64_t>(NR, b1 - n);
        for (int64_t p = p0; p < p1; ++p) {
          const float* c = cbuf + (t * PC + (p - p0)) * NR * MR;
          const int64_t rows = std::min<int64_t>(MR, M - p * MR);
          for (int64_t l = 0; l < rows; ++l)
            for (int64_t i = 0; i < r; ++i) y[(p * MR + l) * ldy + n + i] = c[i * MR + l];
        }
      }
    }
  }
}

// y [M, N] = x [M, K] w [N, K]^T for fp32 or bf16 w, all contiguous, parallel over weight rows.
template <typename W>
inline void float_gemm_into(const float* x, const W* w, float* y, int64_t M, int64_t N,
                            int64_t K) {
  if (M == 0 || N == 0) return;
  const int64_t ldw = hs::row_stride<W>(K);
  const int64_t tiles = (N + NR - 1) / NR, P = panels(M);
  const auto xp = panel_buffer(P, K);
  pack_panels(x, K, M, K, xp.get());
  if (tiles < 2 * at::get_num_threads() && P >= 2) {  // a few weight rows (a gate): split x
    at::parallel_for(0, P, 1, [&](int64_t q0, int64_t q1) {
      const int64_t m0 = q0 * MR, m1 = std::min(M, q1 * MR);
      gemm_cols(xp.get() + q0 * K * MR, w, ldw, y + m0 * N, N, m1 - m0, K, 0, N);
    });
    return;
  }
  // at least ~32 KB of weights per task, in whole tiles
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, K * sizeof(W) * NR));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    gemm_cols(xp.get(), w, ldw, y, N, M, K, t0 * NR, std::min(N, t1 * NR));
  });
}

// y [M, N] = x [M, K] w [N, K]^T, all contiguous; int8 and int4 weights in integer products
// (qgemm.h).
template <typename W>
inline void gemm_into(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  if constexpr (is_quantized<W>) {
    hs::qtiled::gemm_into(x, w, y, M, N, K);
  } else {
    float_gemm_into(x, w, y, M, N, K);
  }
}

}  // namespace hs::tiled
