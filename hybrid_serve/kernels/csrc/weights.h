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

// The quantized weight formats (kernels/quant.py), one tensor per matrix [..., N, K]:
// - int8 (torch.int8): rows of K + kScaleBytes bytes, q[n, 0..K) then the fp32 scale's bytes,
//   w[n, k] = q[n, k] * scale[n].
// - int4 (torch.uint8): K a multiple of kQ4Group, w[n, k] = (u - 8) * scale[n, k / kQ4Group]
//   for u its nibble (0..15) and a bf16 scale per group, 9K/16 bytes per row as [N, 9K/16]
//   shows, laid out for the products (made once, by the quantizer at load):
//   - the rows [0, N8), N8 = N rounded down to kQ4Tile, in tiles of kQ4Tile = 8 rows, a tile the
//     bytes of its 8 rows: K / kQ4Group blocks of kQ4Block = 144 bytes, block g holding the
//     tile's group g: 128 bytes of nibbles, byte 32 p + 4 r + i = row r's element 4 p + i
//     (low nibble) and element 16 + 4 p + i (high nibble), p < 4, i < 4; then the 8 rows'
//     scales (bf16, row r at 2r). One 32-byte load is then 4 elements of each of the 8 rows
//     (twice: low and high nibbles), what one vpdpbusd against a broadcast quad of activations
//     takes (simd.h's `q4x8`), and a block's 8 scales are one load;
//   - the last N - N8 rows (fewer than 8) as rows: K / 2 bytes of groups of 16 (group g's
//     element j in byte 16 g + j's low nibble, element j + 16 in its high nibble) then the
//     K / kQ4Group scales.
//   `q4_group` reads any row's group back in the row order.
// Their products (qgemv.h, gemm.h) multiply int8-rounded activations.
constexpr int64_t kScaleBytes = 4;
constexpr int64_t kQ4Group = 32;
constexpr int64_t kQ4Tile = 8;
constexpr int64_t kQ4Block = kQ4Tile * (kQ4Group / 2 + 2);  // bytes per tile per group

// Elements (bytes for the quantized formats) per stored row of a K-wide matrix.
template <typename W>
constexpr int64_t row_stride(int64_t K) {
  if constexpr (std::is_same_v<W, int8_t>) return K + kScaleBytes;
  if constexpr (std::is_same_v<W, uint8_t>) return K / 2 + K / kQ4Group * 2;
  return K;
}

// The scale of an int8 row of K values (read from its tail).
inline float row_scale(const int8_t* row, int64_t K) {
  float s;
  std::memcpy(&s, row + K, sizeof s);
  return s;
}

// Rows of an int4 matrix of N rows that lie in tiles.
inline int64_t q4_tiled_rows(int64_t N) { return N / kQ4Tile * kQ4Tile; }

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
  if (n < q4_tiled_rows(N)) {
    const int64_t r = n % kQ4Tile;
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
