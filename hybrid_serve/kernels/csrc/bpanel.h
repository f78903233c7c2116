// The bf16 panel product: y [M, N] = bf16(x) w^T for fp32 x [M, K] and a bf16 w [N, K] packed in
// K-pair panels (weights.h: panels of kPanel = 64 rows, a panel's pair p the 64 rows' (k, k + 1)
// pairs, 256 bytes, one run of memory), x rounded to bf16 (nearest even), every product of two
// bf16 values exact in fp32, summed in fp32, each output rounded to bf16 once and widened back
// to fp32.
//
// One vector of a panel's pair (kLanes rows' pairs) times one broadcast pair of a row of x
// (simd.h's `bcast_bpair`, `dot_pairs`: one vdpbf16ps at the levels with AVX512-BF16, two FMAs
// on the exactly widened pair elsewhere) adds kLanes outputs' products, with no horizontal sum.
// A register tile is MP rows of x by a column slice of VJ vectors of one panel (`slice_for`):
// one row takes the whole pair, so a one-row pass reads one panel as one stream of memory, pair
// after pair; more rows take fewer vectors at once (the registers), in sub-passes over the
// slices. Where one pass over the whole of K does it all (one sub-pass, up to kPassRows rows) the
// panels stream once over K (the GEMV); otherwise blocks of TB panels by KP pairs (128 KB) stay
// in L2 while the sub-passes and the passes of kPassRows rows go over them (a second slice, a
// second pass, reads from L2, not memory). The short last panel (N % 64 rows, packed with its h
// rows) is read in place: its whole vectors as they lie, its last partial one by a masked load
// (`load_pairs_n`). x is packed once per call as pair panels, so a pass's broadcasts are one run
// of memory (`pack_acts`). Threads split the panels (the passes of x where there are too few
// panels to share).
//
// Contract: every output is ONE chain: from zero, its pairs p = 0, 1, ... in order, each one
// `dot_pairs` step, then for an odd K one fma of the last column; then rounded to bf16. A K
// block's partial sums are stored to the block's fp32 buffer and loaded back, which rounds
// nothing. So an output is the same bits whatever M, its row's place in the batch, the register
// tile, the slices, the blocking or the threads: the 1-row GEMV, a verify's rows and the GEMM
// agree bit for bit. Across levels its last bits follow the dot's form (vdpbf16ps, or the FMAs),
// within one bf16 rounding.
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
constexpr int VP = int(kPanel) / L;         // vectors per panel pair
constexpr int kPassRows = L >= 16 ? 8 : 4;  // rows of x per pass (registers: 32 or 16)
constexpr int64_t KP = 256;                 // pairs per K block (a panel's: 64 KB)
constexpr int64_t TB = 2;                   // panels per cache block (128 KB by KP pairs)
static_assert(kPanel % L == 0, "a panel's pair is whole vectors");
// The panels are one stream: a kernel asks for their pairs ahead, into L2 (at one row the best
// of the three tried: into L1, into L2, none): kFetchAhead bytes ahead at one row, three times
// that beyond, where the dots of several rows take longer per pair (at 4 rows the farther
// distance was the better of the two).
constexpr int64_t fetch_ahead(int mp) { return mp == 1 ? kFetchAhead : 3 * kFetchAhead; }

// Vectors of a panel's pair per sub-pass of MP rows (a power of two dividing VP). One row takes
// the whole pair (each vector is used once: the weights stream through a register or two). More
// rows hold the slice's VJ vectors for all their rows: MP VJ accumulators + VJ vectors (two
// registers each where the pairs are widened) + the broadcast, within the registers: AVX-512
// 4 vectors up to 4 rows, 2 beyond (32 registers); AVX2 2 (16 registers); NEON 4 (32 registers).
constexpr int slice_for(int mp) {
  if (mp == 1) return VP;
  if (L >= 16) return mp <= 4 ? 4 : 2;
  if (L >= 8) return 2;
  return 4;
}

// Whether the passes of M rows read every pair once over the whole of K (one pass, one
// sub-pass): the GEMV streams each panel once; otherwise the panels go in K blocks.
constexpr bool streams(int64_t M) { return M <= kPassRows && slice_for(int(M)) == VP; }

// x [M, K] as bf16 pairs for the passes (nearest even): pass q (rows [q kPassRows, ...), r of
// them: kPassRows but for the last pass) holds its rows' pairs from word q K2 kPassRows, pair p
// of its row m at word p r + m, so a pass's broadcasts are one run of memory and a one-row pass
// reads x's K2 words alone (not kPassRows times their room); an odd K's last column apart,
// widened back, in last [M].
struct Acts {
  std::vector<uint32_t> pairs;
  std::vector<float> last;
};

