// NemotronH's CPU decode step in one call: the class `hybrid_serve::NemotronHStep` holds every
// block's weights and op arguments (taken once by models/cpu_decode.py) and `forward` runs the
// blocks with the eager step's own ops, in its order, called from C++: the C++ kernels where the
// eager step (the C++ kernel set) calls them (hs::linear, hs::linear_multi, hs::mamba2_decode),
// and ATen's ops in the sequence of the torch references where it calls those
// (kernels/rmsnorm.py rms_norm_plain, kernels/attention.py store_kv and decode_attention,
// kernels/relu2_moe.py relu2_moe). So its logits and pool updates are bit-identical to the eager
// step's (the constructor's `bf16_products` is the kernel set's), without the trips through
// Python:
//
//   for each block:  x = x + mixer(rms_norm_plain(x))
//     mixer: out_proj(mamba2_decode(in_proj h))  |  o_proj(decode_attention(store_kv(qkv h)))
//            | down(relu(up h)^2)  |  relu2_moe(h)
//   logits = lm_head(rms_norm_plain(x))
//
// A change to one of those references must be mirrored here: tests/models/test_cpu_decode.py
// compares the two bit for bit.

#include <ATen/ATen.h>
#include <ATen/TensorIndexing.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "decode_ops.h"

namespace hs::nemotron_h {

// The per-block layout of the constructor's flat lists (models/cpu_decode.py writes them).
// ints: kind, index (the Mamba pool layer or the KV layer), then by kind:
//   Mamba: groups, has conv bias, has norm, 0;  attention: heads, KV heads, 0, 0;  MLP: 0s;
//   MoE: top_k, n_group, topk_group, norm_topk_prob.
// floats: the block norm's eps, then Mamba: its norm's eps, dt_min, dt_max; attention: scale;
//   MoE: routed_scaling_factor (0s after).
// tensors: the block norm's weight, then Mamba: in_proj, conv weight [D, K], conv bias (if
//   any), A_log, dt_bias, D, norm weight (if any), out_proj; attention: q, k, v, o; MLP: up,
//   down; MoE: router, its correction bias, experts' up [E, I, H] and down [E, H, I], shared up
//   and down.
constexpr int64_t kInts = 6, kFloats = 4;
enum Kind : int64_t { kMamba = 0, kAttention = 1, kMlp = 2, kMoe = 3 };

struct Block {
  int64_t kind, index, a, b, c, d;
  double eps, f1, f2, f3;
  at::Tensor norm;
  std::vector<at::Tensor> w;
  std::optional<at::Tensor> conv_bias, mixer_norm;
};

// kernels/rmsnorm.py rms_norm_plain
at::Tensor rms_norm_plain(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(at::IntArrayRef{-1}, /*keepdim=*/true) + eps);
  return (weight.to(at::kFloat) * xf).to(x.scalar_type());
}

// kernels/relu2_moe.py relu2
at::Tensor relu2(const at::Tensor& x) { return at::relu(x).square(); }

// kernels/relu2_moe.py route: (weights [T, k] fp32, ids [T, k])
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x, const Block& l) {
  const at::Tensor &router = l.w[0], &bias = l.w[1];
  const int64_t T = x.size(0), E = router.size(0), top_k = l.a, n_group = l.b;
  const at::Tensor scores = at::matmul(x.to(at::kFloat), router.to(at::kFloat).t()).sigmoid();
  const at::Tensor choice = scores + bias.to(at::kFloat);
  const at::Tensor per_group = choice.view({T, n_group, E / n_group});
  const at::Tensor group_rank =
      std::get<0>(per_group.topk(std::min<int64_t>(2, E / n_group), -1)).sum(at::IntArrayRef{-1});
  const at::Tensor best = std::get<1>(group_rank.topk(l.c, -1, true, /*sorted=*/false));
  at::Tensor allowed = at::zeros_like(group_rank, group_rank.options().dtype(at::kBool));
  allowed = allowed.scatter_(1, best, true);
  allowed = allowed.unsqueeze(-1).expand({T, n_group, E / n_group}).reshape({T, E});
  const double inf = std::numeric_limits<double>::infinity();
  const at::Tensor ids = std::get<1>(
      choice.masked_fill(allowed.bitwise_not(), -inf).topk(top_k, -1, true, /*sorted=*/false));
  at::Tensor weights = scores.gather(1, ids);
  if (l.d != 0) weights = weights / (weights.sum(at::IntArrayRef{-1}, /*keepdim=*/true) + 1e-20);
  return {weights * l.f1, ids};
}

