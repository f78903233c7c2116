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
// - int4 (torch.uint8): K a multiple of kQ4Group; rows of K / 2 bytes of groups of 16 (group
//   g's element j in byte 16 g + j's low nibble, element j + 16 in its high nibble, each stored
//   plus 8) then K / kQ4Group bf16 scales: w[n, k] = (nibble - 8) * scale[n, k / kQ4Group].
// Their products (qgemv.h, gemm.h) multiply int8-rounded activations.
constexpr int64_t kScaleBytes = 4;
constexpr int64_t kQ4Group = 32;

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
