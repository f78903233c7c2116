// The Gated DeltaNet decode step after its projections, one op per layer, in place on the
// layer's conv and recurrent states (reference and contract: kernels/gdn_step.py); and its
// speculative-verify form, a few tokens per request in order, keeping each state.
//
//   [q | k | v] = silu(conv1d update of qkv on the conv window);  q, k l2-normalised, q * dk^-0.5
//   g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
//   S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q          (per value head, in place)
//   y = norm_weight * (o / rms(o)) * silu(z)                          -> [T, value_dim]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "conv_update.h"
#include "delta_rule.h"
#include "decode_ops.h"
#include "lanes.h"
#include "gated_norm.h"
#include "silu.h"
#include "pool_slots.h"


namespace {

// The layer's fixed shapes and parameters, and per-thread scratch for `head_token`.
struct GdnLayer {
  int64_t dk, dv, HV, ratio, key_dim, value_dim, conv_dim, row;
  const float *x, *ba, *A_log, *dt_bias, *norm_w;
  float *ssm, *out;
  float scale, eps;
};

// One token (packed row b, its conv output a_row) of value head hv on `state`, in place:
// normalise q and k, the gates, the delta rule, then the gated norm into out[b].
inline void head_token(const GdnLayer& L, int64_t b, int64_t hv, const float* a_row, float* state,
                       const float* next, float* qs, float* ks, float* acc, float* delta,
                       float* o) {
  const int64_t dk = L.dk, dv = L.dv, HV = L.HV, hk = hv / L.ratio;
  const float* qr = a_row + hk * dk;
  const float* kr = a_row + L.key_dim + hk * dk;
  const float* vr = a_row + 2 * L.key_dim + hv * dv;
  hs::normalise_qk(qr, kr, dk, L.scale, qs, ks);
  const float bt = 1.f / (1.f + std::exp(-L.ba[b * 2 * HV + hv]));
  const float g =
      -std::exp(L.A_log[hv]) * hs::softplus(L.ba[b * 2 * HV + HV + hv] + L.dt_bias[hv]);
  std::fill(o, o + dv, 0.f);
  hs::delta_rule_token(state, ks, qs, vr, std::exp(g), bt, dk, dv, acc, delta, o, next);
  hs::gated_rmsnorm_row(o, L.x + b * L.row + L.conv_dim + hv * dv, L.norm_w,
                        L.out + b * L.value_dim + hv * dv, dv, L.eps);  // with z
}

}  // namespace

namespace hs {

namespace {

// Checks shared by both ops; the layer's shapes and pointers, `out` [T, value_dim] allocated.
GdnLayer layer_of(const at::Tensor& qkvz, const at::Tensor& ba, const at::Tensor& conv_state,
                  const at::Tensor& conv_weight, const at::Tensor& ssm_state,
                  const at::Tensor& A_log, const at::Tensor& dt_bias,
                  const at::Tensor& norm_weight, int64_t num_k_heads, double eps,
                  at::Tensor& out) {
  const std::initializer_list<const at::Tensor*> tensors = {
      &qkvz, &ba, &conv_state, &conv_weight, &ssm_state, &A_log, &dt_bias, &norm_weight};
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat,
                "gdn_decode: contiguous fp32 tensors expected");
  }
  const int64_t T = qkvz.size(0), S = ssm_state.size(0), HV = ssm_state.size(1);
  const int64_t dk = ssm_state.size(2), dv = ssm_state.size(3), H = num_k_heads;
  const int64_t key_dim = H * dk, value_dim = HV * dv, conv_dim = 2 * key_dim + value_dim;
  const int64_t W = conv_weight.size(1);
  TORCH_CHECK(qkvz.dim() == 2 && qkvz.size(1) == conv_dim + value_dim, "gdn_decode: qkvz shape");
  TORCH_CHECK(ba.dim() == 2 && ba.size(0) == T && ba.size(1) == 2 * HV, "gdn_decode: ba shape");
  TORCH_CHECK(conv_state.size(0) == S && conv_state.size(1) == conv_dim &&
                  conv_state.size(2) == W - 1 && conv_weight.size(0) == conv_dim,
              "gdn_decode: conv shapes");
  TORCH_CHECK(HV % H == 0 && A_log.numel() == HV && dt_bias.numel() == HV &&
                  norm_weight.numel() == dv,
              "gdn_decode: head shapes");
  out = at::zeros({T, value_dim}, qkvz.options());
  return GdnLayer{dk, dv, HV, HV / H, key_dim, value_dim, conv_dim, conv_dim + value_dim,
                  qkvz.data_ptr<float>(), ba.data_ptr<float>(), A_log.data_ptr<float>(),
                  dt_bias.data_ptr<float>(), norm_weight.data_ptr<float>(),
                  ssm_state.data_ptr<float>(), out.data_ptr<float>(),
                  1.f / std::sqrt(static_cast<float>(dk)), static_cast<float>(eps)};
}

}  // namespace