inline Acts pack_acts(const float* x, int64_t M, int64_t K) {
  const int64_t K2 = K / 2;
  Acts a{std::vector<uint32_t>(M * K2), std::vector<float>(M, 0.f)};
  for (int64_t m = 0; m < M; ++m) {
    const int64_t q = m / kPassRows, r = std::min<int64_t>(kPassRows, M - q * kPassRows);
    uint32_t* dst = a.pairs.data() + q * K2 * kPassRows + m % kPassRows;
    const float* xr = x + m * K;
    for (int64_t p = 0; p < K2; ++p) {
      const bf16 pair[2] = {bf16(xr[2 * p]), bf16(xr[2 * p + 1])};
      std::memcpy(dst + p * r, pair, sizeof pair);
    }
    if (K % 2) a.last[m] = float(bf16(xr[K - 1]));
  }
  return a;
}

// How a `kernel` reads its panel: a whole one (kPanel rows, its pairs 2 kPanel elements apart),
// or the short last one (h rows, pairs 2 h apart), the slice's vectors whole, or its last vector
// partial (holding only `n_last` rows: lanes past them read nothing and sum zero).
enum Read { kWhole, kShort, kPartial };

// c[m, L j0 + i] (row stride ldc; i < L VJ) += the pairs [kp0, kp1) of vectors [j0, j0 + VJ) of
// a panel of h rows (`Read`) times the MP rows of a pass (xp: its words, pair p's at p MP,
// `pack_acts`; xl: its rows' last columns). `first`: c starts at zero; `last`: an odd K's last
// column (the panel's h values after its K2 pairs) is added after the pairs; `fetch`: ask for
// the whole pairs ahead (the first slice's sub-pass; the later ones find them in cache).
template <int MP, int VJ, Read R>
inline void kernel(const bf16* panel, int64_t h, int j0, int n_last, const uint32_t* xp,
                   const float* xl, int64_t K2, int64_t kp0, int64_t kp1, float* c, int64_t ldc,
                   bool first, bool last, bool fetch) {
  const int64_t stride = R == kWhole ? 2 * kPanel : 2 * h;  // elements per pair
  const bf16* w = panel + 2 * L * j0;
  float* cj = c + L * j0;
  v::vec acc[MP][VJ];
  for (int m = 0; m < MP; ++m)
    for (int j = 0; j < VJ; ++j) acc[m][j] = first ? v::zero() : v::load(cj + m * ldc + j * L);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    const bf16* p = w + stride * kp;
    if (fetch) {
      const char* ahead = reinterpret_cast<const char*>(panel + stride * kp) + fetch_ahead(MP);
      for (int64_t b = 0; b < stride * int64_t(sizeof(bf16)); b += 64) v::prefetch_l2(ahead + b);
    }
    v::bpairs wv[VJ];
    for (int j = 0; j < VJ; ++j)
      wv[j] = R == kPartial && j == VJ - 1 ? v::load_pairs_n(p + 2 * L * j, n_last)
                                           : v::load_pairs(p + 2 * L * j);
    const auto* xk = reinterpret_cast<const bf16*>(xp + kp * MP);
    for (int m = 0; m < MP; ++m) {
      const v::bpairs xv = v::bcast_bpair(xk + 2 * m);
      for (int j = 0; j < VJ; ++j) acc[m][j] = v::dot_pairs(acc[m][j], wv[j], xv);
    }
  }
  if (last) {
    const bf16* lw = panel + stride * K2 + L * j0;  // the last column: h values
    v::vec wl[VJ];
    for (int j = 0; j < VJ; ++j) {
      if (R == kPartial && j == VJ - 1) {  // a partial vector: through a zeroed copy
        bf16 pad[L];
        std::fill(pad, pad + L, bf16(0.f));
        std::copy(lw + L * j, lw + L * j + n_last, pad);
        wl[j] = v::load_w(pad);
      } else {
        wl[j] = v::load_w(lw + L * j);
      }
    }
    for (int m = 0; m < MP; ++m) {
      const v::vec xv = v::bcast(xl[m]);
      for (int j = 0; j < VJ; ++j) acc[m][j] = v::fma(wl[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < MP; ++m)
    for (int j = 0; j < VJ; ++j) v::store(cj + m * ldc + j * L, acc[m][j]);
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

// The short last panel's sub-passes of MP rows from vector j0 on (`kernel`'s arguments): its
// ceil(h / L) vectors in slices of VJ, then of powers of two below, the last vector partial
// where L does not divide h.
template <int MP, int VJ>
inline void short_passes(const bf16* panel, int64_t h, int j0, const uint32_t* xp,
                         const float* xl, int64_t K2, int64_t kp0, int64_t kp1, float* c,
                         int64_t ldc, bool first, bool last) {
  const int nv = int((h + L - 1) / L), n_last = int(h - int64_t(nv - 1) * L);
  for (; j0 + VJ <= nv; j0 += VJ) {
    if (j0 + VJ == nv && n_last < L) {
      kernel<MP, VJ, kPartial>(panel, h, j0, n_last, xp, xl, K2, kp0, kp1, c, ldc, first, last,
                               j0 == 0);
    } else {
      kernel<MP, VJ, kShort>(panel, h, j0, L, xp, xl, K2, kp0, kp1, c, ldc, first, last, j0 == 0);
    }
  }
  if constexpr (VJ > 1) {
    if (j0 < nv) short_passes<MP, VJ / 2>(panel, h, j0, xp, xl, K2, kp0, kp1, c, ldc, first, last);
  }
}

// The sub-passes of MP rows over one panel of h rows (`kernel`'s arguments): slices of
// slice_for(MP) vectors of a whole panel, or the short panel's (`short_passes`).
template <int MP>
inline void panel_passes(const bf16* panel, int64_t h, const uint32_t* xp, const float* xl,
                         int64_t K2, int64_t kp0, int64_t kp1, float* c, int64_t ldc, bool first,
                         bool last) {
  constexpr int VJ = slice_for(MP);
  if (h < kPanel) {
    short_passes<MP, VJ>(panel, h, 0, xp, xl, K2, kp0, kp1, c, ldc, first, last);
    return;
  }
  for (int j0 = 0; j0 < VP; j0 += VJ)
    kernel<MP, VJ, kWhole>(panel, h, j0, L, xp, xl, K2, kp0, kp1, c, ldc, first, last, j0 == 0);
}

// Panels [t0, t1) (panel T = N / kPanel the short one, of h = N % kPanel rows) for the M rows of
// `acts` (whose passes start at pass q0) -> y [M, N] rows' columns of those panels, rounded to
// bf16. Where one pass streams it all (`streams`) each panel is read once over the whole of K;
// otherwise the panels go in blocks of TB panels by KP pairs, each block's sums in c until its
// last pair, its sub-passes and passes reading the block from cache.
inline void panels_range(const Acts& acts, int64_t q0, const bf16* w, float* y, int64_t M,
                         int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t T = N / kPanel, K2 = K / 2, ldc = TB * kPanel;
  std::vector<float> c(M * ldc);
  for (int64_t b0 = t0; b0 < t1; b0 += TB) {
    const int64_t b1 = std::min(t1, b0 + TB);
    const int64_t kp_block = streams(M) && b1 <= T ? std::max<int64_t>(K2, 1) : KP;
    for (int64_t kp0 = 0;; kp0 += kp_block) {
      const int64_t kp1 = std::min(K2, kp0 + kp_block);
      const bool first = kp0 == 0, last = kp1 == K2 && K % 2;
      for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
        const uint32_t* xp = acts.pairs.data() + (q0 + m0 / kPassRows) * K2 * kPassRows;
        const float* xl = acts.last.data() + q0 * kPassRows + m0;
        with_rows(std::min<int64_t>(kPassRows, M - m0), [&](auto rows) {
          constexpr int MP = decltype(rows)::value;
          for (int64_t t = b0; t < b1; ++t) {
            const int64_t h = t < T ? kPanel : N - T * kPanel;
            float* cm = c.data() + m0 * ldc + (t - b0) * kPanel;
            panel_passes<MP>(w + t * kPanel * K, h, xp, xl, K2, kp0, kp1, cm, ldc, first, last);
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
// panels (about 64 KB of weights per task at least), or the passes of x where the panels are
// too few to share. Nested inside another at::parallel_for it runs on the calling thread.
inline void linear_into(const float* x, const bf16* w, float* y, int64_t M, int64_t N,
                        int64_t K) {
  if (M == 0 || N == 0) return;
  const Acts acts = pack_acts(x, M, K);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  if (panels < 2 * at::get_num_threads() && M >= 4 * kPassRows) {
    const int64_t passes = (M + kPassRows - 1) / kPassRows;
    at::parallel_for(0, passes, 1, [&](int64_t q0, int64_t q1) {
      const int64_t m0 = q0 * kPassRows, m1 = std::min(M, q1 * kPassRows);
      panels_range(acts, q0, w, y + m0 * N, m1 - m0, N, K, 0, panels);
    });
    return;
  }
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, kPanel * K * 2));
  at::parallel_for(0, panels, grain, [&](int64_t t0, int64_t t1) {
    panels_range(acts, 0, w, y, M, N, K, t0, t1);
  });
}

}  // namespace hs::bpanel
