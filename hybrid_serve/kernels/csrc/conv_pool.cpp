// The short causal conv on the conv-state pool, in place: one decode step per row, and the
// prefill over packed sequences. Reference: kernels/causal_conv1d.py; wrappers and contracts:
// kernels/cpp_ops.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "decode_ops.h"
#include "pool_slots.h"
#include "silu.h"
#include "simd.h"

namespace {

// The bias [D] fp32 contiguous, or null.
const float* bias_of(const std::optional<at::Tensor>& bias, int64_t D, const char* op) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == D,
              op, ": a contiguous fp32 bias of one value per channel expected");
  return bias->data_ptr<float>();
}

}  // namespace

namespace hs {

// x [B,D] fp32; conv_state [S,D,W-1] fp32 (in place); weight [D,W] fp32; bias [D] fp32 or none;
// indices [B] int64. Returns silu(conv + bias) [B,D] (or without silu when silu is false).
// Padding rows as above.
at::Tensor conv1d_update_pool(const at::Tensor& x, at::Tensor conv_state,
                              const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              const at::Tensor& indices, bool silu) {
  TORCH_CHECK(x.is_contiguous() && conv_state.is_contiguous() && weight.is_contiguous() &&
                  indices.is_contiguous(),
              "conv1d_update_pool: contiguous inputs expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && conv_state.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && indices.scalar_type() == at::kLong,
              "conv1d_update_pool: fp32 tensors and int64 indices expected");
  const int64_t B = x.size(0), D = x.size(1), W = weight.size(1), S = conv_state.size(0);
  TORCH_CHECK(conv_state.size(1) == D && conv_state.size(2) == W - 1 && weight.size(0) == D,
              "conv1d_update_pool: shapes");
  auto out = at::zeros({B, D}, x.options());
  const std::vector<int64_t> slots = hs::live_slots(indices, S);
  const float* bp = bias_of(bias, D, "conv1d_update_pool");
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = conv_state.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (slots[b] < 0) continue;
      float* st = sp + slots[b] * D * (W - 1);
      for (int64_t c = 0; c < D; ++c) {
        float* h = st + c * (W - 1);
        const float* w = wp + c * W;
        const float xc = xp[b * D + c];
        float y = w[W - 1] * xc;
        for (int64_t j = 0; j < W - 1; ++j) y += w[j] * h[j];
        if (bp != nullptr) y += bp[c];
        for (int64_t j = 0; j + 1 < W - 1; ++j) h[j] = h[j + 1];
        h[W - 2] = xc;
        op[b * D + c] = silu ? y / (1.f + std::exp(-y)) : y;
      }
    }
  });
  return out;
}

}  // namespace hs

