// GEMM for prefill-sized row counts: y [M, N] = x [M, K] w [N, K]^T, fp32 activations, fp32 or
// bf16 weights, fp32 accumulation; `packed_linear` (kernels/linear_cpp.py calls it beyond the
// decode GEMM's rows).
//
// The classic blocked GEMM with both operands packed per call: for each KC-deep slice of k, a
// thread packs its weight rows into slivers of NR = 2 vectors of rows (16 with AVX2, 32 with
// AVX-512: simd.h), k-major ([k][NR], bf16 widened here, once per call rather than in the inner
// loop), and the rows of x, MC at a time, into slivers of MR rows ([k][MR]). The register tile
// is MR rows of x by NR weight rows: each k step loads one weight sliver row (two vectors, from
// L1), broadcasts MR x values (from L2) and does 2 MR FMAs into 2 MR accumulators; MR = 12 with
// AVX-512's 32 registers, 6 with AVX2's 16. Every run of KR = 32 k steps is summed from zero in
// registers and then added to y: gemm.cpp's order exactly, so the two GEMMs give bit-identical
// outputs and a row's result does not depend on which of them its batch's row count picked.
// Threads split the weight rows (or, for a handful of weight rows, the rows of x), each with its
// own packed buffers.
//
// Unlike gemm.cpp's decode GEMM, which reads the weight as stored and broadcasts it, this one
// pays a pack of the weight per call, which M rows of x amortise: it is for hundreds of rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "decode_ops.h"
#include "gemv.h"
#include "simd.h"

namespace {

#if defined(__AVX512F__) && defined(HS_AVX2)
#define HS_TWELVE_ROWS 1  // 32 vector registers: 24 accumulators
constexpr int64_t MR = 12;    // rows of x per register tile
#else
constexpr int64_t MR = 6;     // rows of x per register tile (16 registers: 12 accumulators)
#endif
constexpr int64_t NR = 2 * hs::simd::kLanes;  // weight rows per register tile (16; 32 AVX-512)
constexpr int64_t KC = 256;   // k per packed slice
constexpr int64_t MC = 120;   // rows of x per packed block (L2)
constexpr int64_t NC = 2048;  // weight rows per packed block (L3)

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;

Buffer buffer(int64_t n) {
  const size_t bytes = (size_t(n) * sizeof(float) + 63) / 64 * 64;
  return Buffer(static_cast<float*>(std::aligned_alloc(64, bytes)));
}

// Rows [r0, r0 + rows) of a row-major matrix (row stride ld), columns [k0, k0 + kn) -> slivers
// of S rows, k-major: out [ceil(rows / S)][kn][S] in fp32 (bf16 widened), rows past the end zero.
// The weights pack in slivers of NR rows, x in slivers of MR.
template <int64_t S, typename T>
void pack(const T* src, int64_t ld, int64_t r0, int64_t rows, int64_t k0, int64_t kn,
          float* out) {
  for (int64_t s = 0; s * S < rows; ++s) {
    float* dst = out + s * kn * S;
    const int64_t r = std::min(S, rows - s * S);
    for (int64_t i = 0; i < r; ++i) {
      const T* row = src + (r0 + s * S + i) * ld + k0;
      for (int64_t k = 0; k < kn; ++k) dst[k * S + i] = hs::load1(row + k);
    }
    for (int64_t i = r; i < S; ++i)
      for (int64_t k = 0; k < kn; ++k) dst[k * S + i] = 0.f;
  }
}

// y[0:mr, 0:nr] (row stride ldy) (+)= the 6 x NR product of one x sliver and one weight sliver
// over kn k steps, summed in runs of KR from zero in registers, each run then added to y (`first`:
// the first run is stored): the tiled GEMM's order (gemm.cpp `tile`), so both give every output
// bit for bit alike.
constexpr int64_t KR = 32;
static_assert(KC % KR == 0, "runs of KR k steps start at multiples of KR, as gemm.cpp's do");

inline void kernel(const float* xs, const float* ws, int64_t kn, float* y, int64_t ldy, int64_t mr,
                   int64_t nr, bool first) {
#ifdef HS_SIMD
  namespace v = hs::simd;
  using v::vec;
  for (int64_t i = 0; i < mr; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(y + i * ldy), _MM_HINT_T0);
#endif
  for (int64_t k0 = 0; k0 < kn; k0 += KR) {
    const int64_t k1 = std::min(kn, k0 + KR);
    const bool store = first && k0 == 0;
#ifdef HS_SIMD
    // named accumulators (2 MR): as an array GCC keeps a copy in memory, stored every k step
    vec c00 = v::zero(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    vec c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#ifdef HS_TWELVE_ROWS
    vec c60 = c00, c61 = c00, c70 = c00, c71 = c00, c80 = c00, c81 = c00;
    vec c90 = c00, c91 = c00, ca0 = c00, ca1 = c00, cb0 = c00, cb1 = c00;
#endif
#pragma GCC unroll 4
    for (int64_t k = k0; k < k1; ++k) {
      const vec w0 = v::load_aligned(ws + k * NR), w1 = v::load_aligned(ws + k * NR + v::kLanes);
      const float* a = xs + k * MR;
      // row i of the tile: x[i][k] broadcast against the sliver's NR weights
#define HS_TILE_ROW(i, lo, hi)                         \
  {                                                    \
    const vec b = v::bcast(a[i]);                      \
    lo = v::fma(b, w0, lo);                            \
    hi = v::fma(b, w1, hi);                            \
  }
      HS_TILE_ROW(0, c00, c01)
      HS_TILE_ROW(1, c10, c11)
      HS_TILE_ROW(2, c20, c21)
      HS_TILE_ROW(3, c30, c31)
      HS_TILE_ROW(4, c40, c41)
      HS_TILE_ROW(5, c50, c51)
#ifdef HS_TWELVE_ROWS
      HS_TILE_ROW(6, c60, c61)
      HS_TILE_ROW(7, c70, c71)
      HS_TILE_ROW(8, c80, c81)
      HS_TILE_ROW(9, c90, c91)
      HS_TILE_ROW(10, ca0, ca1)
      HS_TILE_ROW(11, cb0, cb1)
#endif
#undef HS_TILE_ROW
    }
    const vec acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51},
#ifdef HS_TWELVE_ROWS
                            {c60, c61}, {c70, c71}, {c80, c81}, {c90, c91}, {ca0, ca1}, {cb0, cb1}
#endif
    };
    if (mr == MR && nr == NR) {
      for (int i = 0; i < MR; ++i) {
        float* yp = y + i * ldy;
        float* yq = yp + v::kLanes;
        v::store(yp, store ? acc[i][0] : v::add(v::load(yp), acc[i][0]));
        v::store(yq, store ? acc[i][1] : v::add(v::load(yq), acc[i][1]));
      }
      continue;
    }
    alignas(64) float c[MR][NR];
    for (int i = 0; i < MR; ++i) {
      v::store_aligned(c[i], acc[i][0]);
      v::store_aligned(c[i] + v::kLanes, acc[i][1]);
    }
#else
    float c[MR][NR] = {};
    for (int64_t k = k0; k < k1; ++k)
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) c[i][j] = std::fma(xs[k * MR + i], ws[k * NR + j], c[i][j]);
#endif
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nr; ++j)
        y[i * ldy + j] = store ? c[i][j] : y[i * ldy + j] + c[i][j];
  }
}

