// The tiled integer GEMM: y [M, N] = x [M, K] w [N, K]^T for int8 and int4 weights (weights.h)
// past the GEMV's 8 rows (decode_ops.h's `linear`, gemm.h's `gemm_into`), in integer dot
// products (simd.h's `dot_acc` / `dotu_acc`: AVX2 maddubs/madd, VNNI vpdpbusd, NEON sdot).
//
// The activations are rounded per block of kActBlock = 32 along k as the GEMV's are (qgemv.h's
// `quantize_rows`: the same int8 values q and scales d), and every output is
//
//   y[m, n] = r_n * (((I_0 s_0 + 0) + I_1 s_1) + ... + I_{B-1} s_{B-1})   (each step one fma),
//
// I_b the exact integer dot product of block b's weight values (int8 q, or int4 nibble - 8) and
// rounded activations, s_b the block's activation scale d[m, b] (int8; r_n the row's scale) or
// the fp32 product scale[n, b] * d[m, b] (int4; r_n = 1). These are the GEMV's integers, scales
// and steps in the GEMV's order (qgemv.h), so a row's result is the same bits in both. An output
// depends only on its row of x and its weight row: the same bits whatever M, the row's place in
// the batch and the ISA level (the integers are exact, and each fp32 step is one rounding at
// every level).
//
// Layout. x is rounded and packed once per call into panels of MR = 2 kLanes rows (16 with
// AVX2, 32 with AVX-512), per block the bytes [8 quads of k][MR rows][4], so one 4-byte
// broadcast of a weight row's quad against a panel vector gives kLanes rows' partial dots; rows
// past M are zero. The weights are read where they lie, in the one layout the GEMV reads
// (weights.h, `Rows`): a register tile of R <= NR weight rows (NR = 8 with AVX-512, a whole
// weight tile; 4 elsewhere, half of one; or rows of the row-order rest) broadcasts each row's
// quad straight from its tile (int4: the 4 bytes' low and high nibbles, two quads of k per
// load), against one panel (J = 2 vectors of rows, 1 for a last panel of at most kLanes rows):
// R x J int32 accumulators per block, then scaled into the fp32 sums (cbuf). A block of NC
// weight rows by KC columns stays in L1/L2 while up to PC panels pass over it.
//
// The unsigned operand. int4 nibbles are already unsigned (0..15): dotu_acc(nibbles, q) and
// the block's sum starts at -8 sum(q). int8 bytes plus 128 (`flip`) are unsigned too, and with
// VNNI (simd::kDotU8) they take the same path, the sum starting at -128 sum(q): one
// instruction per 4 x kLanes products. Without it (AVX2's maddubs pairs would saturate) int8
// takes the signed dot_acc. The integers are the same either way.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "qgemv.h"
#include "simd.h"
#include "weights.h"

