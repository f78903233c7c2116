// Weight-streaming GEMV / skinny GEMM on CPU: y[m, n] = sum_k x[m, k] w[n, k], fp32 activations,
// fp32, bf16, int8 or int4-quantized weights, fp32 accumulation. Shared by the ops of every
// kernels/csrc/*.cpp file (`hs::skinny_linear_into`); `skinny_linear` in cpu_kernels.cpp is its
// torch op.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace hs {

// The quantized weight formats (kernels/quant.py), one tensor per matrix [..., N, K]:
// - int8 (torch.int8): rows of K + kScaleBytes bytes, q[n, 0..K) then the fp32 scale's bytes,
//   w[n, k] = q[n, k] * scale[n]. Products sum the integers (exact in fp32) and scale each
//   output's sum once.
// - int4 (torch.uint8): K a multiple of kQ4Group; rows of K / 2 bytes of groups of 16 (group
//   g's element j in byte 16 g + j's low nibble, element j + 16 in its high nibble, each stored
//   plus 8) then K / kQ4Group bf16 scales: w[n, k] = (nibble - 8) * scale[n, k / kQ4Group].
//   Products scale each group's partial sum.
constexpr int64_t kScaleBytes = 4;
constexpr int64_t kQ4Group = 32;

// Elements (bytes for the quantized formats) per stored row of a K-wide matrix.
template <typename W>
constexpr int64_t row_stride(int64_t K) {
  if constexpr (std::is_same_v<W, int8_t>) return K + kScaleBytes;
  if constexpr (std::is_same_v<W, uint8_t>) return K / 2 + K / kQ4Group * 2;
  return K;
}

