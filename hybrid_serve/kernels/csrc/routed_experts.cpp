// The routed experts of a MoE layer in one call: every expert's rows through the tiled GEMM
// (gemm.h), gate and up, silu(gate) * up straight into the down projection's panels, then down;
// the weight rows of all experts with tokens split among the threads by cost (weight bytes
// streamed plus FMAs). Decode batches come here (kernels/cpp_ops.py sends prefill-sized
// inputs to torch); the decode step's MoE block (moe_decode.cpp) calls `routed_experts_into`.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "decode_ops.h"
#include "gemm.h"
#include "silu.h"
#include "tensor_args.h"

namespace {

using namespace hs::tiled;

// One piece of work: weight rows [n0, n1) of expert e; cost ~ weight bytes + flops.
struct Task {
  int64_t e, n0, n1;
  double cost;
};

// Tasks of at most `rows` weight rows for every expert with tokens.
std::vector<Task> expert_tasks(const std::vector<int64_t>& counts, int64_t N, int64_t K,
                               int64_t rows, int64_t wbytes) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < int64_t(counts.size()); ++e) {
    if (counts[e] == 0) continue;
    for (int64_t n0 = 0; n0 < N; n0 += rows) {
      const int64_t n1 = std::min(N, n0 + rows);
      // streaming a weight byte costs about as much as ~4 FMAs from cache here
      tasks.push_back({e, n0, n1, double(n1 - n0) * K * (wbytes * 4.0 + counts[e])});
    }
  }
  return tasks;
}

// Runs fn(task) for every task, the tasks split among the threads by cost.
template <typename F>
void run_balanced(const std::vector<Task>& tasks, const F& fn) {
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<size_t> bounds(parts + 1, tasks.size());
  double total = 0;
  for (const Task& t : tasks) total += t.cost;
  double acc = 0;
  int64_t p = 0;
  bounds[0] = 0;
  for (size_t i = 0; i < tasks.size() && p + 1 < parts; ++i) {
    acc += tasks[i].cost;
    if (acc >= total * double(p + 1) / double(parts)) bounds[++p] = i + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t q = p0; q < p1; ++q)
      for (size_t i = bounds[q]; i < bounds[q + 1]; ++i) fn(tasks[i]);
  });
}

// silu(gate) * up at columns [n0, n1) of a row [gate | up] of 2I gate and up outputs -> out
// [n1 - n0], silu vectorised (silu.h: a polynomial exp within 2 ulp of expf). A limit > 0 is
// the clamped SwiGLU (kernels/experts.py `swiglu`): min(silu(gate), limit) * clamp(up, +-limit).
inline void swiglu_cols(const float* gate_up_row, int64_t I, int64_t n0, int64_t n1, float* out,
                        float limit) {
  const int64_t n = n1 - n0;
  const float* up = gate_up_row + I + n0;
  std::copy_n(gate_up_row + n0, n, out);
  hs::silu_inplace(out, n);
  if (limit > 0.f) {
    for (int64_t i = 0; i < n; ++i)
      out[i] = std::min(out[i], limit) * std::clamp(up[i], -limit, limit);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] *= up[i];
}

// The activation rows (`counts[e]` of expert e from panel pstart[e]) in the panels `ap` of
// K columns rounded to int8 in place (qgemv.h's `round_rows`), the experts in parallel.
inline void round_panel_rows(float* ap, const std::vector<int64_t>& pstart,
                             const std::vector<int64_t>& counts, int64_t K) {
  at::parallel_for(0, int64_t(counts.size()), 1, [&](int64_t e0, int64_t e1) {
    std::vector<float> row(K);
    for (int64_t e = e0; e < e1; ++e)
      for (int64_t m = 0; m < counts[e]; ++m) {
        float* a = ap + (pstart[e] + m / MR) * K * MR + m % MR;
        for (int64_t k = 0; k < K; ++k) row[k] = a[k * MR];
        hs::round_rows(row.data(), 1, K, row.data());
        for (int64_t k = 0; k < K; ++k) a[k * MR] = row[k];
      }
  });
}

