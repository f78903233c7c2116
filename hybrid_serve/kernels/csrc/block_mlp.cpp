// The block step's MLP kinds: SwiGLU (with the families' multipliers), relu^2, and the MoEs
// (Qwen3-Next's fused moe_decode, NemotronH's relu^2 MoE, Granite's top-k MoE, LFM2-MoE's
// sigmoid-routed MoE, Kimi's grouped MoE), each the eager step's ops in its order.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "block_step.h"
#include "decode_ops.h"

namespace hs::blocks {

// kernels/relu2_moe.py relu2
at::Tensor relu2(const at::Tensor& x) { return at::relu(x).square(); }

// kernels/relu2_moe.py route (sigmoid scores, or softmax ones: m.softmax): (weights [T, k]
// fp32, ids [T, k])
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x, const Mlp& m) {
  const at::Tensor &router = m.w[0], &bias = m.w[1];
  const int64_t T = x.size(0), E = router.size(0), n_group = m.n_group;
  const at::Tensor logits = at::matmul(x.to(at::kFloat), router.to(at::kFloat).t());
  const at::Tensor scores = m.softmax ? logits.softmax(-1) : logits.sigmoid();
  const at::Tensor choice = scores + bias.to(at::kFloat);
  const at::Tensor per_group = choice.view({T, n_group, E / n_group});
  const at::Tensor group_rank =
      std::get<0>(per_group.topk(std::min<int64_t>(2, E / n_group), -1)).sum(at::IntArrayRef{-1});
  const at::Tensor best = std::get<1>(group_rank.topk(m.topk_group, -1, true, /*sorted=*/false));
  at::Tensor allowed = at::zeros_like(group_rank, group_rank.options().dtype(at::kBool));
  allowed = allowed.scatter_(1, best, true);
  allowed = allowed.unsqueeze(-1).expand({T, n_group, E / n_group}).reshape({T, E});
  const double inf = std::numeric_limits<double>::infinity();
  const at::Tensor ids = std::get<1>(choice.masked_fill(allowed.bitwise_not(), -inf)
                                         .topk(m.top_k, -1, true, /*sorted=*/false));
  at::Tensor weights = scores.gather(1, ids);
  if (m.flag) weights = weights / (weights.sum(at::IntArrayRef{-1}, /*keepdim=*/true) + 1e-20);
  return {weights * m.out_mult, ids};
}

