// The bf16 GEMM of the bf16 route (decode_ops.h's `bf16_linear`, beyond kGemvRows rows on CPUs
// that multiply bf16 in hardware): y [M, N] = bf16(x) w^T for fp32 x [M, K] and a bf16 w [N, K],
// x rounded to bf16 (nearest even), every product of two bf16 values exact in fp32, summed in
// fp32, each output rounded to bf16 once and widened back to fp32: the contract torch's bf16
// product (oneDNN) kept before it, without oneDNN's copy of the whole weight on every call.
//
// The weight is read as it lies: a row's elements k and k + 1 are one 4-byte pair, broadcast
// (simd.h's `bcast_bpair`) against a panel of x held as bf16 pairs, [K / 2 pairs][MR rows][2]
// (MR = 2 kLanes rows, rows past M zero, an odd K's last pair padded with zero), so one
// `dot_pairs` (vdpbf16ps at the levels with AVX512-BF16, two FMAs on the exactly widened pair
// elsewhere) adds kLanes rows' products of a pair. A register tile of NR weight rows by one
// panel (J = 2 vectors of rows, 1 for a last panel of at most kLanes rows) sums each run of
// KC / 2 pairs from zero and adds it to the tile's fp32 sums (cbuf), so the sums are blocked
// as gemm.h's; NC weight rows by KC columns stay in L1/L2 while up to PC panels pass over
// them; threads split the weight rows. An output depends only on its row of x and its weight
// row, not on M or its place in the batch; across levels its last bits follow the dot's form
// (vdpbf16ps or FMAs: simd.h), within one rounding to bf16 of each other.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace hs::bgemm {

namespace v = hs::simd;
using bf16 = c10::BFloat16;
constexpr int L = v::kLanes;         // rows per vector
constexpr int MR = 2 * L;            // rows per panel
constexpr int NR = L >= 16 ? 8 : 4;  // weight rows per register tile (AVX2 has 16 registers)
constexpr int64_t KC = 256;          // k per cache block (even)
constexpr int64_t NC = 64;           // weight rows per cache block (a multiple of NR)
constexpr int64_t PC = 4;            // panels per m block

inline int64_t panels(int64_t M) { return (M + MR - 1) / MR; }
inline int64_t pairs(int64_t K) { return (K + 1) / 2; }

// x [M, K] -> its panels xp [panels(M)][pairs(K)][MR][2], rounded to bf16 (nearest even).
inline std::vector<bf16> pack_pairs(const float* x, int64_t M, int64_t K) {
  const int64_t P = panels(M), K2 = pairs(K);
  std::vector<bf16> xp(P * K2 * MR * 2, bf16(0.f));
  for (int64_t m = 0; m < M; ++m) {
    bf16* dst = xp.data() + (m / MR) * K2 * MR * 2 + (m % MR) * 2;
    for (int64_t k = 0; k < K; ++k) dst[(k / 2) * MR * 2 + k % 2] = bf16(x[m * K + k]);
  }
  return xp;
}

// c [R][MR] (+)= the pairs [kp0, kp1) of R weight rows w (row stride ldw, K columns) times the
// panel xp (at its pair 0); `first`: c starts at zero. `next`: the next tile's first row, whose
// pairs [kp0, kp1) are fetched meanwhile (null: none).
template <int R, int J>
inline void tile(const bf16* w, int64_t ldw, int64_t K, const bf16* xp, int64_t kp0, int64_t kp1,
                 float* c, bool first, const bf16* next) {
  v::vec acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = v::zero();
  if (next != nullptr)
    for (int r = 0; r < NR; ++r)
      for (int64_t k = 2 * kp0; k < 2 * kp1; k += 32) v::prefetch(next + r * ldw + k);
  const int64_t whole = std::min(kp1, K / 2);  // pairs that lie whole in a row
  auto step = [&](int64_t kp, const bf16* const (&wp)[R]) {
    v::bpairs xa[J];
    for (int j = 0; j < J; ++j) xa[j] = v::load_pairs(xp + (kp * MR + j * L) * 2);
    for (int r = 0; r < R; ++r) {
      const v::bpairs wb = v::bcast_bpair(wp[r]);
      for (int j = 0; j < J; ++j) acc[r][j] = v::dot_pairs(acc[r][j], xa[j], wb);
    }
  };
  for (int64_t kp = kp0; kp < whole; ++kp) {
    const bf16* wp[R];
    for (int r = 0; r < R; ++r) wp[r] = w + r * ldw + 2 * kp;
    step(kp, wp);
  }
  if (whole < kp1) {  // an odd K's last element, paired with a zero
    bf16 last[R][2];
    const bf16* wp[R];
    for (int r = 0; r < R; ++r) {
      last[r][0] = w[r * ldw + K - 1];
      last[r][1] = bf16(0.f);
      wp[r] = last[r];
    }
    step(whole, wp);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      float* cp = c + r * MR + j * L;
      v::store(cp, first ? acc[r][j] : v::add(v::load(cp), acc[r][j]));
    }
}