// xs [T, H] rows sorted by expert, counts[e] each; gate_up [E, 2I, H]; down [E, H, I]; h [T, 2I]
// scratch for the gate and up outputs.
template <typename W>
void experts_into(const float* xs, const W* gate_up, const W* down,
                  const std::vector<int64_t>& counts, float* h, float* y, int64_t H, int64_t I,
                  float limit) {
  const int64_t E = int64_t(counts.size());
  std::vector<int64_t> start(E + 1, 0), pstart(E + 1, 0);  // each expert's first row, panel
  for (int64_t e = 0; e < E; ++e) {
    start[e + 1] = start[e] + counts[e];
    pstart[e + 1] = pstart[e] + panels(counts[e]);
  }
  // every expert's rows and activations in panels
  const auto xp = panel_buffer(pstart[E], H), ap = panel_buffer(pstart[E], I);
  std::vector<float> rounded;
  if constexpr (is_quantized<W>) {
    rounded.resize(start[E] * H);
    hs::round_rows(xs, start[E], H, rounded.data());
    xs = rounded.data();
  }
  at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e)
      pack_panels(xs + start[e] * H, H, counts[e], H, xp.get() + pstart[e] * H * MR);
  });
  // gate and up rows [n0, n1) of an expert, then silu(gate) * up on those columns, written
  // straight into the down projection's panels (their padding rows zero)
  const int64_t ldg = hs::row_stride<W>(H), ldd = hs::row_stride<W>(I);  // row strides
  run_balanced(expert_tasks(counts, I, 2 * H, NC, sizeof(W)), [&](const Task& t) {
    const int64_t M = counts[t.e];
    const W* w = gate_up + t.e * 2 * I * ldg;
    float* hm = h + start[t.e] * 2 * I;
    const float* x = xp.get() + pstart[t.e] * H * MR;
    gemm_cols(x, w, ldg, 2 * I, hm, 2 * I, M, H, t.n0, t.n1);          // gate
    gemm_cols(x, w, ldg, 2 * I, hm, 2 * I, M, H, I + t.n0, I + t.n1);  // up
    std::vector<float> row(t.n1 - t.n0);
    for (int64_t m = 0; m < panels(M) * MR; ++m) {
      float* a = ap.get() + (pstart[t.e] + m / MR) * I * MR + m % MR;
      if (m < M) swiglu_cols(hm + m * 2 * I, I, t.n0, t.n1, row.data(), limit);
      for (int64_t n = t.n0; n < t.n1; ++n) a[n * MR] = m < M ? row[n - t.n0] : 0.f;
    }
  });
  if constexpr (is_quantized<W>) round_panel_rows(ap.get(), pstart, counts, I);
  run_balanced(expert_tasks(counts, H, I, NC, sizeof(W)), [&](const Task& t) {
    gemm_cols(ap.get() + pstart[t.e] * I * MR, down + t.e * H * ldd, ldd, H, y + start[t.e] * H,
              H, counts[t.e], I, t.n0, t.n1);
  });
}

}  // namespace

namespace hs {

void routed_experts_into(const float* xs, const at::Tensor& gate_up, const at::Tensor& down,
                         const std::vector<int64_t>& counts, float* y, float limit) {
  int64_t T = 0;
  for (int64_t c : counts) T += c;
  if (T == 0) return;
  const int64_t H = hs::in_features(gate_up), I = hs::in_features(down);
  std::vector<float> h(T * 2 * I);
  hs::with_weight(gate_up.scalar_type(), gate_up.data_ptr(), [&](auto* gu) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(gu)>>;
    experts_into(xs, gu, static_cast<const W*>(down.data_ptr()), counts, h.data(), y, H, I,
                 limit);
  });
}

}  // namespace hs

namespace {

// xs [T, H] fp32 sorted by expert; gate_up [E, 2I, H], down [E, H, I] (fp32, bf16, int8 or
// int4, alike);
// counts [E] int64 summing to T -> [T, H] fp32: row t is down_e(silu(gate_e x_t) * up_e x_t)
// for the expert e whose slice holds t (with a limit > 0, the clamped SwiGLU: swiglu_cols).
at::Tensor routed_experts(const at::Tensor& xs, const at::Tensor& gate_up, const at::Tensor& down,
                          const at::Tensor& counts, double limit) {
  TORCH_CHECK(xs.is_contiguous() && gate_up.is_contiguous() && down.is_contiguous() &&
                  counts.is_contiguous(),
              "routed_experts: contiguous inputs");
  TORCH_CHECK(xs.scalar_type() == at::kFloat && counts.scalar_type() == at::kLong,
              "routed_experts: fp32 rows and int64 counts expected");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type() && hs::weight_dtype(down.scalar_type()),
              "routed_experts: fp32, bf16, int8 or int4 weights, both alike");
  TORCH_CHECK(xs.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && counts.dim() == 1,
              "routed_experts: ranks");
  const int64_t T = xs.size(0), H = xs.size(1), E = gate_up.size(0), I = hs::in_features(down);
  TORCH_CHECK(gate_up.size(1) == 2 * I && hs::in_features(gate_up) == H && down.size(0) == E &&
                  down.size(1) == H && counts.size(0) == E,
              "routed_experts: shapes");
  const int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<int64_t> cnt(cp, cp + E);
  int64_t sum = 0;
  for (int64_t c : cnt) {
    TORCH_CHECK(c >= 0, "routed_experts: negative count");
    sum += c;
  }
  TORCH_CHECK(sum == T, "routed_experts: counts sum to ", sum, " for ", T, " rows");
  auto y = at::empty({T, H}, xs.options());
  hs::routed_experts_into(xs.data_ptr<float>(), gate_up, down, cnt, y.data_ptr<float>(),
                          static_cast<float>(limit));
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("routed_experts(Tensor xs, Tensor gate_up, Tensor down, Tensor counts, "
        "float limit=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("routed_experts", &routed_experts);
}