// The K of a weight [..., N, K] as stored (fp32, bf16 or a format above).
inline int64_t in_features(const at::Tensor& w) {
  if (w.scalar_type() == at::kChar) return w.size(-1) - kScaleBytes;
  if (w.scalar_type() == at::kByte) return w.size(-1) * kQ4Group / (kQ4Group / 2 + 2);
  return w.size(-1);
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
inline float load1<at::BFloat16>(const at::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[0]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <>
inline float load1<int8_t>(const int8_t* p) {
  return static_cast<float>(*p);
}

// How far ahead of the weight row being summed the GEMV fetches (bytes). A thread streams its
// rows back to back, but the hardware prefetchers keep too few lines in flight for one core to
// reach the memory's speed; asking for the row 4 KB ahead as each row starts does (the best of
// the distances tried, 1-8 KB). A prefetch never faults, so past the end of the matrix it only
// costs a wasted line.
constexpr int64_t kFetchAhead = 4096;

inline void fetch_ahead(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row) + kFetchAhead;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// y[m, n] = sum_k x[m, k] w[n, k] for M <= 8 rows of x: each weight row is read once
// from memory and used for all M rows while it is in registers / L1. One FMA chain per row of
// x, 8 lanes wide (16 where the compiler targets AVX-512: half the uops, which bf16 rows need to
// reach the memory's speed), except a lone row: it sums even and odd chunks in two chains, so its
// last bits may differ from the same row's in a batch of 2-8 (as rows already differ between the
// GEMV and the tiled GEMM).
template <typename W, int M>
void gemv_rows(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * row_stride<W>(K);
    fetch_ahead(wr, K * int64_t(sizeof(W)));
    int64_t k = 0;
    float tail[M] = {};
#ifdef HS_SIMD
    namespace v = simd;
    constexpr int64_t L = v::kLanes;
    v::vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = v::zero();
    if constexpr (M == 1) {  // two chains: one FMA chain (4 cycles per vector) caps bf16 rows
      v::vec odd = v::zero();
      for (; k + 2 * L <= K; k += 2 * L) {
        acc[0] = v::fma(v::load_w(wr + k), v::load(x + k), acc[0]);
        odd = v::fma(v::load_w(wr + k + L), v::load(x + k + L), odd);
      }
      acc[0] = v::add(acc[0], odd);
    }
    for (; k + L <= K; k += L) {
      const v::vec wv = v::load_w(wr + k);
      for (int m = 0; m < M; ++m) acc[m] = v::fma(wv, v::load(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) tail[m] = v::hsum(acc[m]);
#endif
    for (; k < K; ++k) {
      const float wk = load1(wr + k);
      for (int m = 0; m < M; ++m) tail[m] += wk * x[m * K + k];
    }
    if constexpr (std::is_same_v<W, int8_t>) {
      const float scale = row_scale(wr, K);
      for (int m = 0; m < M; ++m) y[m * N + n] = tail[m] * scale;
    } else {
      for (int m = 0; m < M; ++m) y[m * N + n] = tail[m];
    }
  }
}

// int4 rows (the format above): per group of 32, the widened integers' products with each row
// of x summed in registers, then multiplied by the group's scale into the row's sum.
template <int M>
void gemv_rows_q4(const float* x, const uint8_t* w, float* y, int64_t N, int64_t K, int64_t n0,
                  int64_t n1) {
  const int64_t G = K / kQ4Group, stride = row_stride<uint8_t>(K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * stride;
    const auto* sc = reinterpret_cast<const at::BFloat16*>(wr + K / 2);
    fetch_ahead(wr, stride);
#ifdef HS_SIMD
    namespace v = simd;
    constexpr int V = kQ4Group / v::kLanes;
    v::vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = v::zero();
    for (int64_t g = 0; g < G; ++g) {
      v::vec wv[V];
      v::load_q4(wr + g * kQ4Group / 2, wv);
      const v::vec s = v::bcast(load1(sc + g));
      for (int m = 0; m < M; ++m) {
        const float* xg = x + m * K + g * kQ4Group;
        v::vec part = v::mul(wv[0], v::load(xg));
        for (int i = 1; i < V; ++i) part = v::fma(wv[i], v::load(xg + i * v::kLanes), part);
        acc[m] = v::fma(part, s, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = v::hsum(acc[m]);
#else
    for (int m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float part = 0.f;
        for (int64_t j = 0; j < kQ4Group / 2; ++j) {
          const uint8_t b = wr[g * kQ4Group / 2 + j];
          const float* xg = x + m * K + g * kQ4Group;
          part += float(int(b & 15) - 8) * xg[j] + float(int(b >> 4) - 8) * xg[j + 16];
        }
        sum += part * load1(sc + g);
      }
      y[m * N + n] = sum;
    }
#endif
  }
}

template <typename W, int M>
inline void gemv_any(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0,
                     int64_t n1) {
  if constexpr (std::is_same_v<W, uint8_t>) {
    gemv_rows_q4<M>(x, w, y, N, K, n0, n1);
  } else {
    gemv_rows<W, M>(x, w, y, N, K, n0, n1);
  }
}

template <typename W>
void gemv_dispatch(int64_t M, const float* x, const W* w, float* y, int64_t N, int64_t K,
                   int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return gemv_any<W, 1>(x, w, y, N, K, n0, n1);
    case 2: return gemv_any<W, 2>(x, w, y, N, K, n0, n1);
    case 3: return gemv_any<W, 3>(x, w, y, N, K, n0, n1);
    case 4: return gemv_any<W, 4>(x, w, y, N, K, n0, n1);
    case 5: return gemv_any<W, 5>(x, w, y, N, K, n0, n1);
    case 6: return gemv_any<W, 6>(x, w, y, N, K, n0, n1);
    case 7: return gemv_any<W, 7>(x, w, y, N, K, n0, n1);
    default: return gemv_any<W, 8>(x, w, y, N, K, n0, n1);
  }
}

// Rows of x in blocks of 8 against a block of weight rows small enough to stay in L1/L2 (about
// 16 KB), so each weight row comes from memory once for any M.
inline int64_t block_rows(int64_t K, int64_t weight_bytes) {
  return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K * weight_bytes));
}

template <typename W>
void skinny_range(int64_t M, const float* x, const W* w, float* y, int64_t N, int64_t K,
                  int64_t n0, int64_t n1) {
  const int64_t nb = block_rows(K, sizeof(W));
  for (int64_t b0 = n0; b0 < n1; b0 += nb) {
    const int64_t b1 = std::min(n1, b0 + nb);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      gemv_dispatch(std::min<int64_t>(8, M - m0), x + m0 * K, w, y + m0 * N, N, K, b0, b1);
    }
  }
}

// One product y [M, N] = x [M, K] w [N, K]^T of a batch run in one parallel region; w holds
// fp32, bf16, int8 or int4 rows (`dtype`), all contiguous.
struct GemvJob {
  const float* x;
  const void* w;
  at::ScalarType dtype;
  float* y;
  int64_t M, N, K;
};

// fn(typed pointer) for the weight pointer `w` of dtype `dtype` (fp32, bf16, int8 or int4).
template <typename F>
inline void with_weight(at::ScalarType dtype, const void* w, const F& fn) {
  switch (dtype) {
    case at::kBFloat16: return fn(static_cast<const at::BFloat16*>(w));
    case at::kChar: return fn(static_cast<const int8_t*>(w));
    case at::kByte: return fn(static_cast<const uint8_t*>(w));
    default: return fn(static_cast<const float*>(w));
  }
}

inline int64_t weight_bytes(at::ScalarType dtype) { return at::elementSize(dtype); }

// Every job's weight rows in blocks of about 16 KB (`skinny_range`'s), all blocks split between
// the threads in one parallel region: a layer's several small matrices cost one fork/join, and
// each thread streams one long run of memory. Each output element is computed exactly as by a
// job alone (the same `gemv_rows`), whatever the batch of jobs. Nested inside another
// at::parallel_for it runs on the calling thread.
inline void skinny_linear_jobs(const GemvJob* jobs, int64_t n_jobs) {
  std::vector<int64_t> first(n_jobs + 1, 0);  // job j holds blocks [first[j], first[j + 1])
  for (int64_t j = 0; j < n_jobs; ++j) {
    const GemvJob& g = jobs[j];
    const int64_t nb = block_rows(g.K, weight_bytes(g.dtype));
    first[j + 1] = first[j] + (g.M == 0 ? 0 : (g.N + nb - 1) / nb);
  }
  // grain: about 64 KB of weights per task, so small matrices stay on one thread
  at::parallel_for(0, first[n_jobs], 4, [&](int64_t b0, int64_t b1) {
    for (int64_t j = 0; j < n_jobs; ++j) {
      const int64_t lo = std::max(b0, first[j]), hi = std::min(b1, first[j + 1]);
      if (lo >= hi) continue;
      const GemvJob& g = jobs[j];
      const int64_t nb = block_rows(g.K, weight_bytes(g.dtype));
      const int64_t n0 = (lo - first[j]) * nb, n1 = std::min(g.N, (hi - first[j]) * nb);
      with_weight(g.dtype, g.w, [&](auto* w) { skinny_range(g.M, g.x, w, g.y, g.N, g.K, n0, n1); });
    }
  });
}

// y [M, N] = x [M, K] w [N, K]^T, all contiguous (one job of the above).
template <typename W>
void skinny_linear_into(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  const GemvJob job{x, w, c10::CppTypeToScalarType<W>::value, y, M, N, K};
  skinny_linear_jobs(&job, 1);
}

inline bool weight_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kChar || t == at::kByte;
}

