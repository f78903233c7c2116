// The Kimi Delta Attention decode step after its projections, one op per layer, in place on the
// layer's conv and recurrent states: Gated DeltaNet's decode (gdn_decode.cpp) with one forget
// gate per key channel and the sigmoid-gated output norm. Reference and contract:
// kernels/gdn_step.py `gdn_decode` with kernels/rmsnorm.py `rms_norm_gated_sigmoid` (models/
// kda_mixer.py composes them); wrapper: kernels/cpp_fused.py `kda_decode`.
//
//   [q | k | v] = silu(conv1d update of qkv on the conv window);  q, k l2-normalised, q * d^-0.5
//   g = -exp(A_log[h]) * softplus(f + dt_bias)                  (Kimi: f from the low-rank ups)
//     = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))             (Ling-3's bounded gate, lb < 0)
//   beta = sigmoid(b)
//   S = diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o = S^T q       (per head, in place)
//   y = norm_weight * (o / rms(o)) * sigmoid(z)                        -> [T, H d]
//
// The pieces are the delta-rule family's: the conv update (conv_update.h), the q/k norms and the
// per-row-decay update (delta_rule.h), the gated norm row (gated_norm.h), the padding slots
// (pool_slots.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "conv_update.h"
#include "decode_ops.h"
#include "delta_rule.h"
#include "gated_norm.h"
#include "pool_slots.h"
#include "silu.h"

namespace {

// The layer's shapes and parameters. Rows: x [T, 4 inner] = [q | k | v | z], ba [T, H + inner]
// = [b | f], inner = H d.
struct KdaLayer {
  int64_t H, d, inner;
  const float *x, *ba, *A_log, *dt_bias, *norm_w;
  float *ssm, *out;
  float scale, eps, lower_bound;
  bool bounded;
};

// decays [d] = exp(g) of head h at row b, the gate of either form.
inline void kda_decays(const KdaLayer& L, int64_t b, int64_t h, float* decays) {
  const int64_t d = L.d;
  const float* f = L.ba + b * (L.H + L.inner) + L.H + h * d;
  const float* bias = L.dt_bias + h * d;
  const float rate = std::exp(L.A_log[h]);
  if (L.bounded) {
    for (int64_t i = 0; i < d; ++i) decays[i] = rate * (f[i] + bias[i]);
    hs::sigmoid_inplace(decays, d);
    for (int64_t i = 0; i < d; ++i) decays[i] = std::exp(L.lower_bound * decays[i]);
  } else {
    for (int64_t i = 0; i < d; ++i) decays[i] = std::exp(-rate * hs::softplus(f[i] + bias[i]));
  }
}

// One token (row b, its conv output a_row) of head h on `state`, in place, into out[b]; `next`
// (or null) the state the thread updates after this one (delta_rule.h's prefetch).
inline void kda_head_token(const KdaLayer& L, int64_t b, int64_t h, const float* a_row,
                           float* state, const float* next, float* qs, float* ks, float* decays,
                           float* acc, float* delta, float* o) {
  const int64_t d = L.d, inner = L.inner;
  hs::normalise_qk(a_row + h * d, a_row + inner + h * d, d, L.scale, qs, ks);
  const float beta = 1.f / (1.f + std::exp(-L.ba[b * (L.H + inner) + h]));
  kda_decays(L, b, h, decays);
  std::fill(o, o + d, 0.f);
  const float* decay_row = decays;  // one decay per key row of the state
  hs::delta_rule_token(state, ks, qs, a_row + 2 * inner + h * d, decay_row, beta, d, d, acc,
                       delta, o, next);
  hs::sigmoid_gated_rmsnorm_row(o, L.x + b * 4 * inner + 3 * inner + h * d, L.norm_w,
                                L.out + b * inner + h * d, d, L.eps);
}

}  // namespace

