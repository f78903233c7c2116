// The sparse MoE block of a small decode batch in one op: router, top-k routing, the active
// experts, the sigmoid-gated shared expert and the combine. Reference and contract:
// kernels/moe_step.py. Every matrix product is the weight-streaming GEMV
// (hs::skinny_linear_into), fp32 or bf16 weights, fp32 activations and accumulation.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "gemv.h"

namespace {

// y [M, N] = x [M, K] w [N, K]^T for a weight of either dtype (w may be a slice of a stack).
void linear_into(const float* x, const at::Tensor& w, int64_t offset_rows, int64_t N, float* y,
                 int64_t M) {
  const int64_t K = w.size(-1);
  if (w.scalar_type() == at::kFloat) {
    hs::skinny_linear_into(x, w.data_ptr<float>() + offset_rows * K, y, M, N, K);
  } else {
    hs::skinny_linear_into(x, w.data_ptr<at::BFloat16>() + offset_rows * K, y, M, N, K);
  }
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

void check_weight(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "moe_decode: ", name, " must be contiguous fp32 or bf16");
}

// x [T, H] fp32; router_w [E, H]; experts_gate_up [E, 2I, H]; experts_down [E, H, I];
// shared_gate_w [1, H]; shared_gate_proj, shared_up_proj [Is, H]; shared_down [H, Is].
// Returns sum_k w_k expert_{id_k}(x) + sigmoid(shared_gate(x)) shared_expert(x), [T, H] fp32.
at::Tensor moe_decode(const at::Tensor& x, const at::Tensor& router_w,
                      const at::Tensor& experts_gate_up, const at::Tensor& experts_down,
                      const at::Tensor& shared_gate_w, const at::Tensor& shared_gate_proj,
                      const at::Tensor& shared_up_proj, const at::Tensor& shared_down,
                      int64_t top_k, bool norm_topk_prob) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "moe_decode: x [T, H] contiguous fp32 expected");
  check_weight(router_w, "router_w");
  check_weight(experts_gate_up, "experts_gate_up");
  check_weight(experts_down, "experts_down");
  check_weight(shared_gate_w, "shared_gate_w");
  check_weight(shared_gate_proj, "shared_gate_proj");
  check_weight(shared_up_proj, "shared_up_proj");
  check_weight(shared_down, "shared_down");
  const int64_t T = x.size(0), H = x.size(1), E = router_w.size(0);
  const int64_t I = experts_down.size(2), Is = shared_down.size(1);
  TORCH_CHECK(router_w.size(1) == H && experts_gate_up.size(0) == E &&
                  experts_gate_up.size(1) == 2 * I && experts_gate_up.size(2) == H &&
                  experts_down.size(0) == E && experts_down.size(1) == H,
              "moe_decode: expert shapes");
  TORCH_CHECK(shared_gate_w.size(0) == 1 && shared_gate_w.size(1) == H &&
                  shared_gate_proj.size(0) == Is && shared_up_proj.size(0) == Is &&
                  shared_down.size(0) == H,
              "moe_decode: shared expert shapes");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_decode: top_k");
  const float* xp = x.data_ptr<float>();
  auto out = at::zeros({T, H}, x.options());
  float* op = out.data_ptr<float>();
  if (T == 0) return out;

  // routing: the fp32 softmax and top-k are torch's own, so ties pick torch.topk's experts
  auto logits = at::empty({T, E}, x.options());
  linear_into(xp, router_w, 0, E, logits.data_ptr<float>(), T);
  auto [topk_w, topk_ids] = at::topk(at::_softmax(logits, -1, false), top_k, -1);
  topk_w = topk_w.contiguous();
  topk_ids = topk_ids.contiguous();
  float* wp = topk_w.data_ptr<float>();
  const int64_t* ip = topk_ids.data_ptr<int64_t>();
  if (norm_topk_prob) {
    for (int64_t t = 0; t < T; ++t) {
      float s = 0.f;
      for (int64_t j = 0; j < top_k; ++j) s += wp[t * top_k + j];
      for (int64_t j = 0; j < top_k; ++j) wp[t * top_k + j] /= s;
    }
  }

  // routed experts in expert order, each on the rows routed to it (token order)
  std::vector<float> xs(T * H), gu(T * 2 * I), act(T * I), ys(T * H);
  std::vector<int64_t> rows;
  std::vector<float> row_w;
  for (int64_t e = 0; e < E; ++e) {
    rows.clear();
    row_w.clear();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < top_k; ++j) {
        if (ip[t * top_k + j] == e) {
          rows.push_back(t);
          row_w.push_back(wp[t * top_k + j]);
        }
      }
    }
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) continue;
    for (int64_t r = 0; r < n; ++r) std::copy_n(xp + rows[r] * H, H, xs.data() + r * H);
    linear_into(xs.data(), experts_gate_up, e * 2 * I, 2 * I, gu.data(), n);
    for (int64_t r = 0; r < n; ++r) {
      const float* g = gu.data() + r * 2 * I;
      for (int64_t i = 0; i < I; ++i) act[r * I + i] = silu(g[i]) * g[I + i];
    }
    linear_into(act.data(), experts_down, e * H, H, ys.data(), n);
    for (int64_t r = 0; r < n; ++r) {
      float* o = op + rows[r] * H;
      const float* y = ys.data() + r * H;
      const float w = row_w[r];
      for (int64_t h = 0; h < H; ++h) o[h] += y[h] * w;
    }
  }

  // shared expert and its sigmoid gate
  std::vector<float> sg(T), sgate(T * Is), sup(T * Is), sact(T * Is), sy(T * H);
  linear_into(xp, shared_gate_w, 0, 1, sg.data(), T);
  linear_into(xp, shared_gate_proj, 0, Is, sgate.data(), T);
  linear_into(xp, shared_up_proj, 0, Is, sup.data(), T);
  for (int64_t i = 0; i < T * Is; ++i) sact[i] = silu(sgate[i]) * sup[i];
  linear_into(sact.data(), shared_down, 0, H, sy.data(), T);
  for (int64_t t = 0; t < T; ++t) {
    const float gate = 1.f / (1.f + std::exp(-sg[t]));
    float* o = op + t * H;
    const float* y = sy.data() + t * H;
    for (int64_t h = 0; h < H; ++h) o[h] += gate * y[h];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("moe_decode(Tensor x, Tensor router_w, Tensor experts_gate_up, Tensor experts_down, "
        "Tensor shared_gate_w, Tensor shared_gate_proj, Tensor shared_up_proj, "
        "Tensor shared_down, int top_k, bool norm_topk_prob) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) { m.impl("moe_decode", &moe_decode); }
