// The routed experts' products, torch-free (routed_experts.cpp is the torch op and the decode
// step's entry; tests/kernels/level_probe.cpp compiles this at every ISA level): each active
// expert's run of rows is one job of the weight-streaming GEMV (gemv.h `skinny_linear_jobs`),
// every expert's [gate | up] job in one parallel region, silu(gate) * up row by row, then every
// down job in a second region. The jobs' weight blocks (about 16 KB each in every format) are
// split among the threads, so each active expert's weights are streamed from memory once per
// call whatever its row count (its rows past the first pass run over blocks already in cache),
// and int8 and int4 experts multiply the rows rounded to int8 in the GEMV's integer dots, their
// tiles read in place.
//
// Contract: every output row is the GEMV's sum for that row alone (gemv.h, qgemv.h: a row's sum
// does not depend on the rows beside it) and the activation is element-wise and position-free
// (silu.h), so a row's result is the same bits whatever the counts, the other rows and their
// experts. int8 and int4 experts give the same bits at every ISA level (qgemv.h); fp32 and bf16
// ones agree within fp32 round-off, bit for bit among the levels of one vector width (gemv.h's
// `gemv_rows`).
#pragma once

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gemv.h"
#include "silu.h"
#include "weights.h"

namespace hs {

// silu(gate) * up for a row [gate | up] of 2I gate and up outputs -> out [I], silu vectorised
// (silu.h: a polynomial exp within 2 ulp of expf). A limit > 0 is the clamped SwiGLU
// (kernels/experts.py `swiglu`): min(silu(gate), limit) * clamp(up, +-limit).
inline void swiglu_row(const float* gate_up_row, int64_t I, float* out, float limit) {
  const float* up = gate_up_row + I;
  std::copy_n(gate_up_row, I, out);
  silu_inplace(out, I);
  if (limit > 0.f) {
    for (int64_t i = 0; i < I; ++i)
      out[i] = std::min(out[i], limit) * std::clamp(up[i], -limit, limit);
    return;
  }
  for (int64_t i = 0; i < I; ++i) out[i] *= up[i];
}

// Bytes of one expert's N x K matrix in a stack of `dtype` (weights.h's formats: each int8 or
// int4 expert tiled on its own).
inline int64_t expert_bytes(c10::ScalarType dtype, int64_t N, int64_t K) {
  int64_t row = 0;
  with_weight(dtype, nullptr, [&](auto* w) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    row = row_stride<W>(K) * int64_t(sizeof(W));
  });
  return N * row;
}

// One GEMV job per expert with rows: x [T, K] rows sorted by expert (counts[e] of expert e)
// against expert e's N rows of the stack w [E, N, K] -> y [T, N], the same order. `panels`: bf16
// experts each packed in K-pair panels (weights.h), read by the panel product.
inline std::vector<GemvJob> expert_jobs(const float* x, const void* w, c10::ScalarType dtype,
                                        const int64_t* counts, int64_t E, int64_t N, int64_t K,
                                        float* y, bool panels = false) {
  const int64_t bytes = expert_bytes(dtype, N, K);
  std::vector<GemvJob> jobs;
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] > 0) {
      const void* we = static_cast<const char*>(w) + e * bytes;
      jobs.push_back(
          {x + start * K, we, dtype, y + start * N, counts[e], N, K, panels});
    }
    start += counts[e];
  }
  return jobs;
}

// xs [T, H] rows sorted by expert, counts[e] of expert e (summing to T); gate_up [E, 2I, H] and
// down [E, H, I] of one `dtype` (fp32, bf16, int8 or int4) -> y [T, H]: row t is
// down_e(swiglu(gate_e x_t, up_e x_t)) for its expert e (`swiglu_row`, clamped by a limit > 0).
// `panels`: bf16 experts packed in K-pair panels, multiplied by the panel product (bpanel.h:
// x rounded to bf16, each output one chain, rounded to bf16), so a row is the same bits
// whatever its batch there too.
inline void routed_experts_rows(const float* xs, const void* gate_up, const void* down,
                                c10::ScalarType dtype, const int64_t* counts, int64_t E,
                                int64_t H, int64_t I, float* y, float limit, bool panels = false) {
  int64_t T = 0;
  for (int64_t e = 0; e < E; ++e) T += counts[e];
  if (T == 0) return;
  std::vector<float> h(T * 2 * I), act(T * I);
  std::vector<GemvJob> jobs =
      expert_jobs(xs, gate_up, dtype, counts, E, 2 * I, H, h.data(), panels);
  skinny_linear_jobs(jobs.data(), static_cast<int64_t>(jobs.size()));
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, I));
  at::parallel_for(0, T, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      swiglu_row(h.data() + r * 2 * I, I, act.data() + r * I, limit);
  });
  jobs = expert_jobs(act.data(), down, dtype, counts, E, H, I, y, panels);
  skinny_linear_jobs(jobs.data(), static_cast<int64_t>(jobs.size()));
}

}  // namespace hs
