// AMX-BF16 tile primitives for the bf16 GEMMs (gemm_amx.cpp: dense; gemm.cpp: routed experts).
//
// One TDPBF16PS multiplies a 16 x 32 tile of bf16 x by a 32 x 16 tile of bf16 weights into a
// 16 x 16 tile of fp32 sums; the products are exact and each output's sum involves its own row
// of x only, so a row's result depends neither on its batch nor on the rows beside it. x comes in
// as fp32 and is rounded to bf16 (nearest even) once: the one change of arithmetic against the
// AVX GEMMs (gemm.cpp), which keep x in fp32. Measured: benchmarks/bf16_fidelity.py.
//
// `cols` keeps 4 accumulator tiles (tmm0-3: two 16-row blocks of x by two of weight rows), two of
// x (tmm4-5, loaded straight from the bf16 copy) and two of weights (tmm6-7) in the tile unit's
// pair-interleaved layout: for weight rows n..n+15 and columns k..k+31, tile row r holds
// (w[n', k + 2r], w[n', k + 2r + 1]) for each n', a 16 x 16 transpose of 4-byte pairs done in
// registers as the weights stream in. NC weight rows are transposed at a time (~384 KB at
// K = 768, in L2), then every 32-row block of x passes over them. Up to kFewRows rows of x,
// `cols_few` swaps the roles instead (x transposed, the weights read as stored), which skips
// transposing weights that only one or two blocks of x would use; both give the same bits. The
// weights stay the model's own [N, K] tensors: nothing is packed ahead of time.
//
// Compiled where the compiler targets AMX-BF16 and AVX512-BF16 (`-march=native` on such a CPU);
// the OS must also grant the tile state (`hs::amx_ready`).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HS_AMX 1
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "prefetch.h"

namespace hs::amx {

constexpr int64_t TK = 32;   // bf16 per tile row (64 bytes)
constexpr int64_t TR = 16;   // rows per tile
constexpr int64_t NC = 256;  // weight rows transposed at a time

using bf16 = c10::BFloat16;

// Every tile 16 rows x 64 bytes. The tile state is per thread: each task configures it.
inline void configure() {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = TR;
  }
  _tile_loadconfig(&c);
}
inline void release() { _tile_release(); }

// Rows are padded to whole 16-row tiles (the padding is read, never stored).
inline int64_t padded(int64_t rows) { return (rows + TR - 1) / TR * TR; }

// x [rows, K] fp32 (row stride ldx) -> xb [rows, K] bf16, nearest even; K % 32 == 0.
inline void convert_rows(const float* x, int64_t ldx, int64_t rows, int64_t K, bf16* xb) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; k += TK) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * ldx + k + 16),
                                             _mm512_loadu_ps(x + r * ldx + k));
      _mm512_storeu_si512(xb + r * K + k, reinterpret_cast<const __m512i&>(v));
    }
}

// 16 x 16 transpose of 4-byte elements held in 16 vectors, in place.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows 4q..4q+3 gather their four lanes
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Rows n..n+15 of a [*, K] bf16 matrix -> wp [K / 32][16][32] in the pair layout of right tiles.
inline void pair_tiles(const bf16* w, int64_t K, int64_t n, bf16* wp) {
  for (int64_t kb = 0; kb < K / TK; ++kb) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(w + (n + i) * K + kb * TK);
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(wp + (kb * 16 + i) * TK, r[i]);
  }
}

// Stores accumulator tile t (an instruction immediate, hence the switch) to dst, row stride ld
// bytes.
inline void store_acc(int t, float* dst, int64_t ld) {
  switch (t) {
    case 0: _tile_stored(0, dst, ld); break;
    case 1: _tile_stored(1, dst, ld); break;
    case 2: _tile_stored(2, dst, ld); break;
    default: _tile_stored(3, dst, ld); break;
  }
}

// Stores accumulator tile t, a block of y (rows m0.., columns n..n+15, row stride ldy), keeping
// rows below M.
inline void store_tile(int t, float* y, int64_t ldy, int64_t m0, int64_t M, int64_t n) {
  alignas(64) float buf[TR * 16];
  const bool whole = m0 + TR <= M;
  store_acc(t, whole ? y + m0 * ldy + n : buf, (whole ? ldy : 16) * int64_t(sizeof(float)));
  if (!whole)
    for (int64_t i = 0; m0 + i < M; ++i) std::memcpy(y + (m0 + i) * ldy + n, buf + i * 16, 64);
}

// Stores accumulator tile t, a block of y^T (columns n..n+15 of y by rows m0..), transposed,
// keeping rows below M.
inline void store_tile_t(int t, float* y, int64_t ldy, int64_t m0, int64_t M, int64_t n) {
  alignas(64) float buf[TR * 16];
  store_acc(t, buf, 64);
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(buf + i * 16);
  transpose16(r);
  for (int64_t i = 0; i < 16 && m0 + i < M; ++i)
    _mm512_storeu_si512(y + (m0 + i) * ldy + n, r[i]);
}