at::Tensor gdn_decode(const at::Tensor& qkvz, const at::Tensor& ba, at::Tensor conv_state,
                      const at::Tensor& conv_weight, at::Tensor ssm_state, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                      const at::Tensor& slots_t, int64_t num_k_heads, double eps) {
  at::Tensor out;
  const GdnLayer L = layer_of(qkvz, ba, conv_state, conv_weight, ssm_state, A_log, dt_bias,
                              norm_weight, num_k_heads, eps, out);
  TORCH_CHECK(slots_t.is_contiguous() && slots_t.scalar_type() == at::kLong &&
                  slots_t.numel() == qkvz.size(0),
              "gdn_decode: int64 slots, one per row, expected");
  const int64_t T = qkvz.size(0), HV = L.HV, dk = L.dk, dv = L.dv, conv_dim = L.conv_dim;
  const int64_t W = conv_weight.size(1);
  const std::vector<int64_t> slots = hs::live_slots(slots_t, ssm_state.size(0));
  std::vector<float> act(T * conv_dim);  // silu(conv) of the live rows
  const std::vector<float> wt = hs::conv_weight_transposed(conv_weight);
  hs::conv_update_rows(L.x, L.row, conv_state.data_ptr<float>(), wt.data(), slots, act.data(),
                       conv_dim, W);

  at::parallel_for(0, T * HV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(dk), ks(dk), delta(dv), acc(dv), o(dv);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / HV, hv = job % HV;
      if (slots[b] < 0) continue;
      const float* next = nullptr;  // the state of this thread's next job
      const int64_t next_slot = job + 1 < end ? slots[(job + 1) / HV] : -1;
      if (next_slot >= 0) next = L.ssm + (next_slot * HV + (job + 1) % HV) * dk * dv;
      head_token(L, b, hv, act.data() + b * conv_dim, L.ssm + (slots[b] * HV + hv) * dk * dv,
                 next, qs.data(), ks.data(), acc.data(), delta.data(), o.data());
    }
  });
  return out;
}