// kernels/relu2_moe.py relu2_experts and relu2_moe (the experts in the latent width where the
// block has fc1 and fc2: w[6], w[7])
at::Tensor relu2_moe(const at::Tensor& h, const Mlp& m, bool bf16) {
  const auto [topk_w, topk_ids] = route(h, m);
  const bool latent = m.w.size() == 8;
  const at::Tensor x = latent ? hs::linear(h, m.w[6], bf16) : h;
  const at::Tensor &up = m.w[2], &down = m.w[3];
  at::Tensor out = at::zeros({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  const at::Tensor flat = topk_ids.flatten();
  const at::Tensor order = at::argsort(flat, /*stable=*/true, -1, false);
  const at::Tensor counts = at::bincount(flat, {}, up.size(0)).contiguous();
  const at::Tensor token_of = at::floor_divide(order, topk_ids.size(1));
  const at::Tensor weight_of = topk_w.flatten().index({order});
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t e = 0; e < up.size(0); ++e) {
    const int64_t n = count[e];
    if (n == 0) continue;
    const at::Tensor rows = token_of.slice(0, start, start + n);
    const at::Tensor y =
        hs::linear(relu2(hs::linear(x.index({rows}), up[e], bf16)), down[e], bf16);
    out.index_add_(0, rows, y.to(at::kFloat) * weight_of.slice(0, start, start + n).unsqueeze(1));
    start += n;
  }
  out = out.to(h.scalar_type());
  if (latent) out = hs::linear(out, m.w[7], bf16);
  return out + hs::linear(relu2(hs::linear(h, m.w[4], bf16)), m.w[5], bf16);
}

// models/layers.py MLP, models/bamba.py BambaMLP and models/granite_moe_hybrid.py's shared MLP:
// down(silu(gate(x) * gate_mult) * up(x)) * out_mult. Separate gate and up matrices take one
// linear_multi (each of its products is the one hs::linear picks, so the sums are the eager
// step's two calls'); a fused [gate | up] matrix one product, chunked.
at::Tensor swiglu(const at::Tensor& h, const Mlp& m, bool bf16) {
  at::Tensor gate, up;
  if (m.flag) {
    const std::vector<at::Tensor> parts = hs::linear(h, m.w[0], bf16).chunk(2, -1);
    gate = parts[0];
    up = parts[1];
  } else {
    const std::vector<at::Tensor> gate_up = hs::linear_multi(h, {m.w[0], m.w[1]}, bf16);
    gate = gate_up[0];
    up = gate_up[1];
  }
  const at::Tensor act = at::silu(scaled(gate, m.gate_mult)).mul_(up);
  return scaled(hs::linear(act, m.w.back(), bf16), m.out_mult);
}

// kernels/experts.py fused_experts with the kernel set's routed experts (the C++ op): the
// (token, expert) pairs sorted by expert, their rows through the experts, weighted and summed
// back per token. ids, weights [T, k]; gate_up [E, 2I, H], down [E, H, I]; `bf16`: the bf16 route
// (bf16 experts in K-pair panels, decode_ops.h).
at::Tensor fused_experts(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& weights,
                         const at::Tensor& gate_up, const at::Tensor& down,
                         bool bf16, double limit = 0.0) {
  const at::Tensor flat = ids.flatten();
  const at::Tensor order = at::argsort(flat, /*stable=*/true, -1, false);
  const at::Tensor counts = at::bincount(flat, {}, gate_up.size(0)).contiguous();
  const at::Tensor token_of = at::floor_divide(order, ids.size(1));
  const at::Tensor xs = h.index({token_of}).contiguous();
  TORCH_CHECK(xs.size(0) <= kRoutedMaxRows, "BlockStep: ", xs.size(0),
              " routed rows, beyond the routed experts' op");
  at::Tensor ys = at::empty({xs.size(0), xs.size(1)}, xs.options());
  const int64_t* count = counts.data_ptr<int64_t>();
  hs::routed_experts_into(xs.data_ptr<float>(), gate_up, down,
                          std::vector<int64_t>(count, count + counts.numel()),
                          ys.data_ptr<float>(), static_cast<float>(limit), bf16);
  ys = ys * weights.flatten().index({order}).unsqueeze(1);
  return at::zeros_like(h).index_add_(0, token_of, ys);
}

// models/granite_moe_hybrid.py GraniteMoeHybridMoE (the router's top-k logits' softmax over
// fused_experts) plus the shared SwiGLU, times the residual multiplier
at::Tensor topk_moe(const at::Tensor& h, const Mlp& m, bool bf16) {
  const at::Tensor logits = hs::linear(h, m.w[0], bf16);
  const auto [top_logits, top_ids] = logits.topk(m.top_k, -1);
  const at::Tensor moe =
      fused_experts(h, top_ids, at::softmax(top_logits, -1), m.w[1], m.w[2], bf16);
  Mlp shared;
  shared.flag = true;
  shared.w = {m.w[3], m.w[4]};
  return scaled(moe + swiglu(h, shared, bf16), m.out_mult);
}

// models/lfm2.py Lfm2SparseMoe: the fp32 router's sigmoid scores, the top-k of the scores plus
// the expert bias (of the scores alone without one), the picked scores renormalised
// (norm_topk_prob) and times the routed scaling, over fused_experts; the router w[0] in row
// order (the plan hands its rows over: models/plan_builders.py)
at::Tensor sigmoid_moe(const at::Tensor& h, const Mlp& m, bool bf16) {
  const bool bias = m.w.size() == 4;
  const at::Tensor scores = at::linear(h.to(at::kFloat), m.w[0].to(at::kFloat)).sigmoid();
  at::Tensor weights, ids;
  if (bias) {
    ids = std::get<1>((scores + m.w[1].to(at::kFloat)).topk(m.top_k, -1));
    weights = scores.gather(1, ids);
  } else {
    std::tie(weights, ids) = scores.topk(m.top_k, -1);
  }
  if (m.flag) weights = weights / (weights.sum(at::IntArrayRef{-1}, /*keepdim=*/true) + 1e-6);
  weights = weights * m.out_mult;
  return fused_experts(h, ids, weights, m.w[bias ? 2 : 1], m.w[bias ? 3 : 2], bf16);
}

// models/kimi_moe.py KimiMoE: the grouped router (`route`) over fused_experts, plus the shared
// SwiGLU (models/layers.py MLP); with Ling-3's limits the routed experts' SwiGLU clamped in the
// C++ op and the shared one as kernels/experts.py `swiglu` clamps it (`KimiMoE._shared`)
at::Tensor grouped_moe(const at::Tensor& h, const Mlp& m, bool bf16) {
  const auto [weights, ids] = route(h, m);
  const at::Tensor moe = fused_experts(h, ids, weights, m.w[2], m.w[3], bf16, m.limit);
  if (m.shared_limit > 0.0) {
    const std::vector<at::Tensor> gate_up = hs::linear_multi(h, {m.w[4], m.w[5]}, bf16);
    const double l = m.shared_limit;
    const at::Tensor act = at::silu(gate_up[0]).clamp_max(l) * gate_up[1].clamp(-l, l);
    return moe + hs::linear(act, m.w[6], bf16);
  }
  Mlp shared;
  shared.w = {m.w[4], m.w[5], m.w[6]};
  return moe + swiglu(h, shared, bf16);
}

at::Tensor mlp(const at::Tensor& h, const Mlp& m, bool bf16) {
  switch (m.kind) {
    case kSwiglu: return swiglu(h, m, bf16);
    case kRelu2: return hs::linear(relu2(hs::linear(h, m.w[0], bf16)), m.w[1], bf16);
    case kSparseMoe:
      return hs::moe_decode(h, m.w[0], m.w[1], m.w[2], m.w[3], m.w[4], m.w[5], m.w[6], m.top_k,
                            m.flag, bf16);
    case kRelu2Moe: return relu2_moe(h, m, bf16);
    case kTopkMoe: return topk_moe(h, m, bf16);
    case kGroupedMoe: return grouped_moe(h, m, bf16);
    default: return sigmoid_moe(h, m, bf16);
  }
}

}  // namespace hs::blocks