// The job of `w` (a contiguous fp32, bf16, int8 or int4-format matrix, or `rows` rows of it from
// `row0`; a stack [E, N, K] is rows of one matrix).
inline GemvJob job_of(const float* x, const at::Tensor& w, float* y, int64_t M, int64_t row0 = 0,
                      int64_t rows = -1) {
  TORCH_CHECK(weight_dtype(w.scalar_type()), "GEMV weights: fp32, bf16, int8 or int4");
  const int64_t K = in_features(w), stride = w.size(-1);
  const char* base = static_cast<const char*>(w.data_ptr()) + row0 * stride * w.element_size();
  return {x, base, w.scalar_type(), y, M, rows < 0 ? w.numel() / stride - row0 : rows, K};
}

// The torch op y [M, N] = x [M, K] w [N, K]^T (x fp32, w fp32, bf16, int8 or int4-format, both 2-D
// contiguous) run by `into(x, w, y, M, N, K)`, a generic callable given w's typed pointer: the
// checks and the dtype dispatch that `skinny_linear` and `tiled_linear` share.
template <typename Into>
at::Tensor linear_op(const char* op, const at::Tensor& x, const at::Tensor& w, const Into& into) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), op, ": contiguous inputs");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": fp32 activations expected");
  TORCH_CHECK(weight_dtype(w.scalar_type()), op, ": fp32, bf16, int8 or int4 weights");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == in_features(w), op, ": shapes");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  with_weight(w.scalar_type(), w.data_ptr(),
              [&](auto* wp) { into(x.data_ptr<float>(), wp, y.data_ptr<float>(), M, N, K); });
  return y;
}

}  // namespace hs