namespace hs::qtiled {

namespace v = hs::simd;
constexpr int L = v::kLanes;       // rows per vector
constexpr int MR = 2 * L;          // rows per panel
constexpr int NR = L >= 16 ? 8 : 4;  // weight rows per register tile (AVX2 has 16 registers)
static_assert(kTile % NR == 0, "a register tile lies in one weight tile");
constexpr int64_t KC = 256;        // k per cache block (a multiple of kActBlock)
constexpr int64_t KB = KC / kActBlock;
constexpr int64_t NC = 48;         // weight rows per cache block (a multiple of kTile)
constexpr int64_t PC = 4;          // panels per m block
constexpr int64_t kPanelBlock = kActBlock * MR;  // bytes per panel per block

// How a format meets the dot: int4 and (with VNNI) int8 as unsigned bytes offset by 8 / 128,
// else int8 signed.
enum class Form { q4, q8_offset, q8_signed };
template <typename W>
constexpr Form form_of = std::is_same_v<W, uint8_t> ? Form::q4
                         : v::kDotU8               ? Form::q8_offset
                                                   : Form::q8_signed;
constexpr int32_t offset_of(Form f) { return f == Form::q4 ? 8 : f == Form::q8_offset ? 128 : 0; }

inline int64_t panels(int64_t M) { return (M + MR - 1) / MR; }

// x rounded and packed: panel p, block b at q + (p B + b) kPanelBlock (lane l's quad j at
// (j MR + l) 4), its scales at d + (p B + b) MR, and the sums' starts -offset sum(q) at c.
struct Panels {
  int64_t P = 0, B = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> c;
};

// x [M, K] -> its panels, each row rounded as `quantize_rows` does (`quantize_block`), the
// panels in parallel.
inline void pack_acts(const float* x, int64_t M, int64_t K, int32_t offset, Panels& out) {
  const int64_t B = act_blocks(K);
  out.P = panels(M);
  out.B = B;
  out.q.assign(out.P * B * kPanelBlock, 0);
  out.d.assign(out.P * B * MR, 0.f);
  out.c.assign(out.P * B * MR, 0);
  at::parallel_for(0, out.P, 1, [&](int64_t p0, int64_t p1) {
    int8_t q[kActBlock];
    for (int64_t m = p0 * MR; m < std::min(M, p1 * MR); ++m) {
      const int64_t p = m / MR, l = m % MR;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t k0 = b * kActBlock, n = std::min(kActBlock, K - k0), at = p * B + b;
        out.d[at * MR + l] = quantize_block(x + m * K + k0, n, q);
        int8_t* dst = out.q.data() + at * kPanelBlock + l * 4;
        int32_t sum = 0;
        for (int64_t t = 0; t < n; ++t) {
          dst[(t / 4) * MR * 4 + t % 4] = q[t];
          sum += q[t];
        }
        out.c[at * MR + l] = -offset * sum;
      }
    }
  });
}

// Where a register tile reads its weight rows (all in one weight tile, or all in row order):
// row r's quad j (4 bytes) of block b at base + r row + b block + j quad (int4: j < 4, its low
// nibbles quad j, its high ones quad j + 4); an int8 matrix's short last block at rest +
// r rest_row + 4 j; row r's scale at scales + r srow + b sblock (int4: bf16, one per block;
// int8: fp32, one per row).
struct Rows {
  const int8_t* base;
  int64_t row, block, quad;
  const int8_t* rest;
  int64_t rest_row;
  const uint8_t* scales;
  int64_t srow, sblock;
};

template <typename W>
inline Rows rows_at(const W* w, int64_t N, int64_t K, int64_t n) {
  const auto* p = reinterpret_cast<const int8_t*>(w);
  const auto* u = reinterpret_cast<const uint8_t*>(w);
  const int64_t S = row_stride<W>(K), r = n % kTile, tile = (n - r) * S;
  if constexpr (std::is_same_v<W, uint8_t>) {
    if (n < tiled_rows(N))
      return {p + tile + 4 * r, 4, kQ4Block, 32, nullptr, 0, u + tile + 128 + 2 * r, 2, kQ4Block};
    return {p + n * S, S, kQ4Group / 2, 4, nullptr, 0, u + n * S + K / 2, S, 2};
  } else {
    const int64_t full = K / kActBlock * kActBlock, t = K - full;
    if (n < tiled_rows(N))
      return {p + tile + 4 * r, 4, kQ8Block, 32, p + tile + kTile * full + r * t, t,
              u + tile + kTile * K + kScaleBytes * r, kScaleBytes, 0};
    return {p + n * S, S, kActBlock, 4, p + n * S + full, S, u + n * S + K, S, 0};
  }
}

