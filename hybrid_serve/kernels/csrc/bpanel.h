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
// GEMV); beyond, blocks of TB tiles by KP pairs (128 KB) stay in L2 while the passes of
// kPassRows rows go over them (the GEMM). x is packed once per call as pair panels, so a
// pass's broadcasts are one run of memory (`pack_acts`). Threads split the tiles (the passes of
// x where there are too few tiles to share).
//
// Contract: every output is ONE chain: from zero, its pairs p = 0, 1, ... in order, each one
// `dot_pairs` step, then for an odd K one fma of the last column; then rounded to bf16. A K
// block's partial sums are stored to the block's fp32 buffer and loaded back, which rounds
// nothing. So an output is
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
constexpr int V = int(kPanel) / L;          // vectors per tile pair
constexpr int kPassRows = L >= 16 ? 8 : 4;  // rows of x per pass (registers: 32 or 16)
constexpr int64_t KP = 256;                 // pairs per K block beyond one pass (8 tiles: 128 KB)
constexpr int64_t TB = 8;                   // tiles per cache block
// How far ahead of a tile's pair the panel products fetch (bytes): kFetchAhead and a half page,
// so that the lines fetched do not fall in the L1 sets of the tiles being read (tiles lie
// 32 K bytes apart: the same sets wherever K is a power of two).
constexpr int64_t kPanelAhead = kFetchAhead + 2048;
static_assert(kPanel % L == 0, "a tile's pair is whole vectors");

// Tiles per register tile for MP rows: enough chains to keep the dots busy while the weights
// stream (a tile's pair is one line: a few chains outrun a core's share of the memory), and few
// tiles read at once, within the registers (AVX2's bpairs take two).
constexpr int tiles_for(int mp) {
  if (L >= 16) return mp == 1 ? 4 : 2;
  if (L >= 8) return mp == 1 ? 2 : 1;
  return 1;
}

// x [M, K] as bf16 pairs for the passes (nearest even): pass q's pair p of its row m at word
// (q K2 + p) kPassRows + m (rows past M zero), so a pass's broadcasts are one run of memory;
// an odd K's last column apart, widened back, in xlast [M].
struct Acts {
  std::vector<uint32_t> pairs;
  std::vector<float> last;
};

inline Acts pack_acts(const float* x, int64_t M, int64_t K) {
  const int64_t K2 = K / 2, passes = (M + kPassRows - 1) / kPassRows;
  Acts a{std::vector<uint32_t>(passes * K2 * kPassRows, 0u), std::vector<float>(M, 0.f)};
  for (int64_t m = 0; m < M; ++m) {
    uint32_t* dst = a.pairs.data() + (m / kPassRows) * K2 * kPassRows + m % kPassRows;
    const float* xr = x + m * K;
    for (int64_t p = 0; p < K2; ++p) {
      const bf16 pair[2] = {bf16(xr[2 * p]), bf16(xr[2 * p + 1])};
      std::memcpy(dst + p * kPassRows, pair, sizeof pair);
    }
    if (K % 2) a.last[m] = float(bf16(xr[K - 1]));
  }
  return a;
}

// c[m, 16 t + r] (row stride ldc) += the pairs [kp0, kp1) of the TT tiles at tiles[t] times the
// MP rows of a pass (xp: its words, `pack_acts`; xl: its rows' last columns); `first`: c starts
// at zero; `last`: an odd K's last column (the tile's values after its K2 pairs) is added after
// the pairs.
template <int MP, int TT>
inline void kernel(const bf16* const* tiles, const uint32_t* xp, const float* xl, int64_t K2,
                   int64_t kp0, int64_t kp1, float* c, int64_t ldc, bool first, bool last) {
  v::vec acc[MP][TT][V];
  for (int m = 0; m < MP; ++m)
    for (int t = 0; t < TT; ++t)
      for (int j = 0; j < V; ++j)
        acc[m][t][j] = first ? v::zero() : v::load(c + m * ldc + t * kPanel + j * L);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    v::bpairs wv[TT][V];
    for (int t = 0; t < TT; ++t) {
      const bf16* p = tiles[t] + 2 * kPanel * kp;
      v::prefetch(reinterpret_cast<const char*>(p) + kPanelAhead);
      for (int j = 0; j < V; ++j) wv[t][j] = v::load_pairs(p + 2 * L * j);
    }
    const auto* xk = reinterpret_cast<const bf16*>(xp + kp * kPassRows);
    for (int m = 0; m < MP; ++m) {
      const v::bpairs xv = v::bcast_bpair(xk + 2 * m);
      for (int t = 0; t < TT; ++t)
        for (int j = 0; j < V; ++j) acc[m][t][j] = v::dot_pairs(acc[m][t][j], wv[t][j], xv);
    }
  }
  if (last) {
    for (int m = 0; m < MP; ++m) {
      const v::vec xv = v::bcast(xl[m]);
      for (int t = 0; t < TT; ++t)
        for (int j = 0; j < V; ++j)
          acc[m][t][j] = v::fma(v::load_w(tiles[t] + 2 * kPanel * K2 + j * L), xv, acc[m][t][j]);
    }
  }
  for (int m = 0; m < MP; ++m)
    for (int t = 0; t < TT; ++t)
      for (int j = 0; j < V; ++j) v::store(c + m * ldc + t * kPanel + j * L, acc[m][t][j]);
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