// y rows [m0, m1) x columns [n0, n1) on the calling thread, with its own packed buffers.
template <typename W>
void gemm_block(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t m0,
                int64_t m1, int64_t n0, int64_t n1) {
  const int64_t nc_max = std::min(NC, (n1 - n0 + NR - 1) / NR * NR);
  const int64_t mc_max = std::min(MC, (m1 - m0 + MR - 1) / MR * MR);
  const Buffer wp = buffer(nc_max * KC), xp = buffer(mc_max * KC);
  for (int64_t jc = n0; jc < n1; jc += NC) {
    const int64_t nc = std::min(NC, n1 - jc);
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kn = std::min(KC, K - pc);
      pack<NR>(w, K, jc, nc, pc, kn, wp.get());
      for (int64_t ic = m0; ic < m1; ic += MC) {
        const int64_t mc = std::min(MC, m1 - ic);
        pack<MR>(x, K, ic, mc, pc, kn, xp.get());
        for (int64_t jr = 0; jr < nc; jr += NR) {
          const float* ws = wp.get() + jr * kn;
          for (int64_t ir = 0; ir < mc; ir += MR) {
            kernel(xp.get() + ir * kn, ws, kn, y + (ic + ir) * N + jc + jr, N,
                   std::min(MR, mc - ir), std::min(NR, nc - jr), pc == 0);
          }
        }
      }
    }
  }
}

template <typename W>
void packed_gemm(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::fill_n(y, M * N, 0.f);
    return;
  }
  const int64_t threads = at::get_num_threads();
  const int64_t slivers = (N + NR - 1) / NR;
  if (slivers >= 2 * threads) {  // split the weight rows, in whole slivers
    at::parallel_for(0, slivers, 1, [&](int64_t s0, int64_t s1) {
      gemm_block(x, w, y, N, K, 0, M, s0 * NR, std::min(N, s1 * NR));
    });
  } else {  // a few weight rows: split the rows of x, in whole slivers
    at::parallel_for(0, (M + MR - 1) / MR, 1, [&](int64_t s0, int64_t s1) {
      gemm_block(x, w, y, N, K, s0 * MR, std::min(M, s1 * MR), 0, N);
    });
  }
}

// x [M, K] fp32, w [N, K] fp32 or bf16 -> y [M, N] fp32.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w) {
  return hs::linear_op("packed_linear", x, w,
                       [](const float* xp, auto* wp, float* yp, int64_t M, int64_t N, int64_t K) {
                         packed_gemm(xp, wp, yp, M, N, K);
                       });
}

}  // namespace

namespace hs {

void packed_cols(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t M,
                 int64_t n0, int64_t n1) {
  gemm_block(x, w, y, N, K, 0, M, n0, n1);
}

void packed_cols(const float* x, const at::BFloat16* w, float* y, int64_t N, int64_t K,
                 int64_t M, int64_t n0, int64_t n1) {
  gemm_block(x, w, y, N, K, 0, M, n0, n1);
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) { m.def("packed_linear(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) { m.impl("packed_linear", &packed_linear); }