namespace {

// Causal conv1d prefill over packed sequences on the conv-state pool, in place. x [T, D] fp32
// token-major (the channel-first [D, T] input transposed), channels contiguous, rows at any
// stride (the model's x is the first D columns of its input projection: no copy);
// conv_states [S, D, W-1] fp32; weight [D, W]; bias [D] or none; query_start_loc [N+1],
// cache_indices [N],
// has_initial_state [N] int64 (a negative index is padding: zero output, no state touched;
// otherwise distinct live slots). Sequence i runs over the window [its state (or zeros) | its
// tokens]: y_t = act(sum_j w_j window_{t+j} + bias), and its state becomes the window's last
// W-1 entries. Returns y [T, D].
at::Tensor conv1d_varlen_pool(const at::Tensor& x, at::Tensor conv_states,
                              const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              const at::Tensor& query_start_loc,
                              const at::Tensor& cache_indices,
                              const at::Tensor& has_initial_state, bool silu) {
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1) &&
                  x.stride(0) >= x.size(1) && conv_states.is_contiguous() &&
                  weight.is_contiguous() && x.scalar_type() == at::kFloat &&
                  conv_states.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "conv1d_varlen_pool: fp32 x with contiguous rows, contiguous fp32 states and "
              "weight expected");
  for (const at::Tensor* t : {&query_start_loc, &cache_indices, &has_initial_state}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong,
                "conv1d_varlen_pool: int64 starts, indices and initial-state flags expected");
  }
  const int64_t T = x.size(0), D = x.size(1), W = weight.size(1), S = conv_states.size(0);
  const int64_t N = cache_indices.numel();
  TORCH_CHECK(W >= 2 && weight.size(0) == D && conv_states.size(1) == D &&
                  conv_states.size(2) == W - 1 && query_start_loc.numel() == N + 1 &&
                  has_initial_state.numel() == N,
              "conv1d_varlen_pool: shapes");
  const int64_t* qs = query_start_loc.data_ptr<int64_t>();
  const int64_t* idx = cache_indices.data_ptr<int64_t>();
  const int64_t* init = has_initial_state.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[N] == T, "conv1d_varlen_pool: starts must span the tokens");
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(qs[i + 1] >= qs[i] && idx[i] < S, "conv1d_varlen_pool: starts or slot");
    for (int64_t j = 0; j < i && idx[i] >= 0; ++j) {
      TORCH_CHECK(idx[j] != idx[i], "conv1d_varlen_pool: slot ", idx[i], " twice");
    }
  }
  auto out = at::empty({T, D}, x.options());  // every row is written below: no zero pass
  const int64_t ldx = x.stride(0);
  const float* bp = bias_of(bias, D, "conv1d_varlen_pool");
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = conv_states.data_ptr<float>(), *op = out.data_ptr<float>();
  // channels per job, vectorised across: 1 KB of each token's row per visit (the rows sit
  // 8-12 KB apart; 64 channels, a quarter of that, left the op waiting on TLB and cache misses)
  constexpr int64_t kCh = 256;
  const int64_t nb = (D + kCh - 1) / kCh;
  at::parallel_for(0, N * nb, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wt(W * kCh), hist((W - 1) * kCh);  // [W][kCh], [W-1][kCh]
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / nb, c0 = job % nb * kCh, nc = std::min(kCh, D - c0);
      const int64_t lo = qs[i], L = qs[i + 1] - lo;
      if (idx[i] < 0) {  // padding: zero output
        for (int64_t t = 0; t < L; ++t) std::fill_n(op + (lo + t) * D + c0, nc, 0.f);
        continue;
      }
      float* state = sp + idx[i] * D * (W - 1);
      for (int64_t c = 0; c < nc; ++c) {
        for (int64_t j = 0; j < W; ++j) wt[j * kCh + c] = wp[(c0 + c) * W + j];
        for (int64_t j = 0; j + 1 < W; ++j) {
          hist[j * kCh + c] = init[i] ? state[(c0 + c) * (W - 1) + j] : 0.f;
        }
      }
      // window entry r: the history for r < W-1, else token lo + r - (W-1)
      auto entry = [&](int64_t r) -> const float* {
        return r < W - 1 ? hist.data() + r * kCh : xp + (lo + r - (W - 1)) * ldx + c0;
      };
      for (int64_t t = 0; t < L; ++t) {
        float* __restrict y = op + (lo + t) * D + c0;
        if (W == 4) {  // the models' width: one pass, the same sum in the same order
          const float *__restrict e0 = entry(t), *__restrict e1 = entry(t + 1),
                                  *__restrict e2 = entry(t + 2), *__restrict e3 = entry(t + 3);
          const float* __restrict w = wt.data();
          for (int64_t c = 0; c < nc; ++c) {
            const float v = hs::simd::madd(w[kCh + c], e1[c], w[c] * e0[c]);
            y[c] = hs::simd::madd(w[3 * kCh + c], e3[c], hs::simd::madd(w[2 * kCh + c], e2[c], v));
          }
        } else {
          const float* e0 = entry(t);
          for (int64_t c = 0; c < nc; ++c) y[c] = wt[c] * e0[c];
          for (int64_t j = 1; j < W; ++j) {
            const float* e = entry(t + j);
            const float* w = wt.data() + j * kCh;
            for (int64_t c = 0; c < nc; ++c) y[c] += w[c] * e[c];
          }
        }
        if (bp != nullptr)
          for (int64_t c = 0; c < nc; ++c) y[c] += bp[c0 + c];
        if (silu) hs::silu_inplace(y, nc);
      }
      for (int64_t j = 0; j + 1 < W; ++j) {  // new state: window entries L .. L+W-2
        const float* e = entry(L + j);
        for (int64_t c = 0; c < nc; ++c) state[(c0 + c) * (W - 1) + j] = e[c];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("conv1d_update_pool(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, "
        "Tensor indices, bool silu) -> Tensor");
  m.def("conv1d_varlen_pool(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, "
        "Tensor query_start_loc, Tensor cache_indices, Tensor has_initial_state, bool silu) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("conv1d_update_pool", &hs::conv1d_update_pool);
  m.impl("conv1d_varlen_pool", &conv1d_varlen_pool);
}
