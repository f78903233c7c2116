// A whole CPU decode step in one call: the class `hybrid_serve::DecodeStep` holds every decoder
// layer's weights and op arguments (taken once by models/cpu_decode.py) and `forward` runs the
// layers by calling the decode ops' C++ functions (decode_ops.h) directly, with the same
// arguments as the eager step and the same products (hs::linear, the one choice by row count),
// so its logits and pool updates are bit-identical to it (the constructor's `bf16_products` is
// the kernel set's), without the ~75 trips per step through Python and the dispatcher:
//
//   for each layer:  h, residual = add_rmsnorm(x, residual)
//                    h = out_proj(gdn_decode(in_projs(h)))   or   o_proj(attn_decode(qkv(h)))
//                    h, residual = add_rmsnorm(h, residual)
//                    x = moe_decode(h)   or   down(silu(gate(h)) * up(h))   (a dense MLP)
//   logits = lm_head(add_rmsnorm(x, residual))

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "decode_ops.h"

namespace {

// The per-layer layout of the constructor's flat lists (models/cpu_decode.py writes them):
// tensors: input_norm, post_norm, out_proj, the MLP's weights (a sparse MoE's seven: router,
// experts' gate_up and down, shared expert gate, gate, up and down; a dense MLP's three: gate,
// up, down), then the input projections (GDN: qkvz, ba; attention: q with its gate, k, v), then
// the mixer's own weights (GDN: conv weight [D, W], A_log, dt_bias, norm weight; attention:
// q_norm, k_norm);
// ints: attention (0/1), pool layer index, heads (GDN: key heads; attention: query heads),
// top_k (0: a dense MLP), norm_topk_prob; floats: input eps, post eps, mixer eps, attention
// scale (GDN: 0).
constexpr int64_t kInts = 5, kFloats = 4, kMoe = 7, kDense = 3;

// models.layers.MLP with the eager step's ops (its two input products are each the product
// hs::linear picks, so the one call over both gives the same sums): down(silu(gate h) * up h).
at::Tensor dense_mlp(const at::Tensor& h, const std::vector<at::Tensor>& w, bool bf16_products) {
  const std::vector<at::Tensor> gate_up = hs::linear_multi(h, {w[0], w[1]}, bf16_products);
  return hs::linear(at::silu(gate_up[0]).mul_(gate_up[1]), w[2], bf16_products);
}


struct Layer {
  bool attention;
  int64_t index, heads, top_k;
  bool norm_topk;
  double eps, post_eps, mixer_eps, scale;
  at::Tensor input_norm, post_norm, out_proj;
  std::vector<at::Tensor> mlp, in_projs, mixer;  // mlp: kMoe or kDense weights
};

}  // namespace

struct DecodeStep : torch::CustomClassHolder {
  std::vector<Layer> layers;
  at::Tensor final_norm, lm_head;
  double final_eps;
  bool bf16_products;  // hs::linear's bf16 products at batch (decode_ops.h)

  DecodeStep(std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
             std::vector<double> floats, at::Tensor final_norm_, double final_eps_,
             at::Tensor lm_head_, bool bf16_products_)
      : final_norm(std::move(final_norm_)),
        lm_head(std::move(lm_head_)),
        final_eps(final_eps_),
        bf16_products(bf16_products_) {
    TORCH_CHECK(ints.size() % kInts == 0 && floats.size() == ints.size() / kInts * kFloats,
                "DecodeStep: ", kInts, " ints and ", kFloats, " floats per layer expected");
    size_t t = 0;
    auto take = [&](size_t n) {
      TORCH_CHECK(t + n <= tensors.size(), "DecodeStep: too few tensors");
      std::vector<at::Tensor> out(tensors.begin() + t, tensors.begin() + t + n);
      t += n;
      return out;
    };
    for (size_t i = 0; i < ints.size() / kInts; ++i) {
      const int64_t* in = ints.data() + i * kInts;
      const double* fl = floats.data() + i * kFloats;
      Layer l{in[0] != 0, in[1], in[2], in[3], in[4] != 0, fl[0], fl[1], fl[2], fl[3]};
      const std::vector<at::Tensor> common = take(3);
      l.input_norm = common[0];
      l.post_norm = common[1];
      l.out_proj = common[2];
      l.mlp = take(l.top_k > 0 ? kMoe : kDense);
      l.in_projs = take(l.attention ? 3 : 2);
      l.mixer = take(l.attention ? 2 : 4);
      layers.push_back(std::move(l));
    }
    TORCH_CHECK(t == tensors.size(), "DecodeStep: ", tensors.size() - t, " tensors left over");
  }

