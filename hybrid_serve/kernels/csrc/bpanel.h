// The bf16 panel product: y [M, N] = bf16(x) w^T for fp32 x [M, K] and a bf16 w [N, K] packed in
// K-pair panels (weights.h: tiles of kPanel = 16 rows, a tile's pair p one vector of 16 rows'
// (k, k + 1) pairs), x rounded to bf16 (nearest even), every product of two bf16 values exact in
// fp32, summed in fp32, each output rounded to bf16 once and widened back to fp32.
//
// One vector of a tile's pair times one broadcast pair of a row of x (simd.h's `bcast_bpair`,
// `dot_pairs`: one vdpbf16ps at the levels with AVX512-BF16, two FMAs on the exactly widened
// pair elsewhere) adds 16 outputs' products, with no horizontal sum: a register tile of MP rows
// of x by TT tiles keeps MP * TT * 16 / kLanes independent chains. The same kernel serves every
// row count: up to kPassRows rows one pass streams each tile once over the whole of K (the
// GEMV); beyond, the tiles are blocked by KP pairs, which stay in L1 while the passes of
// kPassRows rows go over them (the GEMM). Threads split the tiles (the rows of x where there
// are too few tiles to share).
//
// Contract: every output is ONE chain: from zero, its pairs p = 0, 1, ... in order, each one
// `dot_pairs` step, then for an odd K one fma of the last column; then rounded to bf16. A K
// block's partial sums are stored to y and loaded back, which rounds nothing. So an output is
// the same bits whatever M, its row's place in the batch, the register tile, the blocking or
// the threads: the 1-row GEMV, a verify's rows and the GEMM agree bit for bit. Across levels its
// last bits follow the dot's form (vdpbf16ps, or the FMAs), within one bf16 rounding.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "weights.h"

namespace hs::bpanel {

namespace v = hs::simd;
using bf16 = c10::BFloat16;
constexpr int L = v::kLanes;
constexpr int V = int(kPanel) / L;         // vectors per tile pair
constexpr int kPassRows = L >= 16 ? 8 : 4;  // rows of x per pass (registers: 32 or 16)
constexpr int64_t KP = 64;                  // pairs per K block beyond one pass (8 tiles: 32 KB)
constexpr int64_t TB = 8;                   // tiles per cache block
static_assert(kPanel % L == 0, "a tile's pair is whole vectors");

// Tiles per register tile for MP rows: enough chains to hide the dot's latency, within the
// registers (AVX2's bpairs take two).
constexpr int tiles_for(int mp) {
  if constexpr (L >= 16) return mp == 1 ? 8 : mp == 2 ? 4 : 2;
  if constexpr (L >= 8) return mp == 1 ? 4 : mp == 2 ? 2 : 1;
  return mp == 1 ? 2 : 1;
}

// y[m, 16 t + r] (row stride ldy) += the pairs [kp0, kp1) of the TT full tiles at tiles[t] times
// the MP rows of xb (row stride K); `first`: y starts at zero; `last`: an odd K's last column is
// added after the pairs.
template <int MP, int TT>
inline void kernel(const bf16* const* tiles, const bf16* xb, int64_t K, int64_t kp0, int64_t kp1,
                   float* y, int64_t ldy, bool first, bool last) {
  v::vec acc[MP][TT][V];
  for (int m = 0; m < MP; ++m)
    for (int t = 0; t < TT; ++t)
      for (int j = 0; j < V; ++j)
        acc[m][t][j] = first ? v::zero() : v::load(y + m * ldy + t * kPanel + j * L);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    v::bpairs wv[TT][V];
    for (int t = 0; t < TT; ++t) {
      const bf16* p = tiles[t] + 2 * kPanel * kp;
      v::prefetch(reinterpret_cast<const char*>(p) + kFetchAhead);
      for (int j = 0; j < V; ++j) wv[t][j] = v::load_pairs(p + 2 * L * j);
    }
    for (int m = 0; m < MP; ++m) {
      const v::bpairs xv = v::bcast_bpair(xb + m * K + 2 * kp);
      for (int t = 0; t < TT; ++t)
        for (int j = 0; j < V; ++j) acc[m][t][j] = v::dot_pairs(acc[m][t][j], wv[t][j], xv);
    }
  }
  if (last) {
    const int64_t K2 = K / 2;
    for (int m = 0; m < MP; ++m) {
      const v::vec xv = v::bcast(float(xb[m * K + K - 1]));
      for (int t = 0; t < TT; ++t)
        for (int j = 0; j < V; ++j)
          acc[m][t][j] = v::fma(v::load_w(tiles[t] + 2 * kPanel * K2 + j * L), xv, acc[m][t][j]);
    }
  }
  for (int m = 0; m < MP; ++m)
    for (int t = 0; t < TT; ++t)
      for (int j = 0; j < V; ++j) v::store(y + m * ldy + t * kPanel + j * L, acc[m][t][j]);
}