template <int J>
inline void tile_rows(int r, const bf16* w, int64_t ldw, int64_t K, const bf16* xp, int64_t kp0,
                      int64_t kp1, float* c, bool first, const bf16* next) {
  static_assert(NR == 4 || NR == 8, "tile_rows lists the row counts 1..8");
  switch (r) {
    case 8:
      if constexpr (NR == 8) return tile<8, J>(w, ldw, K, xp, kp0, kp1, c, first, next);
      break;
    case 7:
      if constexpr (NR == 8) return tile<7, J>(w, ldw, K, xp, kp0, kp1, c, first, next);
      break;
    case 6:
      if constexpr (NR == 8) return tile<6, J>(w, ldw, K, xp, kp0, kp1, c, first, next);
      break;
    case 5:
      if constexpr (NR == 8) return tile<5, J>(w, ldw, K, xp, kp0, kp1, c, first, next);
      break;
    case 4: return tile<4, J>(w, ldw, K, xp, kp0, kp1, c, first, next);
    case 3: return tile<3, J>(w, ldw, K, xp, kp0, kp1, c, first, next);
    case 2: return tile<2, J>(w, ldw, K, xp, kp0, kp1, c, first, next);
    default: return tile<1, J>(w, ldw, K, xp, kp0, kp1, c, first, next);
  }
}

// Output columns [n0, n1) of y [M, ldy] on the calling thread, x given as the panels xp.
inline void gemm_cols(const bf16* xp, const bf16* w, float* y, int64_t ldy, int64_t M, int64_t K,
                      int64_t n0, int64_t n1) {
  alignas(64) float cbuf[NC / NR * PC * NR * MR];  // [tile][panel][NR][MR]
  const int64_t P = panels(M), K2 = pairs(K), KP = KC / 2;
  for (int64_t b0 = n0; b0 < n1; b0 += NC) {
    const int64_t b1 = std::min(n1, b0 + NC), tiles = (b1 - b0 + NR - 1) / NR;
    for (int64_t p0 = 0; p0 < P; p0 += PC) {
      const int64_t p1 = std::min(P, p0 + PC);
      for (int64_t kp0 = 0; kp0 < K2; kp0 += KP) {
        const int64_t kp1 = std::min(K2, kp0 + KP);
        for (int64_t p = p0; p < p1; ++p) {
          const bf16* xb = xp + p * K2 * MR * 2;
          const bool half = M - p * MR <= L;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t n = b0 + t * NR;
            const int r = int(std::min<int64_t>(NR, b1 - n));
            float* c = cbuf + (t * PC + (p - p0)) * NR * MR;
            // the weights come from memory on the first panel's pass: fetch the next tile's
            const bf16* next = p == p0 && t + 1 < tiles ? w + (n + NR) * K : nullptr;
            if (half) {
              tile_rows<1>(r, w + n * K, K, K, xb, kp0, kp1, c, kp0 == 0, next);
            } else {
              tile_rows<2>(r, w + n * K, K, K, xb, kp0, kp1, c, kp0 == 0, next);
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
            for (int64_t i = 0; i < r; ++i)
              y[(p * MR + l) * ldy + n + i] = float(bf16(c[i * MR + l]));  // nearest even
        }
      }
    }
  }
}

// y [M, N] = bf16(x) [M, K] w [N, K]^T, all contiguous, parallel over weight rows (over panels
// of x when the weight has too few rows to share).
inline void gemm_into(const float* x, const bf16* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M == 0 || N == 0) return;
  const std::vector<bf16> xp = pack_pairs(x, M, K);
  const int64_t tiles = (N + NR - 1) / NR, P = panels(M), K2 = pairs(K);
  if (tiles < 2 * at::get_num_threads() && P >= 2) {
    at::parallel_for(0, P, 1, [&](int64_t q0, int64_t q1) {
      const int64_t m0 = q0 * MR, m1 = std::min(M, q1 * MR);
      gemm_cols(xp.data() + q0 * K2 * MR * 2, w, y + m0 * N, N, m1 - m0, K, 0, N);
    });
    return;
  }
  // at least ~32 KB of weights per task, in whole tiles
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, K * 2 * NR));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    gemm_cols(xp.data(), w, y, N, M, K, t0 * NR, std::min(N, t1 * NR));
  });
}

}  // namespace hs::bgemm