// The four accumulators over kbs steps of 32 k: tmm0 = a0 b0, tmm1 = a0 b1, tmm2 = a1 b0,
// tmm3 = a1 b1, for left tiles a0, a1 (16 rows, row stride lda bytes, 32 k per step) and right
// tiles b0, b1 in the pair layout ([kbs][16][32]); a1 or b1 null leaves its products at zero.
// `fetch` (or null) steps once per k step.
inline void accumulate(const bf16* a0, const bf16* a1, int64_t lda, const bf16* b0,
                       const bf16* b1, int64_t kbs, hs::Fetch* fetch = nullptr) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < kbs; ++kb) {
    if (fetch != nullptr) fetch->step();
    _tile_loadd(4, a0 + kb * TK, lda);
    _tile_loadd(6, b0 + kb * TR * TK, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (b1 != nullptr) {
      _tile_loadd(7, b1 + kb * TR * TK, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (a1 != nullptr) {
      _tile_loadd(5, a1 + kb * TK, lda);
      _tile_dpbf16ps(2, 5, 6);
      if (b1 != nullptr) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// Room for NC transposed weight rows of K columns, per thread.
inline bf16* weight_scratch(int64_t K) {
  thread_local std::vector<bf16> buf;
  if (int64_t(buf.size()) < NC * K) buf.resize(NC * K);
  return buf.data();
}

// Columns [n0, n1) of y [M, ldy] = xb w^T on the calling thread, tiles configured: xb the bf16
// rows of x [padded(M), K], w [*, K] bf16 row-major; n0, n1 multiples of 16, K of 32.
inline void cols(const bf16* xb, int64_t M, int64_t K, const bf16* w, float* y, int64_t ldy,
                 int64_t n0, int64_t n1) {
  const int64_t kbs = K / TK, ldx = K * int64_t(sizeof(bf16)), block = kbs * TR * TK;
  bf16* wp = weight_scratch(K);
  for (int64_t c0 = n0; c0 < n1; c0 += NC) {
    const int64_t c1 = std::min(n1, c0 + NC);
    for (int64_t n = c0; n < c1; n += TR) pair_tiles(w, K, n, wp + (n - c0) / TR * block);
    for (int64_t m0 = 0; m0 < M; m0 += 2 * TR) {
      const bool pair = m0 + TR < M;
      for (int64_t n = c0; n < c1; n += 2 * TR) {
        const bool two = n + TR < c1;
        const bf16* w0 = wp + (n - c0) / TR * block;
        accumulate(xb + m0 * K, pair ? xb + (m0 + TR) * K : nullptr, ldx, w0,
                   two ? w0 + block : nullptr, kbs);
        store_tile(0, y, ldy, m0, M, n);
        if (two) store_tile(1, y, ldy, m0, M, n + TR);
        if (pair) {
          store_tile(2, y, ldy, m0 + TR, M, n);
          if (two) store_tile(3, y, ldy, m0 + TR, M, n + TR);
        }
      }
    }
  }
}

// ---- few rows of x (decode batches, a decode step's experts) ------------------------------
// There `cols` would transpose every weight for one or two blocks of x. Here the roles swap so
// that nothing but x is transposed: the weights are the left tiles, loaded straight from w (16
// rows x 32 k, row stride K); x is the right operand, its rows in the pair layout (`pack_rows`,
// once per call); each accumulator holds a 16 x 16 block of y^T, transposed as it is stored.
// The tile unit sums each output's products in the same order either way, so the two paths
// give the same bits (tests/kernels/test_cpp_amx.py).
// Up to here `cols_few`, beyond `cols`: where, on the small preset's shapes, transposing each
// weight block once starts to pay for the blocks of x that reuse it.
constexpr int64_t kFewRows = 128;
inline bool few(int64_t M) { return M <= kFewRows; }

// xb [padded(M), K] bf16 rows -> xt [padded(M) / 16][K / 32][16][32], 16 rows at a time.
inline void pack_rows(const bf16* xb, int64_t M, int64_t K, bf16* xt) {
  for (int64_t m = 0; m < padded(M); m += TR) pair_tiles(xb, K, m, xt + m * K);
}

// `cols` for x given as xt (pack_rows of M rows): columns [n0, n1) of y [M, ldy] on the calling
// thread, tiles configured.
inline void cols_few(const bf16* xt, int64_t M, int64_t K, const bf16* w, float* y, int64_t ldy,
                     int64_t n0, int64_t n1) {
  const int64_t kbs = K / TK, ldw = K * int64_t(sizeof(bf16)), block = kbs * TR * TK;
  const int64_t passes = (M + 2 * TR - 1) / (2 * TR);  // over each block of 32 weight rows
  for (int64_t n = n0; n < n1; n += 2 * TR) {
    const bool two = n + TR < n1;
    // The next block's weights into L2 over this block's passes (the calling thread's columns
    // only; prefetch.h): the left tiles read 64 bytes from each of 32 rows at a time, runs too
    // short for the hardware prefetchers, and without it the tile unit waits on memory.
    hs::Fetch next;
    if (n + 2 * TR < n1)
      next = hs::Fetch(w + (n + 2 * TR) * K, std::min(2 * TR, n1 - n - 2 * TR), ldw, ldw,
                       passes * kbs);
    for (int64_t m0 = 0; m0 < M; m0 += 2 * TR) {
      const bool pair = m0 + TR < M;
      const bf16* x0 = xt + m0 / TR * block;
      accumulate(w + n * K, two ? w + (n + TR) * K : nullptr, ldw, x0,
                 pair ? x0 + block : nullptr, kbs, &next);
      store_tile_t(0, y, ldy, m0, M, n);
      if (pair) store_tile_t(1, y, ldy, m0 + TR, M, n);
      if (two) {
        store_tile_t(2, y, ldy, m0, M, n + TR);
        if (pair) store_tile_t(3, y, ldy, m0 + TR, M, n + TR);
      }
    }
  }
}

// Columns [n0, n1) of y = x w^T by whichever path M picks: x given as its bf16 rows (`cols`) or,
// for few(M) rows, as pack_rows of them (`cols_few`).
inline void any_cols(const bf16* x, int64_t M, int64_t K, const bf16* w, float* y, int64_t ldy,
                     int64_t n0, int64_t n1) {
  if (few(M)) return cols_few(x, M, K, w, y, ldy, n0, n1);
  cols(x, M, K, w, y, ldy, n0, n1);
}

}  // namespace hs::amx
#endif
