// The sparse MoE block of a decode batch in one op: router, top-k routing, the active experts,
// the sigmoid-gated shared expert and the combine. Reference and contract: kernels/moe_step.py.
// Every matrix product is the weight-streaming GEMV (hs::gemv.h) at every batch size the op
// takes (kernels/cpp_fused.py: up to MOE_MAX_TOKENS rows): the router, then two parallel regions,
// every expert's run of rows and the shared expert's input projections, then (after the
// activations) every down projection. Each active expert's weights are streamed from memory once
// per region whatever its row count, its blocks split among the threads with all the others'
// (`skinny_linear_jobs`); int8 and int4 weights multiply the rows rounded to int8 in integer dots,
// their tiles read in place. With `bf16_products`, every bf16 matrix here (router, routed and
// shared experts) is K-pair panels read by the panel product (bpanel.h, through the GEMV jobs'
// `panels`): the bf16 route, the same bits as hs::linear's at every size (decode_ops.h). fp32,
// bf16, int8 or int4 weights (gemv.h's formats), fp32 activations and accumulation. Past 8 rows
// the fp32 and bf16 products cost more arithmetic per weight than the tiled GEMM's (several
// 4-row passes over each cached block), which shows at 64 rows; the weights are read once.
//
// Contract: the GEMV sums each row alone (a row's sum does not depend on the rows beside it),
// softmax and top-k are torch's row by row, silu is silu.h's (a value's result does not depend
// on where it sits), and the combine rounds each product before its sum, in expert order (no FMA
// contraction in this file's own code). So a token's output is the same bits whatever rows share
// its batch, for every batch size up to MOE_MAX_TOKENS; int8 and int4 weights give the same bits
// at every ISA level too (qgemv.h). The reference (pure torch) agrees to rounding.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gemv.h"
#include "routed_experts.h"
#include "silu.h"
#include "tensor_args.h"
#include "decode_ops.h"

#pragma GCC optimize("fp-contract=off")

namespace {

// silu(gate) * up for n rows of I gates at `gate` and I ups at `up` (row stride ld) -> out
// [n, I]: silu.h's vectorised silu, whose result for a value does not depend on where it sits,
// so a row's activations are the same bits whatever n (torch's silu would split large inputs
// among the threads at offsets that depend on n).
void swiglu(const float* gate, const float* up, int64_t ld, int64_t n, int64_t I, float* out) {
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, I));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* o = out + r * I;
      std::copy_n(gate + r * ld, I, o);
      hs::silu_inplace(o, I);
      for (int64_t i = 0; i < I; ++i) o[i] *= up[r * ld + i];
    }
  });
}

void check_weight(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.is_contiguous() && hs::weight_dtype(w.scalar_type()), "moe_decode: ", name,
              " must be contiguous fp32, bf16, int8 or int4");
}

}  // namespace

