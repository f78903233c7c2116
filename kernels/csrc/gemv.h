// Weight-streaming GEMV / skinny GEMM on CPU: y[m, n] = sum_k x[m, k] w[n, k], fp32 activations,
// fp32, bf16, int8 or int4-quantized weights (weights.h), fp32 accumulation; the quantized
// weights multiply the activations rounded to int8 in integer dot products (qgemv.h). Shared by
// the ops of every kernels/csrc/*.cpp file (`hs::skinny_linear_jobs`); `skinny_linear` in
// linear_ops.cpp is its torch op (tensor_args.h: the tensor-side checks).
#pragma once

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "qgemv.h"
#include "simd.h"
#include "weights.h"

namespace hs {

// y[m, n] = sum_k x[m, k] w[n, k] for M <= 8 rows of x, fp32 or bf16 weights: each weight row is
// read once from memory and used for all M rows while it is in registers / L1. One FMA chain per
// row of x, simd::kLanes wide (16 with AVX-512: half the uops, which bf16 rows need to reach the
// memory's speed), except a lone row: it sums even and odd chunks in two chains, so its last bits
// may differ from the same row's in a batch of 2-8 (as rows already differ between the GEMV and
// the tiled GEMM), and between levels of another width.
template <typename W, int M>
void gemv_rows(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * row_stride<W>(K);
    fetch_ahead(wr, K * int64_t(sizeof(W)));
    int64_t k = 0;
    float tail[M] = {};
    if constexpr (simd::kVector) {  // at generic x86 the plain loop below is the faster
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
    }
    for (; k < K; ++k) {
      const float wk = load1(wr + k);
      for (int m = 0; m < M; ++m) tail[m] += wk * x[m * K + k];
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = tail[m];
  }
}

template <typename W>
void gemv_dispatch(int64_t M, const float* x, const W* w, float* y, int64_t N, int64_t K,
                   int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return gemv_rows<W, 1>(x, w, y, N, K, n0, n1);
    case 2: return gemv_rows<W, 2>(x, w, y, N, K, n0, n1);
    case 3: return gemv_rows<W, 3>(x, w, y, N, K, n0, n1);
    case 4: return gemv_rows<W, 4>(x, w, y, N, K, n0, n1);
    case 5: return gemv_rows<W, 5>(x, w, y, N, K, n0, n1);
    case 6: return gemv_rows<W, 6>(x, w, y, N, K, n0, n1);
    case 7: return gemv_rows<W, 7>(x, w, y, N, K, n0, n1);
    default: return gemv_rows<W, 8>(x, w, y, N, K, n0, n1);
  }
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
  c10::ScalarType dtype;
  float* y;
  int64_t M, N, K;
};

inline int64_t weight_bytes(c10::ScalarType dtype) { return c10::elementSize(dtype); }

// Every job's weight rows in blocks of about 16 KB (`skinny_range`'s), all blocks split between
// the threads in one parallel region: a layer's several small matrices cost one fork/join, and
// each thread streams one long run of memory. Each output element is computed exactly as by a
// job alone (the same `gemv_rows`), whatever the batch of jobs. The activations of the jobs with
// quantized weights are rounded to int8 first (`quantize_rows`), once per distinct x. Nested
// inside another at::parallel_for it runs on the calling thread.
inline void skinny_linear_jobs(const GemvJob* jobs, int64_t n_jobs) {
  std::vector<int64_t> first(n_jobs + 1, 0);  // job j holds blocks [first[j], first[j + 1])
  std::vector<QuantActs> acts;                 // the distinct rounded activations
  std::vector<int64_t> act_of(n_jobs, -1);     // job j's entry in acts
  for (int64_t j = 0; j < n_jobs; ++j) {
    const GemvJob& g = jobs[j];
    if (quantized(g.dtype) && g.M > 0) {
      for (int64_t i = 0; i < j && act_of[j] < 0; ++i)
        if (act_of[i] >= 0 && jobs[i].x == g.x && jobs[i].M == g.M && jobs[i].K == g.K)
          act_of[j] = act_of[i];
      if (act_of[j] < 0) {
        act_of[j] = static_cast<int64_t>(acts.size());
        quantize_rows(g.x, g.M, g.K, acts.emplace_back());
      }
    }
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
      with_weight(g.dtype, g.w, [&](auto* w) {
        using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
        if constexpr (std::is_same_v<W, int8_t> || std::is_same_v<W, uint8_t>) {
          qskinny_range(g.M, acts[act_of[j]], w, g.y, g.N, n0, n1);
        } else {
          skinny_range(g.M, g.x, w, g.y, g.N, g.K, n0, n1);
        }
      });
    }
  });
}

// y [M, N] = x [M, K] w [N, K]^T, all contiguous (one job of the above).
template <typename W>
void skinny_linear_into(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  const GemvJob job{x, w, c10::CppTypeToScalarType<W>::value, y, M, N, K};
  skinny_linear_jobs(&job, 1);
}

}  // namespace hs