namespace hs {

// qkvz [T, 4 H d] ([q | k | v | z]); ba [T, H + H d] ([b | f]); conv_state [S, 3 H d, W-1] and
// ssm_state [S, H, d, d] (the layer's pools, updated in place at `slots` [T] int64: a negative
// slot or a repeated one is padding, zero output); conv_weight [3 H d, W]; A_log [H] (any
// shape); dt_bias [H d]; norm_weight [d]; all fp32 and contiguous. `lower_bound`: the bounded
// gate's lb, none for Kimi's. Returns y [T, H d].
at::Tensor kda_decode(const at::Tensor& qkvz, const at::Tensor& ba, at::Tensor conv_state,
                      const at::Tensor& conv_weight, at::Tensor ssm_state, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                      const at::Tensor& slots_t, double eps, std::optional<double> lower_bound) {
  const std::initializer_list<const at::Tensor*> tensors = {
      &qkvz, &ba, &conv_state, &conv_weight, &ssm_state, &A_log, &dt_bias, &norm_weight};
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat,
                "kda_decode: contiguous fp32 tensors expected");
  }
  const int64_t T = qkvz.size(0), S = ssm_state.size(0), H = ssm_state.size(1);
  const int64_t d = ssm_state.size(2), inner = H * d, conv_dim = 3 * inner;
  const int64_t W = conv_weight.size(1);
  TORCH_CHECK(ssm_state.dim() == 4 && ssm_state.size(3) == d, "kda_decode: state [S, H, d, d]");
  TORCH_CHECK(qkvz.dim() == 2 && qkvz.size(1) == 4 * inner, "kda_decode: qkvz [T, 4 H d]");
  TORCH_CHECK(ba.dim() == 2 && ba.size(0) == T && ba.size(1) == H + inner,
              "kda_decode: ba [T, H + H d]");
  TORCH_CHECK(conv_state.size(0) == S && conv_state.size(1) == conv_dim &&
                  conv_state.size(2) == W - 1 && conv_weight.size(0) == conv_dim,
              "kda_decode: conv shapes");
  TORCH_CHECK(A_log.numel() == H && dt_bias.numel() == inner && norm_weight.numel() == d,
              "kda_decode: head shapes");
  TORCH_CHECK(slots_t.is_contiguous() && slots_t.scalar_type() == at::kLong &&
                  slots_t.numel() == T,
              "kda_decode: int64 slots, one per row, expected");
  at::Tensor out = at::zeros({T, inner}, qkvz.options());
  const KdaLayer L{H, d, inner, qkvz.data_ptr<float>(), ba.data_ptr<float>(),
                   A_log.data_ptr<float>(), dt_bias.data_ptr<float>(),
                   norm_weight.data_ptr<float>(), ssm_state.data_ptr<float>(),
                   out.data_ptr<float>(), 1.f / std::sqrt(static_cast<float>(d)),
                   static_cast<float>(eps), static_cast<float>(lower_bound.value_or(0.0)),
                   lower_bound.has_value()};
  const std::vector<int64_t> slots = hs::live_slots(slots_t, S);
  std::vector<float> act(T * conv_dim);  // silu(conv) of the live rows
  const std::vector<float> wt = hs::conv_weight_transposed(conv_weight);
  hs::conv_update_rows(L.x, 4 * inner, conv_state.data_ptr<float>(), wt.data(), slots,
                       act.data(), conv_dim, W);

  at::parallel_for(0, T * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(d), ks(d), decays(d), delta(d), acc(d), o(d);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / H, h = job % H;
      if (slots[b] < 0) continue;
      const float* next = nullptr;  // the state of this thread's next job
      const int64_t next_slot = job + 1 < end ? slots[(job + 1) / H] : -1;
      if (next_slot >= 0) next = L.ssm + (next_slot * H + (job + 1) % H) * d * d;
      kda_head_token(L, b, h, act.data() + b * conv_dim, L.ssm + (slots[b] * H + h) * d * d,
                     next, qs.data(), ks.data(), decays.data(), acc.data(), delta.data(),
                     o.data());
    }
  });
  return out;
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("kda_decode(Tensor qkvz, Tensor ba, Tensor(a!) conv_state, Tensor conv_weight, "
        "Tensor(b!) ssm_state, Tensor A_log, Tensor dt_bias, Tensor norm_weight, Tensor slots, "
        "float eps, float? lower_bound) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) { m.impl("kda_decode", &hs::kda_decode); }
