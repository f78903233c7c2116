// A whole CPU decode step in one call, built from the model's layer list: the class
// `hybrid_serve::BlockStep` holds a sequence of blocks, each a (norm, mixer kind, MLP kind) with
// its weights and op arguments (taken once by models/plan_builders.py), and `forward` runs them
// with the eager step's own ops, in its order, called from C++: the C++ kernels where the eager
// step (the C++ kernel set with its fusions) calls them (decode_ops.h: hs::linear,
// hs::linear_multi, the norms, the fused GDN, KDA, Mamba2, gated-attention and MoE decode ops,
// the unfused conv update (the short conv's too) and delta rule, the routed experts) and ATen's
// ops in the sequence of the torch references where it calls those
// (kernels/rmsnorm.py rms_norm_plain, kernels/attn_step.py apply_rope, kernels/attention.py
// store_kv and decode_attention, kernels/gdn_step.py gates, kernels/relu2_moe.py relu2_moe,
// kernels/experts.py fused_experts and the clamped swiglu, the LFM2 modules' elementwise gates
// and router, and MLA's absorbed decode (models/mla_attention.py)). So its logits and pool
// updates are bit-identical to the eager step's (the constructor's `bf16_products` is the
// kernel set's), without the trips through Python and the dispatcher. A change to one of those references or to a family's layer
// must be mirrored here: tests/models/test_cpu_decode.py compares the two bit for bit.
//
// A block has one or two sublayers, the mixer's and the MLP's (either may be absent: NemotronH's
// blocks have one), each with its own norm weight, placed by the block's norm kind:
//
//   kDeferred (Qwen3-Next):  h, r = add_rmsnorm(pending, r);  pending = sublayer(h)
//                            (the first block's first norm: rmsnorm(x), r = x)
//   kPre:                    x = x + sublayer(rms_norm_plain(x))
//   kPost (OLMo attention):  x = x + rms_norm_plain(sublayer(x))
//   kSandwich (LFM3):        x = x + rms_norm_plain(sublayer(rms_norm_plain(x)))   (two norm
//                            weights per sublayer, the input's and the output's)
//
//   logits = lm_head(final norm)   (add_rmsnorm(pending, r) after kDeferred blocks, else plain)
//
// The files: block_step.h (the kinds' types and the batch), block_layout.cpp (the constructor's
// flat lists), block_recurrent.cpp, block_attention.cpp and block_mlp.cpp (the kinds' forwards),
// and here the step itself: the blocks in order with their norms, and the op registration.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "block_step.h"
#include "decode_ops.h"

namespace hs::blocks {

at::Tensor mixer(const at::Tensor& h, const Block& l, const Batch& b) {
  switch (l.mixer_kind) {
    case kGdn: return gdn(h, *l.gdn, b);
    case kMamba2: return mamba2(h, *l.mamba, b);
    case kAttention: return attention(h, *l.attn, b);
    case kGatedAttention: return gated_attention(h, *l.gated, b);
    case kShortConv: return short_conv(h, *l.conv, b);
    case kKda: return kda(h, *l.kda, b);
    case kMla: return mla(h, *l.mla, b);
    default: {  // kParallel: Mamba2 first, as the eager layer
      const at::Tensor ssm = mamba2(h, *l.mamba, b);
      return ssm + attention(h, *l.attn, b);
    }
  }
}

struct BlockStep : torch::CustomClassHolder {
  std::vector<Block> blocks;
  at::Tensor final_norm, lm_head;
  double final_eps;
  bool deferred = false;  // the blocks' norm kind is kDeferred
  bool bf16_products;     // hs::linear's bf16 products at batch (decode_ops.h)

  BlockStep(std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
            std::vector<double> floats, at::Tensor final_norm_, double final_eps_,
            at::Tensor lm_head_, bool bf16_products_)
      : final_norm(std::move(final_norm_)),
        lm_head(std::move(lm_head_)),
        final_eps(final_eps_),
        bf16_products(bf16_products_) {
    blocks = read_blocks(tensors, ints, floats);
    deferred = !blocks.empty() && blocks.front().norm_kind == kDeferred;
  }

  // x [B, hidden] the embedded tokens; cos, sin [B, rot] or [sets, B, rot] (empty without
  // positions); the pools as the model's (k_all, v_all [attention layers, locs, kv heads, head
  // dim]; conv_state, ssm_state [recurrent layers, slots, ...]), updated in place; slots,
  // out_loc, req_slots, seq_lens [B] int64; req_to_token [rows, context]; max_seq_len the
  // batch's (0: the largest seq_len). Returns the logits [B, vocab].
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_all,
                     at::Tensor v_all, at::Tensor conv_state, at::Tensor ssm_state,
                     at::Tensor slots, at::Tensor out_loc, at::Tensor req_to_token,
                     at::Tensor req_slots, at::Tensor seq_lens, int64_t max_seq_len) {
    const Batch b{cos, sin, k_all, v_all, conv_state, ssm_state, slots, {}, {}, out_loc,
                  req_to_token, req_slots, seq_lens, max_seq_len, bf16_products};
    return hs::linear(run(x, b), lm_head, bf16_products);
  }