// Tiles [t0, t1) (tile T = N / kPanel the short one, given padded as `tail`) for the M rows of
// `acts` (whose passes start at pass q0) -> y [M, N] rows' columns of those tiles, rounded to
// bf16. Up to kPassRows rows one pass streams each tile over the whole of K; beyond, the tiles
// go in blocks of TB tiles by KP pairs, each block's sums in c until its last pair.
inline void tiles_range(const Acts& acts, int64_t q0, const bf16* w, const bf16* tail, float* y,
                        int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t T = N / kPanel, K2 = K / 2;
  const int64_t kp_block = M <= kPassRows ? std::max<int64_t>(K2, 1) : KP, ldc = TB * kPanel;
  std::vector<float> c(M * ldc);
  for (int64_t b0 = t0; b0 < t1; b0 += TB) {
    const int64_t b1 = std::min(t1, b0 + TB);
    for (int64_t kp0 = 0;; kp0 += kp_block) {
      const int64_t kp1 = std::min(K2, kp0 + kp_block);
      const bool first = kp0 == 0, last = kp1 == K2 && K % 2;
      for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
        const uint32_t* xp = acts.pairs.data() + (q0 + m0 / kPassRows) * K2 * kPassRows;
        const float* xl = acts.last.data() + q0 * kPassRows + m0;
        with_rows(std::min<int64_t>(kPassRows, M - m0), [&](auto rows) {
          constexpr int MP = decltype(rows)::value, TT = tiles_for(MP);
          const bf16* tp[TT];
          int64_t t = b0;
          for (; t < b1; t += TT) {
            const int64_t n = std::min<int64_t>(TT, b1 - t);
            for (int64_t i = 0; i < n; ++i) tp[i] = t + i < T ? w + (t + i) * kPanel * K : tail;
            float* cm = c.data() + m0 * ldc + (t - b0) * kPanel;
            if (n == TT) {
              kernel<MP, TT>(tp, xp, xl, K2, kp0, kp1, cm, ldc, first, last);
            } else {
              for (int64_t i = 0; i < n; ++i)
                kernel<MP, 1>(tp + i, xp, xl, K2, kp0, kp1, cm + i * kPanel, ldc, first, last);
            }
          }
        });
      }
      if (kp1 >= K2) break;
    }
    const int64_t n0 = b0 * kPanel, n1 = std::min(N, b1 * kPanel);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) y[m * N + n] = float(bf16(c[m * ldc + n - n0]));
  }
}

// y [M, N] = bf16(x) [M, K] w [N, K]^T for a panel-packed w, all contiguous: threads split the
// tiles (about 64 KB of weights per task at least), or the passes of x where the tiles are too
// few to share. Nested inside another at::parallel_for it runs on the calling thread.
inline void linear_into(const float* x, const bf16* w, float* y, int64_t M, int64_t N,
                        int64_t K) {
  if (M == 0 || N == 0) return;
  const Acts acts = pack_acts(x, M, K);
  const int64_t T = N / kPanel, h = N - T * kPanel, tiles = T + (h > 0);
  const std::vector<bf16> tail = h > 0 ? pad_tile(w + T * kPanel * K, h, K) : std::vector<bf16>();
  if (tiles < 2 * at::get_num_threads() && M >= 4 * kPassRows) {
    const int64_t passes = (M + kPassRows - 1) / kPassRows;
    at::parallel_for(0, passes, 1, [&](int64_t q0, int64_t q1) {
      const int64_t m0 = q0 * kPassRows, m1 = std::min(M, q1 * kPassRows);
      tiles_range(acts, q0, w, tail.data(), y + m0 * N, m1 - m0, N, K, 0, tiles);
    });
    return;
  }
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, kPanel * K * 2));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    tiles_range(acts, 0, w, tail.data(), y, M, N, K, t0, t1);
  });
}

}  // namespace hs::bpanel