// fn(std::integral_constant<int, mp>) for 1 <= mp <= kPassRows.
template <typename F>
inline void with_rows(int64_t mp, const F& fn) {
  switch (mp) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
  }
  if constexpr (kPassRows == 8) {
    switch (mp) {
      case 5: return fn(std::integral_constant<int, 5>{});
      case 6: return fn(std::integral_constant<int, 6>{});
      case 7: return fn(std::integral_constant<int, 7>{});
      default: return fn(std::integral_constant<int, 8>{});
    }
  }
}

// A short tile (h < kPanel rows, packed with h) as a whole one: rows past h zero.
inline std::vector<bf16> pad_tile(const bf16* tile, int64_t h, int64_t K) {
  const int64_t K2 = K / 2;
  std::vector<bf16> out(kPanel * K, bf16(0.f));
  for (int64_t p = 0; p < K2; ++p)
    std::memcpy(out.data() + 2 * kPanel * p, tile + 2 * h * p, 2 * h * sizeof(bf16));
  if (K % 2) std::memcpy(out.data() + 2 * kPanel * K2, tile + 2 * h * K2, h * sizeof(bf16));
  return out;
}

// Tiles [t0, t1) (tile T = N / kPanel the short one, given padded as `tail`) for the rows
// [0, M) of xb -> y [M, N] rows' columns of those tiles, rounded to bf16.
inline void tiles_range(const bf16* xb, const bf16* w, const bf16* tail, float* y, int64_t M,
                        int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t T = N / kPanel, K2 = K / 2, h = N - T * kPanel;
  const int64_t kp_block = M <= kPassRows ? std::max<int64_t>(K2, 1) : KP;
  std::vector<float> ytail(t1 > T ? M * kPanel : 0);
  for (int64_t b0 = t0; b0 < t1; b0 += TB) {
    const int64_t b1 = std::min(t1, b0 + TB), full = std::min(b1, T);
    for (int64_t kp0 = 0;; kp0 += kp_block) {
      const int64_t kp1 = std::min(K2, kp0 + kp_block);
      const bool first = kp0 == 0, last = kp1 == K2 && K % 2;
      for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
        with_rows(std::min<int64_t>(kPassRows, M - m0), [&](auto rows) {
          constexpr int MP = decltype(rows)::value, TT = tiles_for(MP);
          const bf16* xm = xb + m0 * K;
          float* ym = y + m0 * N;
          const bf16* tp[TT];
          int64_t t = b0;
          for (; t + TT <= full; t += TT) {
            for (int i = 0; i < TT; ++i) tp[i] = w + (t + i) * kPanel * K;
            kernel<MP, TT>(tp, xm, K, kp0, kp1, ym + t * kPanel, N, first, last);
          }
          for (; t < full; ++t) {
            tp[0] = w + t * kPanel * K;
            kernel<MP, 1>(tp, xm, K, kp0, kp1, ym + t * kPanel, N, first, last);
          }
          if (b1 > T) {
            tp[0] = tail;
            kernel<MP, 1>(tp, xm, K, kp0, kp1, ytail.data() + m0 * kPanel, kPanel, first, last);
          }
        });
      }
      if (kp1 >= K2) break;
    }
    for (int64_t m = 0; m < M; ++m) {
      float* yr = y + m * N;
      for (int64_t n = b0 * kPanel; n < full * kPanel; ++n) yr[n] = float(bf16(yr[n]));
      if (b1 > T)
        for (int64_t i = 0; i < h; ++i) yr[T * kPanel + i] = float(bf16(ytail[m * kPanel + i]));
    }
  }
}

// x [M, K] rounded to bf16 (nearest even).
inline std::vector<bf16> round_rows(const float* x, int64_t M, int64_t K) {
  std::vector<bf16> out(M * K);
  for (int64_t i = 0; i < M * K; ++i) out[i] = bf16(x[i]);
  return out;
}

// y [M, N] = bf16(x) [M, K] w [N, K]^T for a panel-packed w, all contiguous: threads split the
// tiles (about 64 KB of weights per task at least), or the rows of x in passes where the tiles
// are too few to share. Nested inside another at::parallel_for it runs on the calling thread.
inline void linear_into(const float* x, const bf16* w, float* y, int64_t M, int64_t N,
                        int64_t K) {
  if (M == 0 || N == 0) return;
  const std::vector<bf16> xb = round_rows(x, M, K);
  const int64_t T = N / kPanel, h = N - T * kPanel, tiles = T + (h > 0);
  const std::vector<bf16> tail = h > 0 ? pad_tile(w + T * kPanel * K, h, K) : std::vector<bf16>();
  if (tiles < 2 * at::get_num_threads() && M >= 4 * kPassRows) {
    const int64_t passes = (M + kPassRows - 1) / kPassRows;
    at::parallel_for(0, passes, 1, [&](int64_t q0, int64_t q1) {
      const int64_t m0 = q0 * kPassRows, m1 = std::min(M, q1 * kPassRows);
      tiles_range(xb.data() + m0 * K, w, tail.data(), y + m0 * N, m1 - m0, N, K, 0, tiles);
    });
    return;
  }
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, kPanel * K * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    tiles_range(xb.data(), w, tail.data(), y, M, N, K, t0, t1);
  });
}

}  // namespace hs::bpanel