namespace hs {

// x [T, H] fp32; router_w [E, H]; experts_gate_up [E, 2I, H]; experts_down [E, H, I];
// shared_gate_w [1, H]; shared_gate_proj, shared_up_proj [Is, H]; shared_down [H, Is].
// Returns sum_k w_k expert_{id_k}(x) + sigmoid(shared_gate(x)) shared_expert(x), [T, H] fp32.
at::Tensor moe_decode(const at::Tensor& x, const at::Tensor& router_w,
                      const at::Tensor& experts_gate_up, const at::Tensor& experts_down,
                      const at::Tensor& shared_gate_w, const at::Tensor& shared_gate_proj,
                      const at::Tensor& shared_up_proj, const at::Tensor& shared_down,
                      int64_t top_k, bool norm_topk_prob, bool bf16_products) {
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
  const int64_t I = hs::in_features(experts_down), Is = hs::in_features(shared_down);
  TORCH_CHECK(hs::in_features(router_w) == H && experts_gate_up.size(0) == E &&
                  experts_gate_up.size(1) == 2 * I && hs::in_features(experts_gate_up) == H &&
                  experts_down.size(0) == E && experts_down.size(1) == H,
              "moe_decode: expert shapes");
  TORCH_CHECK(shared_gate_w.size(0) == 1 && hs::in_features(shared_gate_w) == H &&
                  shared_gate_proj.size(0) == Is && shared_up_proj.size(0) == Is &&
                  shared_down.size(0) == H,
              "moe_decode: shared expert shapes");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_decode: top_k");
  const float* xp = x.data_ptr<float>();
  auto out = at::zeros({T, H}, x.options());
  float* op = out.data_ptr<float>();
  if (T == 0) return out;

  // routing: the fp32 softmax and top-k are torch's own, so ties pick torch.topk's experts
  at::Tensor logits = at::empty({T, E}, x.options());
  const hs::GemvJob router = hs::job_of(xp, router_w, logits.data_ptr<float>(), T, bf16_products);
  hs::skinny_linear_jobs(&router, 1);
  auto [topk_w, topk_ids] = at::topk(at::_softmax(logits, -1, false), top_k, -1);
  if (norm_topk_prob) topk_w = topk_w / topk_w.sum(-1, true);
  topk_w = topk_w.contiguous();
  topk_ids = topk_ids.contiguous();
  const float* wp = topk_w.data_ptr<float>();
  const int64_t* ip = topk_ids.data_ptr<int64_t>();

  // the (token, expert) pairs sorted by expert, tokens in order within one (the reference's
  // stable sort); each expert's rows are a contiguous run
  const int64_t N = T * top_k;
  std::vector<int64_t> row_tok, start(E + 1, 0);
  std::vector<float> row_w;
  row_tok.reserve(N);
  row_w.reserve(N);
  for (int64_t e = 0; e < E; ++e) {
    start[e] = static_cast<int64_t>(row_tok.size());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < top_k; ++j) {
        if (ip[t * top_k + j] == e) {
          row_tok.push_back(t);
          row_w.push_back(wp[t * top_k + j]);
        }
      }
    }
  }
  start[E] = N;
  std::vector<float> xs(N * H), ys(N * H);
  for (int64_t r = 0; r < N; ++r) std::copy_n(xp + row_tok[r] * H, H, xs.data() + r * H);
  // the products in two parallel regions: every expert's and the shared expert's input
  // projections, then (after the activations) every down projection
  std::vector<float> gu(N * 2 * I), act(N * I);
  auto sg = at::empty({T, 1}, x.options()), sy = at::empty({T, H}, x.options());
  std::vector<float> sgate(T * Is), sup(T * Is), sact(T * Is);
  std::vector<int64_t> counts(E);
  for (int64_t e = 0; e < E; ++e) counts[e] = start[e + 1] - start[e];
  std::vector<hs::GemvJob> jobs = hs::expert_jobs(xs.data(), experts_gate_up.data_ptr(),
                                                  experts_gate_up.scalar_type(), counts.data(),
                                                  E, 2 * I, H, gu.data(), bf16_products);
  jobs.push_back(hs::job_of(xp, shared_gate_w, sg.data_ptr<float>(), T, bf16_products));
  jobs.push_back(hs::job_of(xp, shared_gate_proj, sgate.data(), T, bf16_products));
  jobs.push_back(hs::job_of(xp, shared_up_proj, sup.data(), T, bf16_products));
  hs::skinny_linear_jobs(jobs.data(), static_cast<int64_t>(jobs.size()));
  swiglu(gu.data(), gu.data() + I, 2 * I, N, I, act.data());
  swiglu(sgate.data(), sup.data(), Is, T, Is, sact.data());
  jobs = hs::expert_jobs(act.data(), experts_down.data_ptr(), experts_down.scalar_type(),
                         counts.data(), E, H, I, ys.data(), bf16_products);
  jobs.push_back(hs::job_of(sact.data(), shared_down, sy.data_ptr<float>(), T, bf16_products));
  hs::skinny_linear_jobs(jobs.data(), static_cast<int64_t>(jobs.size()));
  for (int64_t r = 0; r < N; ++r) {  // in expert order, as the reference's index_add_
    float* o = op + row_tok[r] * H;
    const float* y = ys.data() + r * H;
    const float w = row_w[r];
    for (int64_t h = 0; h < H; ++h) {
      const float p = y[h] * w;  // rounded, then summed
      o[h] += p;
    }
  }

  // the shared expert, weighted by its sigmoid gate
  const at::Tensor gates = at::sigmoid(sg);
  const float* gp = gates.data_ptr<float>();
  const float* syp = sy.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* o = op + t * H;
    const float* y = syp + t * H;
    for (int64_t h = 0; h < H; ++h) {
      const float p = gp[t] * y[h];
      o[h] += p;
    }
  }
  return out;
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("moe_decode(Tensor x, Tensor router_w, Tensor experts_gate_up, Tensor experts_down, "
        "Tensor shared_gate_w, Tensor shared_gate_proj, Tensor shared_up_proj, "
        "Tensor shared_down, int top_k, bool norm_topk_prob, bool bf16_products=False) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) { m.impl("moe_decode", &hs::moe_decode); }
