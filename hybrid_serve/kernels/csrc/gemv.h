// Weight-streaming GEMV / skinny GEMM on CPU: y[m, n] = sum_k x[m, k] w[n, k], fp32 activations,
// fp32, bf16, int8 or int4-quantized weights (weights.h), fp32 accumulation; the quantized
// weights multiply the activations rounded to int8 in integer dot products (qgemv.h), and bf16
// weights on the bf16 route (a job's `panels`: K-pair panels) the activations rounded to bf16
// in the panel product's pair dots (bpanel.h). Shared by the ops of
// every kernels/csrc/*.cpp file (`hs::skinny_linear_jobs`); `skinny_linear` in linear_ops.cpp is
// its torch op (tensor_args.h: the tensor-side checks).
#pragma once

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bpanel.h"
#include "qgemv.h"
#include "simd.h"
#include "weights.h"

namespace hs {

// Whether the vector GEMV reads x staged (`stage_pairs`) against weights of type W: bf16
// weights are widened as pairs (simd.h's `load_w2`), so x is read in the same order.
template <typename W>
constexpr bool kStaged = simd::kVector && std::is_same_v<W, c10::BFloat16>;

// x [M, K] -> out [M, K] in `load_w2`'s bf16 order: every whole chunk of 2 kLanes values of a
// row as its even elements, then its odd ones; the values past the last whole chunk as they are.
inline void stage_pairs(const float* x, int64_t M, int64_t K, float* out) {
  constexpr int64_t L = simd::kLanes;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* o = out + m * K;
    int64_t k = 0;
    for (; k + 2 * L <= K; k += 2 * L) {
      for (int64_t i = 0; i < L; ++i) {
        o[k + i] = xr[k + 2 * i];
        o[k + L + i] = xr[k + 2 * i + 1];
      }
    }
    std::copy(xr + k, xr + K, o + k);
  }
}

// y[m, n] = sum_k x[m, k] w[n, k] for M <= kPassRows rows of x (staged where kStaged<W>), fp32
// or bf16 weights: each weight row is loaded and widened once for all M rows, and the weights
// kFetchAhead bytes on are fetched a line per step of the loop (a burst per row start,
// `fetch_ahead`, left 4 rows' FMAs and the stream taking turns). Every row of x is summed by
// the same operations whatever M: per chunk of 2 kLanes weights (`load_w2`), a `lo`
// and a `hi` FMA chain; then one chain over a last chunk of kLanes; the two chains added lane by
// lane and the lanes by `hsum`; then the rest of k in order. So a row's result does not depend
// on how many rows share the pass (a verify row equals the same row decoded alone); its last
// bits follow kLanes (levels of one width agree). At generic x86 the plain loop alone runs.
template <typename W, int M>
void gemv_rows(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
  static_assert(M >= 1 && M <= kPassRows);
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * row_stride<W>(K);
    int64_t k = 0;
    float tail[M] = {};
    if constexpr (simd::kVector) {  // at generic x86 the plain loop below is the faster
      namespace v = simd;
      constexpr int64_t L = v::kLanes, step_bytes = 2 * L * int64_t(sizeof(W));
      v::vec lo[M], hi[M];
      for (int m = 0; m < M; ++m) lo[m] = hi[m] = v::zero();
      for (; k + 2 * L <= K; k += 2 * L) {
        const char* ahead = reinterpret_cast<const char*>(wr + k) + kFetchAhead;
        for (int64_t b = 0; b < step_bytes; b += 64) simd::prefetch(ahead + b);
        v::vec wl, wh;
        v::load_w2(wr + k, wl, wh);
        for (int m = 0; m < M; ++m) {
          lo[m] = v::fma(wl, v::load(x + m * K + k), lo[m]);
          hi[m] = v::fma(wh, v::load(x + m * K + k + L), hi[m]);
        }
      }
      for (; k + L <= K; k += L) {
        const v::vec wv = v::load_w(wr + k);
        for (int m = 0; m < M; ++m) lo[m] = v::fma(wv, v::load(x + m * K + k), lo[m]);
      }
      for (int m = 0; m < M; ++m) tail[m] = v::hsum(v::add(lo[m], hi[m]));
    } else {
      fetch_ahead(wr, K * int64_t(sizeof(W)));
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
    default: return gemv_rows<W, 4>(x, w, y, N, K, n0, n1);
  }
}

// Weight rows [n0, n1) in blocks, each block against the rows of x kPassRows at a time; x staged
// where kStaged<W>.
template <typename W>
void skinny_range(int64_t M, const float* x, const W* w, float* y, int64_t N, int64_t K,
                  int64_t n0, int64_t n1) {
  const int64_t nb = block_rows(K, sizeof(W));
  for (int64_t b0 = n0; b0 < n1; b0 += nb) {
    const int64_t b1 = std::min(n1, b0 + nb);
    for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
      gemv_dispatch(std::min(kPassRows, M - m0), x + m0 * K, w, y + m0 * N, N, K, b0, b1);
    }
  }
}

// One product y [M, N] = x [M, K] w [N, K]^T of a batch run in one parallel region; w holds
// fp32, bf16, int8 or int4 rows (`dtype`), all contiguous. `panels`: the bf16 route, a bf16 w
// packed in K-pair panels (weights.h), read by the panel product (bpanel.h: x rounded to bf16,
// one chain per output at every M, rounded to bf16); other weights ignore it.
struct GemvJob {
  const float* x;
  const void* w;
  c10::ScalarType dtype;
  float* y;
  int64_t M, N, K;
  bool panels = false;
};