// kernels/relu2_moe.py relu2_experts and relu2_moe
at::Tensor relu2_moe(const at::Tensor& x, const Block& l, bool bf16) {
  const auto [topk_w, topk_ids] = route(x, l);
  const at::Tensor &up = l.w[2], &down = l.w[3];
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
  return out.to(x.scalar_type()) + hs::linear(relu2(hs::linear(x, l.w[4], bf16)), l.w[5], bf16);
}

// kernels/attention.py decode_attention over seq_lens' keys (the first `L` columns of each
// request's row of req_to_token)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_slots, const at::Tensor& seq_lens, double scale,
                            int64_t L) {
  using at::indexing::None, at::indexing::Slice;
  const int64_t B = q.size(0), nH = q.size(1), D = q.size(2), nKV = k_buffer.size(1);
  const at::Tensor locs = req_to_token.index({req_slots, Slice(None, L)}).to(at::kLong);
  const at::Tensor valid =
      at::arange(L, seq_lens.options().dtype(at::kLong)).unsqueeze(0) < seq_lens.unsqueeze(1);
  const at::Tensor k = k_buffer.index({locs}).to(q.scalar_type()).permute({0, 2, 1, 3});
  const at::Tensor v = v_buffer.index({locs}).to(q.scalar_type()).permute({0, 2, 1, 3});
  const at::Tensor qg = q.reshape({B, nKV, nH / nKV, D});
  at::Tensor scores = at::matmul(qg, k.transpose(-1, -2)).to(at::kFloat) * scale;
  scores = scores.masked_fill(valid.index({Slice(), None, None, Slice()}).bitwise_not(),
                              -std::numeric_limits<double>::infinity());
  const at::Tensor probs = scores.softmax(-1).to(q.scalar_type());
  return at::matmul(probs, v).reshape({B, nH, D});
}

// The attention block: projections, store_kv at out_loc, decode_attention, o_proj.
at::Tensor attention(const at::Tensor& h, const Block& l, const at::Tensor& k_buf,
                     const at::Tensor& v_buf, const at::Tensor& out_loc,
                     const at::Tensor& req_to_token, const at::Tensor& req_slots,
                     const at::Tensor& seq_lens, int64_t max_seq_len, bool bf16) {
  const int64_t T = h.size(0), heads = l.a, kv_heads = l.b;
  const std::vector<at::Tensor> qkv = hs::linear_multi(h, {l.w[0], l.w[1], l.w[2]}, bf16);
  const int64_t hd = qkv[0].size(1) / heads;
  const at::Tensor q = qkv[0].view({T, heads, hd});
  const at::Tensor k = qkv[1].view({T, kv_heads, hd}), v = qkv[2].view({T, kv_heads, hd});
  const at::Tensor loc = out_loc.to(at::kLong);
  k_buf.index_copy_(0, loc, k.to(k_buf.scalar_type()));
  v_buf.index_copy_(0, loc, v.to(v_buf.scalar_type()));
  const int64_t L = max_seq_len > 0 ? max_seq_len : seq_lens.max().item<int64_t>();
  const at::Tensor o =
      decode_attention(q, k_buf, v_buf, req_to_token, req_slots, seq_lens, l.f1, L);
  return hs::linear(o.reshape({T, -1}), l.w[3], bf16);
}

struct NemotronHStep : torch::CustomClassHolder {
  std::vector<Block> blocks;
  at::Tensor final_norm, lm_head;
  double final_eps;
  bool bf16_products;  // hs::linear's bf16 products at batch (decode_ops.h)