// Speculative verify: request n's rows [starts[n], starts[n+1]) run in order on its state in
// slot slots[n], each token continuing from the last; after each of its rows but the last, the
// conv window and recurrent state are also copied to slot steps[n][j] (steps: [N, width], -1
// past a request's rows), by streaming stores where the level has them (simd.h's
// `stream_copy`): those states are read only after the pass (a rejected row's rollback, a
// prefix snapshot), and writing 3 states past the caches saves reading their slots' old lines
// first. Reference and contract: kernels/gdn_step.py gdn_verify.
at::Tensor gdn_verify(const at::Tensor& qkvz, const at::Tensor& ba, at::Tensor conv_state,
                      const at::Tensor& conv_weight, at::Tensor ssm_state, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                      const at::Tensor& slots_t, const at::Tensor& starts_t,
                      const at::Tensor& steps_t, int64_t num_k_heads, double eps) {
  at::Tensor out;
  const GdnLayer L = layer_of(qkvz, ba, conv_state, conv_weight, ssm_state, A_log, dt_bias,
                              norm_weight, num_k_heads, eps, out);
  const int64_t N = slots_t.numel(), HV = L.HV, dk = L.dk, dv = L.dv, conv_dim = L.conv_dim;
  const int64_t W = conv_weight.size(1), S = ssm_state.size(0);
  TORCH_CHECK(slots_t.scalar_type() == at::kLong && starts_t.scalar_type() == at::kLong &&
                  steps_t.scalar_type() == at::kLong && slots_t.is_contiguous() &&
                  starts_t.is_contiguous() && steps_t.is_contiguous() &&
                  starts_t.numel() == N + 1 && steps_t.dim() == 2 && steps_t.size(0) == N,
              "gdn_verify: int64 slots [N], starts [N+1], steps [N, width] expected");
  const int64_t *slots = slots_t.data_ptr<int64_t>(), *starts = starts_t.data_ptr<int64_t>();
  const int64_t *steps = steps_t.data_ptr<int64_t>(), width = steps_t.size(1);
  TORCH_CHECK(starts[0] == 0 && starts[N] == qkvz.size(0), "gdn_verify: starts");
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = starts[n + 1] - starts[n];
    TORCH_CHECK(len >= 1 && len - 1 <= width && slots[n] >= 0 && slots[n] < S,
                "gdn_verify: rows or slot of request ", n);
    for (int64_t j = 0; j + 1 < len; ++j) {
      TORCH_CHECK(steps[n * width + j] >= 0 && steps[n * width + j] < S, "gdn_verify: steps");
    }
  }
  std::vector<float> act(qkvz.size(0) * conv_dim);
  const std::vector<float> wt = hs::conv_weight_transposed(conv_weight);
  float* csp = conv_state.data_ptr<float>();
  const int64_t window = conv_dim * (W - 1), state = dk * dv;

  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* win = csp + slots[n] * window;
      for (int64_t b = starts[n]; b < starts[n + 1]; ++b) {
        hs::conv_update_row(L.x + b * L.row, win, wt.data(), nullptr, act.data() + b * conv_dim,
                            conv_dim, W);
        if (b + 1 < starts[n + 1]) {
          hs::simd::stream_copy(win, csp + steps[n * width + b - starts[n]] * window, window);
        }
      }
    }
  });

  at::parallel_for(0, N * HV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(dk), ks(dk), delta(dv), acc(dv), o(dv);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t n = job / HV, hv = job % HV;
      float* st = L.ssm + (slots[n] * HV + hv) * state;
      // the state of this thread's next job, fetched during this job's last row (as
      // gdn_decode fetches its next one)
      const float* next =
          job + 1 < end ? L.ssm + (slots[(job + 1) / HV] * HV + (job + 1) % HV) * state : nullptr;
      for (int64_t b = starts[n]; b < starts[n + 1]; ++b) {
        const bool last = b + 1 == starts[n + 1];
        head_token(L, b, hv, act.data() + b * conv_dim, st, last ? next : nullptr, qs.data(),
                   ks.data(), acc.data(), delta.data(), o.data());
        if (!last) {
          float* kept = L.ssm + (steps[n * width + b - starts[n]] * HV + hv) * state;
          hs::simd::stream_copy(st, kept, state);
        }
      }
    }
  });
  return out;
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("gdn_decode(Tensor qkvz, Tensor ba, Tensor(a!) conv_state, Tensor conv_weight, "
        "Tensor(b!) ssm_state, Tensor A_log, Tensor dt_bias, Tensor norm_weight, Tensor slots, "
        "int num_k_heads, float eps) -> Tensor");
  m.def("gdn_verify(Tensor qkvz, Tensor ba, Tensor(a!) conv_state, Tensor conv_weight, "
        "Tensor(b!) ssm_state, Tensor A_log, Tensor dt_bias, Tensor norm_weight, Tensor slots, "
        "Tensor starts, Tensor steps, int num_k_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("gdn_decode", &hs::gdn_decode);
  m.impl("gdn_verify", &hs::gdn_verify);
}
