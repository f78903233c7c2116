// The weight formats the CPU products read (fp32, bf16, and the quantized int8 and int4 of
// kernels/quant.py) and the helpers the GEMVs share (gemv.h, qgemv.h). No tensors here (the
// tensor-side helpers are in tensor_args.h), so the level tests compile the products alone.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace hs {

// The quantized weight formats (kernels/quant.py), one tensor per matrix [..., N, K], both laid
// out for the products once, by the quantizer at load: the rows [0, N8), N8 = N rounded down to
// kTile, in tiles of kTile = 8 rows, a tile the bytes of its 8 rows, so that one 32-byte load is
// 4 elements (a quad) of each of the 8 rows, what one vpdpbusd against a broadcast quad of
// activations takes; the last N - N8 rows (fewer than 8) in row order.
// - int8 (torch.int8): w[n, k] = q[n, k] * scale[n], an fp32 scale per row, K + kScaleBytes bytes
//   per row as [N, K + 4] shows. A tile: K / 32 blocks of kQ8Block = 256 bytes, block b holding
//   columns [32 b, 32 b + 32): byte 32 p + 4 r + i = row r's element 32 b + 4 p + i (p < 8,
//   i < 4); then the tile's last t = K % 32 columns row by row (row r's element 32 (K / 32) + j
//   at r t + j); then the 8 rows' scales (row r at 4 r). A row in row order: q[n, 0..K) then
//   the scale's bytes. `q8_row` and `q8_row_scale` read any row back.
// - int4 (torch.uint8): K a multiple of kQ4Group, w[n, k] = (u - 8) * scale[n, k / kQ4Group]
//   for u its nibble (0..15) and a bf16 scale per group, 9K/16 bytes per row as [N, 9K/16]
//   shows. A tile: K / kQ4Group blocks of kQ4Block = 144 bytes, block g holding the tile's
//   group g: 128 bytes of nibbles, byte 32 p + 4 r + i = row r's element 4 p + i (low nibble)
//   and element 16 + 4 p + i (high nibble), p < 4, i < 4; then the 8 rows' scales (bf16, row r
//   at 2r) (simd.h's `q4x8`; a block's 8 scales are one load). A row in row order: K / 2 bytes
//   of groups of 16 (group g's element j in byte 16 g + j's low nibble, element j + 16 in its
//   high nibble) then the K / kQ4Group scales. `q4_group` reads any row's group back.
// Their products (qgemv.h, qgemm.h) multiply int8-rounded activations.
constexpr int64_t kScaleBytes = 4;
constexpr int64_t kTile = 8;
constexpr int64_t kQ8Block = kTile * 32;  // bytes per tile per 32 columns
constexpr int64_t kQ4Group = 32;
constexpr int64_t kQ4Block = kTile * (kQ4Group / 2 + 2);  // bytes per tile per group

// Elements (bytes for the quantized formats) per stored row of a K-wide matrix.
template <typename W>
constexpr int64_t row_stride(int64_t K) {
  if constexpr (std::is_same_v<W, int8_t>) return K + kScaleBytes;
  if constexpr (std::is_same_v<W, uint8_t>) return K / 2 + K / kQ4Group * 2;
  return K;
}

// Rows of a quantized matrix of N rows that lie in tiles.
inline int64_t tiled_rows(int64_t N) { return N / kTile * kTile; }

// The scale of row n of an int8 matrix w of N rows and K columns.
inline float q8_row_scale(const int8_t* w, int64_t N, int64_t K, int64_t n) {
  const int64_t S = row_stride<int8_t>(K);
  const int8_t* p = w + n * S + K;  // a row in row order
  if (n < tiled_rows(N)) p = w + (n - n % kTile) * S + kTile * K + kScaleBytes * (n % kTile);
  float s;
  std::memcpy(&s, p, sizeof s);
  return s;
}

// Row n's values [k0, k0 + kn) of an int8 matrix w of N rows and K columns, in k order -> out.
inline void q8_row(const int8_t* w, int64_t N, int64_t K, int64_t n, int64_t k0, int64_t kn,
                   int8_t* out) {
  const int64_t S = row_stride<int8_t>(K);
  if (n >= tiled_rows(N)) {
    std::memcpy(out, w + n * S + k0, kn);
    return;
  }
  const int64_t r = n % kTile, full = K / 32 * 32, t = K - full;
  const int8_t* tile = w + (n - r) * S;
  int64_t k = k0;
  for (; k % 4 == 0 && k + 4 <= std::min(k0 + kn, full); k += 4)  // whole quads
    std::memcpy(out + k - k0, tile + k / 32 * kQ8Block + (k % 32) / 4 * 32 + 4 * r, 4);
  for (; k < k0 + kn; ++k)
    out[k - k0] = k < full ? tile[k / 32 * kQ8Block + (k % 32) / 4 * 32 + 4 * r + k % 4]
                           : tile[full * kTile + r * t + (k - full)];
}