// c [R][MR] (+)= blocks [b0, b0 + nb) of R weight rows `w` by one panel's (a: its bytes from
// block b0 on, ad its scales, ac its sums' starts); the first J kLanes rows of the panel.
// `short_quads` < 8: the last of the blocks is an int8 matrix's short one, that many quads (its
// activations past K are zero). `first`: c starts at zero.
template <Form F, int R, int J>
inline void tile(const Rows& w, int64_t b0, int64_t nb, int short_quads, const int8_t* a,
                 const float* ad, const int32_t* ac, float* c, bool first) {
  for (int64_t bb = 0; bb < nb; ++bb) {
    const int64_t b = b0 + bb;
    const int8_t* ab = a + bb * kPanelBlock;
    v::ivec acc[R][J];
    for (int j = 0; j < J; ++j) {
      v::ivec start = v::zero_i();
      if constexpr (F != Form::q8_signed) start = v::load_i(ac + bb * MR + j * L);
      for (int r = 0; r < R; ++r) acc[r][j] = start;
    }
    if constexpr (F == Form::q4) {
      for (int q = 0; q < 4; ++q) {
        v::bvec lo[J], hi[J];
        for (int j = 0; j < J; ++j) {
          lo[j] = v::load_b(ab + (q * MR + j * L) * 4);
          hi[j] = v::load_b(ab + ((q + 4) * MR + j * L) * 4);
        }
        for (int r = 0; r < R; ++r) {
          const v::bvec raw = v::bcast4(w.base + r * w.row + b * w.block + q * w.quad);
          const v::bvec wl = v::nib_lo(raw), wh = v::nib_hi(raw);
          for (int j = 0; j < J; ++j) acc[r][j] = v::dotu_acc(acc[r][j], wl, lo[j]);
          for (int j = 0; j < J; ++j) acc[r][j] = v::dotu_acc(acc[r][j], wh, hi[j]);
        }
      }
    } else {
      const bool rest = bb == nb - 1 && short_quads < 8;
      const int quads = rest ? short_quads : 8;
      for (int q = 0; q < quads; ++q) {
        v::bvec av[J];
        for (int j = 0; j < J; ++j) av[j] = v::load_b(ab + (q * MR + j * L) * 4);
        for (int r = 0; r < R; ++r) {
          const int8_t* src = rest ? w.rest + r * w.rest_row + 4 * q
                                   : w.base + r * w.row + b * w.block + q * w.quad;
          v::bvec wv = v::bcast4(src);
          if constexpr (F == Form::q8_offset) wv = v::flip(wv);
          for (int j = 0; j < J; ++j) {
            if constexpr (F == Form::q8_signed) {
              acc[r][j] = v::dot_acc(acc[r][j], wv, av[j]);
            } else {
              acc[r][j] = v::dotu_acc(acc[r][j], wv, av[j]);
            }
          }
        }
      }
    }
    const bool zero = first && bb == 0;
    for (int j = 0; j < J; ++j) {
      const v::vec d = v::load(ad + bb * MR + j * L);
      for (int r = 0; r < R; ++r) {
        v::vec s = d;
        if constexpr (F == Form::q4) {
          const uint8_t* sc = w.scales + r * w.srow + b * w.sblock;
          s = v::mul(v::bcast(load1(reinterpret_cast<const c10::BFloat16*>(sc))), d);
        }
        float* cp = c + r * MR + j * L;
        v::store(cp, v::fma(v::to_vec(acc[r][j]), s, zero ? v::zero() : v::load(cp)));
      }
    }
  }
}

template <Form F, int J>
inline void tile_rows(int r, const Rows& w, int64_t b0, int64_t nb, int short_quads,
                      const int8_t* a, const float* ad, const int32_t* ac, float* c, bool first) {
  static_assert(NR == 4 || NR == 8, "tile_rows lists the row counts 1..8");
#define HS_TILE(R) tile<F, R, J>(w, b0, nb, short_quads, a, ad, ac, c, first)
  if constexpr (NR == 8) {
    switch (r) {
      case 8: return HS_TILE(8);
      case 7: return HS_TILE(7);
      case 6: return HS_TILE(6);
      case 5: return HS_TILE(5);
      default: break;
    }
  }
  switch (r) {
    case 4: return HS_TILE(4);
    case 3: return HS_TILE(3);
    case 2: return HS_TILE(2);
    default: return HS_TILE(1);
  }
#undef HS_TILE
}