  // x [B, hidden] the embedded tokens; cos, sin [B, rot]; the pools as the model's
  // (k_all, v_all [attention layers, locs, kv heads, head dim]; conv_state, ssm_state
  // [GDN layers, slots, ...]), updated in place; slots, out_loc, req_slots, seq_lens [B] int64;
  // req_to_token [rows, context]. Returns the logits [B, vocab].
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_all,
                     at::Tensor v_all, at::Tensor conv_state, at::Tensor ssm_state,
                     at::Tensor slots, at::Tensor out_loc, at::Tensor req_to_token,
                     at::Tensor req_slots, at::Tensor seq_lens) {
    const at::Tensor h = run(x, cos, sin, k_all, v_all, conv_state, ssm_state, slots, {}, {},
                             out_loc, req_to_token, req_slots, seq_lens);
    return hs::linear(h, lm_head, bf16_products);
  }

  // Speculative verify: the B rows are N requests' few tokens each, request n's rows
  // [starts[n], starts[n+1]) at consecutive positions (their seq_lens), its state in slots[n]
  // [N] stepped through them in order, the state after each row but its last kept in
  // steps[n] (gdn_verify); attention sees each row's earlier rows (attn_decode writes every
  // row's K/V first). Returns (logits [B, vocab], final normed hidden [B, hidden]).
  std::tuple<at::Tensor, at::Tensor> verify(
      at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_all, at::Tensor v_all,
      at::Tensor conv_state, at::Tensor ssm_state, at::Tensor slots, at::Tensor starts,
      at::Tensor steps, at::Tensor out_loc, at::Tensor req_to_token, at::Tensor req_slots,
      at::Tensor seq_lens) {
    TORCH_CHECK(starts.defined() && steps.defined(), "DecodeStep.verify: starts and steps");
    const at::Tensor h = run(x, cos, sin, k_all, v_all, conv_state, ssm_state, slots, starts,
                             steps, out_loc, req_to_token, req_slots, seq_lens);
    return {hs::linear(h, lm_head, bf16_products), h};
  }

 private:
  // The layers and the final norm: the normed hidden states [B, hidden]. With `starts`
  // defined, the GDN layers run gdn_verify over the requests' rows, else gdn_decode per row.
  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& k_all, const at::Tensor& v_all, const at::Tensor& conv_state,
                 const at::Tensor& ssm_state, const at::Tensor& slots, const at::Tensor& starts,
                 const at::Tensor& steps, const at::Tensor& out_loc,
                 const at::Tensor& req_to_token, const at::Tensor& req_slots,
                 const at::Tensor& seq_lens) {
    at::Tensor residual;
    for (const Layer& l : layers) {
      at::Tensor h;
      if (!residual.defined()) {
        h = hs::rmsnorm(x, l.input_norm, l.eps);
        residual = x;
      } else {
        std::tie(h, residual) = hs::add_rmsnorm(x, residual, l.input_norm, l.eps);
      }
      const std::vector<at::Tensor> p = hs::linear_multi(h, l.in_projs, bf16_products);
      at::Tensor o;
      if (l.attention) {
        o = hs::attn_decode(p[0], p[1], p[2], l.mixer[0], l.mixer[1], cos, sin,
                            k_all.select(0, l.index), v_all.select(0, l.index), out_loc,
                            req_to_token, req_slots, seq_lens, l.heads, l.scale, l.mixer_eps);
      } else if (starts.defined()) {
        o = hs::gdn_verify(p[0], p[1], conv_state.select(0, l.index), l.mixer[0],
                           ssm_state.select(0, l.index), l.mixer[1], l.mixer[2], l.mixer[3],
                           slots, starts, steps, l.heads, l.mixer_eps);
      } else {
        o = hs::gdn_decode(p[0], p[1], conv_state.select(0, l.index), l.mixer[0],
                           ssm_state.select(0, l.index), l.mixer[1], l.mixer[2], l.mixer[3],
                           slots, l.heads, l.mixer_eps);
      }
      h = hs::linear(o, l.out_proj, bf16_products);
      std::tie(h, residual) = hs::add_rmsnorm(h, residual, l.post_norm, l.post_eps);
      x = l.top_k == 0 ? dense_mlp(h, l.mlp, bf16_products)
                       : hs::moe_decode(h, l.mlp[0], l.mlp[1], l.mlp[2], l.mlp[3], l.mlp[4],
                                        l.mlp[5], l.mlp[6], l.top_k, l.norm_topk, bf16_products);
    }
    return residual.defined() ? std::get<0>(hs::add_rmsnorm(x, residual, final_norm, final_eps))
                              : hs::rmsnorm(x, final_norm, final_eps);
  }
};

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>,
                       at::Tensor, double, at::Tensor, bool>())
      .def("forward", &DecodeStep::forward)
      .def("verify", &DecodeStep::verify);
}