// bf16 matrices in K-pair panels (kernels/bf16_pack.py), read by the panel products (bpanel.h):
// one tensor [..., N, K], the rows in panels of kPanel = 64 (the last panel the N % 64 rows left
// over, a short panel of h < 64 rows). A panel of h rows from row n0 lies where its rows lie in
// row order, elements [n0 K, (n0 + h) K): first, for each pair p < K / 2, row i's
// (w[n0 + i, 2p], w[n0 + i, 2p + 1]) at 2hp + 2i (a whole panel's pair is 256 bytes, the 64 rows'
// pairs: 4 vectors of 16 pairs at AVX-512, 8 of 8 at AVX2, 16 of 4 at NEON); then, for an odd K,
// row i's w[n0 + i, K - 1] at 2h (K / 2) + i. `bpanel_index` is the map.
constexpr int64_t kPanel = 64;

// The element index of w[n, k] in a panel-packed matrix of N rows and K columns.
inline int64_t bpanel_index(int64_t N, int64_t K, int64_t n, int64_t k) {
  const int64_t n0 = n / kPanel * kPanel, h = std::min(kPanel, N - n0), i = n - n0;
  const int64_t base = n0 * K, K2 = K / 2;
  return k < 2 * K2 ? base + 2 * h * (k / 2) + 2 * i + k % 2 : base + 2 * h * K2 + i;
}

template <typename W>
inline float load1(const W* p);
template <>
inline float load1<float>(const float* p) {
  return *p;
}
template <>
inline float load1<c10::BFloat16>(const c10::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[0]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Row n's group g of an int4 matrix w of N rows and K columns, in the row order: its 16 bytes
// of nibbles (element j low in byte j, element j + 16 high) into out; returns its scale.
inline float q4_group(const uint8_t* w, int64_t N, int64_t K, int64_t n, int64_t g,
                      uint8_t* out) {
  const int64_t S = row_stride<uint8_t>(K);
  const auto scales = [](const uint8_t* p) { return reinterpret_cast<const c10::BFloat16*>(p); };
  if (n < tiled_rows(N)) {
    const int64_t r = n % kTile;
    const uint8_t* blk = w + (n - r) * S + g * kQ4Block;
    for (int64_t p = 0; p < 4; ++p) std::memcpy(out + 4 * p, blk + 32 * p + 4 * r, 4);
    return load1(scales(blk + 128) + r);
  }
  const uint8_t* row = w + n * S;
  std::memcpy(out, row + g * (kQ4Group / 2), kQ4Group / 2);
  return load1(scales(row + K / 2) + g);
}

// How far ahead of the weights being summed the GEMVs fetch (bytes). A thread streams its rows
// back to back, but the hardware prefetchers keep too few lines in flight for one core to
// reach the memory's speed; asking for the weights 4 KB ahead does (the best of the distances
// tried, 1-8 KB): the integer GEMV asks for a row's worth as each row starts (`fetch_ahead`),
// the fp32/bf16 one a line per step of its loop. A prefetch never faults, so past the end of
// the matrix it only costs a wasted line.
constexpr int64_t kFetchAhead = 4096;

inline void fetch_ahead(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row) + kFetchAhead;
  for (int64_t b = 0; b < bytes; b += 64) simd::prefetch(p + b);
}

// Rows of x, kPassRows at a time, against a block of weight rows small enough to stay in L1/L2
// (about 16 KB), so each weight row comes from memory once for any M.
inline int64_t block_rows(int64_t K, int64_t weight_bytes) {
  return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K * weight_bytes));
}

// Rows of x per pass over a block of weight rows, in both GEMVs: each row takes two FMA chains,
// so four rows keep eight independent chains in flight (enough to hide the FMA's latency)
// within AVX2's 16 registers. More rows take further passes over the block, by then in L1/L2.
constexpr int64_t kPassRows = 4;

// fn(typed pointer) for the weight pointer `w` of dtype `dtype` (fp32, bf16, int8 or int4).
template <typename F>
inline void with_weight(c10::ScalarType dtype, const void* w, const F& fn) {
  switch (dtype) {
    case c10::kBFloat16: return fn(static_cast<const c10::BFloat16*>(w));
    case c10::kChar: return fn(static_cast<const int8_t*>(w));
    case c10::kByte: return fn(static_cast<const uint8_t*>(w));
    default: return fn(static_cast<const float*>(w));
  }
}

inline bool weight_dtype(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kBFloat16 || t == c10::kChar || t == c10::kByte;
}

inline bool quantized(c10::ScalarType dtype) { return dtype == c10::kChar || dtype == c10::kByte; }

}  // namespace hs