// How a job's activations are prepared (once per distinct x and kind): as they are, rounded to
// int8 (`quantize_rows`), staged in `load_w2`'s order (`stage_pairs`), or rounded to bf16 as
// pair panels (`bpanel::pack_acts`).
enum class Acts { kPlain, kInt8, kStaged, kPanels };

inline bool panel_job(const GemvJob& g) { return g.panels && g.dtype == c10::kBFloat16; }

inline Acts acts_kind(const GemvJob& g) {
  if (quantized(g.dtype)) return Acts::kInt8;
  if (g.dtype != c10::kBFloat16) return Acts::kPlain;
  if (g.panels) return Acts::kPanels;
  return kStaged<c10::BFloat16> ? Acts::kStaged : Acts::kPlain;
}

// Weight rows per block of a job (`skinny_range`'s and `qskinny_range`'s; a panel job's blocks
// are bpanel.h's TB panels).
inline int64_t job_block_rows(const GemvJob& g) {
  if (panel_job(g)) return bpanel::TB * kPanel;
  if (g.dtype == c10::kByte) return qblock_rows<uint8_t>(g.K);
  if (g.dtype == c10::kChar) return qblock_rows<int8_t>(g.K);
  return block_rows(g.K, c10::elementSize(g.dtype));
}

// Every job's weight rows in blocks of about 16 KB (`skinny_range`'s), all blocks split between
// the threads in one parallel region: a layer's several small matrices cost one fork/join, and
// each thread streams one long run of memory. Each output element is computed exactly as by a
// job alone (the same `gemv_rows`, integer GEMV or `bpanel::panels_range`), whatever the jobs.
// The activations are prepared first, once per distinct x and kind (`acts_kind`). Nested inside
// another at::parallel_for it runs on the calling thread.
inline void skinny_linear_jobs(const GemvJob* jobs, int64_t n_jobs) {
  std::vector<int64_t> first(n_jobs + 1, 0);       // job j holds blocks [first[j], first[j + 1])
  std::vector<QuantActs> acts;                      // the distinct rounded-to-int8 activations
  std::vector<std::vector<float>> staged;           // the distinct staged activations
  std::vector<bpanel::Acts> paired;                 // the distinct pair-panel activations
  std::vector<int64_t> act_of(n_jobs, -1);          // job j's entry in acts, staged or paired
  auto same_x = [&](int64_t i, int64_t j) {
    return jobs[i].x == jobs[j].x && jobs[i].M == jobs[j].M && jobs[i].K == jobs[j].K;
  };
  for (int64_t j = 0; j < n_jobs; ++j) {
    const GemvJob& g = jobs[j];
    const Acts kind = acts_kind(g);
    if (kind != Acts::kPlain && g.M > 0) {
      for (int64_t i = 0; i < j && act_of[j] < 0; ++i)
        if (act_of[i] >= 0 && acts_kind(jobs[i]) == kind && same_x(i, j)) act_of[j] = act_of[i];
      if (act_of[j] < 0 && kind == Acts::kInt8) {
        act_of[j] = static_cast<int64_t>(acts.size());
        quantize_rows(g.x, g.M, g.K, acts.emplace_back());
      } else if (act_of[j] < 0 && kind == Acts::kPanels) {
        act_of[j] = static_cast<int64_t>(paired.size());
        paired.push_back(bpanel::pack_acts(g.x, g.M, g.K));
      } else if (act_of[j] < 0) {
        act_of[j] = static_cast<int64_t>(staged.size());
        stage_pairs(g.x, g.M, g.K, staged.emplace_back(g.M * g.K).data());
      }
    }
    const int64_t nb = job_block_rows(g);
    first[j + 1] = first[j] + (g.M == 0 ? 0 : (g.N + nb - 1) / nb);
  }
  // grain: about 64 KB of weights per task, so small matrices stay on one thread
  at::parallel_for(0, first[n_jobs], 4, [&](int64_t b0, int64_t b1) {
    for (int64_t j = 0; j < n_jobs; ++j) {
      const int64_t lo = std::max(b0, first[j]), hi = std::min(b1, first[j + 1]);
      if (lo >= hi) continue;
      const GemvJob& g = jobs[j];
      const int64_t nb = job_block_rows(g);
      const int64_t n0 = (lo - first[j]) * nb, n1 = std::min(g.N, (hi - first[j]) * nb);
      with_weight(g.dtype, g.w, [&](auto* w) {
        using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
        if constexpr (std::is_same_v<W, int8_t> || std::is_same_v<W, uint8_t>) {
          qskinny_range(g.M, acts[act_of[j]], w, g.y, g.N, n0, n1);
        } else if constexpr (std::is_same_v<W, c10::BFloat16>) {
          if (g.panels) {
            bpanel::panels_range(paired[act_of[j]], 0, w, g.y, g.M, g.N, g.K, n0 / kPanel,
                                 (n1 + kPanel - 1) / kPanel);
          } else if constexpr (kStaged<W>) {
            skinny_range(g.M, staged[act_of[j]].data(), w, g.y, g.N, g.K, n0, n1);
          } else {
            skinny_range(g.M, g.x, w, g.y, g.N, g.K, n0, n1);
          }
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