// Output columns [n0, n1) of y [M, ldy] on the calling thread, w of N rows: x given as panels
// [p_first, p_first + panels(M)) of `xp` (y at their first row).
template <typename W>
inline void gemm_cols(const Panels& xp, int64_t p_first, const W* w, int64_t N, float* y,
                      int64_t ldy, int64_t M, int64_t K, int64_t n0, int64_t n1) {
  constexpr Form F = form_of<W>;
  alignas(64) float cbuf[NC / NR * PC * NR * MR];  // [tile][panel][NR][MR]
  const int64_t P = panels(M), B = xp.B, full = K / kActBlock;
  const int short_quads = K % kActBlock ? int((K % kActBlock + 3) / 4) : 8;
  for (int64_t b0 = n0; b0 < n1; b0 += NC) {
    const int64_t b1 = std::min(n1, b0 + NC), tiles = (b1 - b0 + NR - 1) / NR;
    for (int64_t p0 = 0; p0 < P; p0 += PC) {
      const int64_t p1 = std::min(P, p0 + PC);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kb = k0 / kActBlock, nb = std::min(KB, B - kb);
        const int quads = kb + nb > full ? short_quads : 8;
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t at = (p_first + p) * B + kb;
          const int8_t* a = xp.q.data() + at * kPanelBlock;
          const float* ad = xp.d.data() + at * MR;
          const int32_t* ac = xp.c.data() + at * MR;
          const bool half = M - p * MR <= L;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t n = b0 + t * NR;
            const int r = int(std::min<int64_t>(NR, b1 - n));
            const Rows rw = rows_at(w, N, K, n);
            float* c = cbuf + (t * PC + (p - p0)) * NR * MR;
            if (half) {
              tile_rows<F, 1>(r, rw, kb, nb, quads, a, ad, ac, c, k0 == 0);
            } else {
              tile_rows<F, 2>(r, rw, kb, nb, quads, a, ad, ac, c, k0 == 0);
            }
          }
        }
      }
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n = b0 + t * NR, r = std::min<int64_t>(NR, b1 - n);
        for (int64_t p = p0; p < p1; ++p) {
          const float* c = cbuf + (t * PC + (p - p0)) * NR * MR;
          const int64_t rows = std::min<int64_t>(MR, M - p * MR);
          for (int64_t i = 0; i < r; ++i) {
            float scale = 1.f;  // int4: the group scales are in the sums
            if constexpr (F != Form::q4) scale = q8_row_scale(w, N, K, n + i);
            for (int64_t l = 0; l < rows; ++l) {
              float& out = y[(p * MR + l) * ldy + n + i];
              if constexpr (F == Form::q4) {
                out = c[i * MR + l];
              } else {
                out = c[i * MR + l] * scale;
              }
            }
          }
        }
      }
    }
  }
}

// y [M, N] = x [M, K] w [N, K]^T, all contiguous, parallel over weight rows (over panels of x
// when the weight has too few rows to share).
template <typename W>
inline void gemm_into(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M == 0 || N == 0) return;
  Panels xp;
  pack_acts(x, M, K, offset_of(form_of<W>), xp);
  const int64_t ldw = row_stride<W>(K), tiles = (N + NR - 1) / NR, P = xp.P;
  if (tiles < 2 * at::get_num_threads() && P >= 2) {
    at::parallel_for(0, P, 1, [&](int64_t q0, int64_t q1) {
      const int64_t m0 = q0 * MR, m1 = std::min(M, q1 * MR);
      gemm_cols(xp, q0, w, N, y + m0 * N, N, m1 - m0, K, 0, N);
    });
    return;
  }
  // at least ~32 KB of weights per task, in whole tiles
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, ldw * NR));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    gemm_cols(xp, 0, w, N, y, N, M, K, t0 * NR, std::min(N, t1 * NR));
  });
}

}  // namespace hs::qtiled