  // Speculative verify (blocks whose mixers have a verify form: GDN without a beta scale, gated
  // attention, Mamba2, GQA, and the two side by side): the B rows are N requests' few tokens
  // each, request n's rows [starts[n], starts[n+1]) at consecutive positions (their seq_lens),
  // its recurrent states in slots[n] [N] stepped through them in order, the states after each
  // row but its last kept in steps[n] (gdn_verify, mamba2_verify); attention sees each row's
  // earlier rows (gated attention: attn_decode writes every row's K/V first; GQA: with
  // `extend`, the eager model's extend attention over the request's rows, else its decode
  // attention with max_seq_len, as the eager model attends in a batch of that phase). Returns
  // (logits [B, vocab], final normed hidden [B, hidden]).
  std::tuple<at::Tensor, at::Tensor> verify(
      at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_all, at::Tensor v_all,
      at::Tensor conv_state, at::Tensor ssm_state, at::Tensor slots, at::Tensor starts,
      at::Tensor steps, at::Tensor out_loc, at::Tensor req_to_token, at::Tensor req_slots,
      at::Tensor seq_lens, int64_t max_seq_len, bool extend) {
    TORCH_CHECK(starts.defined() && steps.defined(), "BlockStep.verify: starts and steps");
    for (const Block& l : blocks) {
      const int64_t k = l.mixer_kind;
      TORCH_CHECK(k == kNoMixer || k == kGdn || k == kGatedAttention || k == kMamba2 ||
                      k == kAttention || k == kParallel,
                  "BlockStep.verify: a mixer kind without a verify form (", k, ")");
    }
    const Batch b{cos, sin, k_all, v_all, conv_state, ssm_state, slots, starts, steps, out_loc,
                  req_to_token, req_slots, seq_lens, max_seq_len, bf16_products, extend};
    const at::Tensor h = run(x, b);
    return {hs::linear(h, lm_head, bf16_products), h};
  }

 private:
  // The blocks and the final norm: the normed hidden states [B, hidden].
  at::Tensor run(at::Tensor x, const Batch& b) const {
    at::Tensor residual;  // kDeferred: the stream before the pending output x
    for (const Block& l : blocks) {
      const bool has_mixer = l.mixer_kind != kNoMixer, has_mlp = l.mlp.kind != kNoMlp;
      if (l.norm_kind == kDeferred) {
        for (int part = 0; part < 2; ++part) {
          if (part == 0 ? !has_mixer : !has_mlp) continue;
          const at::Tensor& w = part == 0 ? l.mixer_norm : l.mlp_norm;
          const double eps = part == 0 ? l.mixer_eps : l.mlp_eps;
          at::Tensor h;
          if (!residual.defined()) {
            h = hs::rmsnorm(x, w, eps);
            residual = x;
          } else {
            std::tie(h, residual) = hs::add_rmsnorm(x, residual, w, eps);
          }
          x = part == 0 ? mixer(h, l, b) : mlp(h, l.mlp, bf16_products);
        }
      } else if (l.norm_kind == kPre) {
        if (has_mixer) x = x + mixer(rms_norm_plain(x, l.mixer_norm, l.mixer_eps), l, b);
        if (has_mlp) x = x + mlp(rms_norm_plain(x, l.mlp_norm, l.mlp_eps), l.mlp, bf16_products);
      } else if (l.norm_kind == kSandwich) {
        if (has_mixer) {
          const at::Tensor h = mixer(rms_norm_plain(x, l.mixer_norm, l.mixer_eps), l, b);
          x = x + rms_norm_plain(h, l.mixer_out_norm, l.mixer_out_eps);
        }
        if (has_mlp) {
          const at::Tensor h = mlp(rms_norm_plain(x, l.mlp_norm, l.mlp_eps), l.mlp, bf16_products);
          x = x + rms_norm_plain(h, l.mlp_out_norm, l.mlp_out_eps);
        }
      } else {
        if (has_mixer) x = x + rms_norm_plain(mixer(x, l, b), l.mixer_norm, l.mixer_eps);
        if (has_mlp) x = x + rms_norm_plain(mlp(x, l.mlp, bf16_products), l.mlp_norm, l.mlp_eps);
      }
    }
    if (!deferred) return rms_norm_plain(x, final_norm, final_eps);
    return residual.defined() ? std::get<0>(hs::add_rmsnorm(x, residual, final_norm, final_eps))
                              : hs::rmsnorm(x, final_norm, final_eps);
  }
};

}  // namespace hs::blocks

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  using hs::blocks::BlockStep;
  m.class_<BlockStep>("BlockStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>,
                       at::Tensor, double, at::Tensor, bool>())
      .def("forward", &BlockStep::forward)
      .def("verify", &BlockStep::verify);
}