  NemotronHStep(std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
                std::vector<double> floats, at::Tensor final_norm_, double final_eps_,
                at::Tensor lm_head_, bool bf16_products_)
      : final_norm(std::move(final_norm_)),
        lm_head(std::move(lm_head_)),
        final_eps(final_eps_),
        bf16_products(bf16_products_) {
    TORCH_CHECK(ints.size() % kInts == 0 && floats.size() == ints.size() / kInts * kFloats,
                "NemotronHStep: ", kInts, " ints and ", kFloats, " floats per block expected");
    size_t t = 0;
    auto take = [&]() {
      TORCH_CHECK(t < tensors.size(), "NemotronHStep: too few tensors");
      return tensors[t++];
    };
    for (size_t i = 0; i < ints.size() / kInts; ++i) {
      const int64_t* in = ints.data() + i * kInts;
      const double* fl = floats.data() + i * kFloats;
      Block l{in[0], in[1], in[2], in[3], in[4], in[5], fl[0], fl[1], fl[2], fl[3]};
      TORCH_CHECK(l.kind >= kMamba && l.kind <= kMoe, "NemotronHStep: block kind ", l.kind);
      l.norm = take();
      if (l.kind == kMamba) {  // in_proj, conv weight, [conv bias], A_log, dt_bias, D, [norm]
        for (int j = 0; j < 2; ++j) l.w.push_back(take());
        if (l.b != 0) l.conv_bias = take();
        for (int j = 0; j < 3; ++j) l.w.push_back(take());
        if (l.c != 0) l.mixer_norm = take();
        l.w.push_back(take());  // out_proj: w[5]
      } else {
        const int n = l.kind == kAttention ? 4 : l.kind == kMlp ? 2 : 6;
        for (int j = 0; j < n; ++j) l.w.push_back(take());
      }
      blocks.push_back(std::move(l));
    }
    TORCH_CHECK(t == tensors.size(), "NemotronHStep: ", tensors.size() - t, " tensors left over");
  }

  // x [B, hidden] the embedded tokens; the pools as the model's (k_all, v_all [attention
  // layers, locs, kv heads, head dim]; conv_state, ssm_state [Mamba layers, slots, ...]),
  // updated in place; slots, out_loc [B] int64; req_to_token, req_slots, seq_lens as the
  // batch's; max_seq_len the batch's (0: the largest seq_len). Returns the logits [B, vocab].
  at::Tensor forward(at::Tensor x, at::Tensor k_all, at::Tensor v_all, at::Tensor conv_state,
                     at::Tensor ssm_state, at::Tensor slots, at::Tensor out_loc,
                     at::Tensor req_to_token, at::Tensor req_slots, at::Tensor seq_lens,
                     int64_t max_seq_len) {
    for (const Block& l : blocks) {
      const at::Tensor h = rms_norm_plain(x, l.norm, l.eps);
      at::Tensor o;
      if (l.kind == kMamba) {
        const at::Tensor zxbcdt = hs::linear(h, l.w[0], bf16_products);
        const at::Tensor y = hs::mamba2_decode(
            zxbcdt, conv_state.select(0, l.index), l.w[1], l.conv_bias,
            ssm_state.select(0, l.index), l.w[2], l.w[3], l.w[4], l.mixer_norm, slots, l.a, l.f1,
            l.f2, l.f3);
        o = hs::linear(y, l.w[5], bf16_products);
      } else if (l.kind == kAttention) {
        o = attention(h, l, k_all.select(0, l.index), v_all.select(0, l.index), out_loc,
                      req_to_token, req_slots, seq_lens, max_seq_len, bf16_products);
      } else if (l.kind == kMlp) {
        o = hs::linear(relu2(hs::linear(h, l.w[0], bf16_products)), l.w[1], bf16_products);
      } else {
        o = relu2_moe(h, l, bf16_products);
      }
      x = x + o;
    }
    return hs::linear(rms_norm_plain(x, final_norm, final_eps), lm_head, bf16_products);
  }
};

}  // namespace hs::nemotron_h

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  using hs::nemotron_h::NemotronHStep;
  m.class_<NemotronHStep>("NemotronHStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>,
                       at::Tensor, double, at::Tensor, bool>())
      .def("forward", &NemotronHStep::forward);
}
