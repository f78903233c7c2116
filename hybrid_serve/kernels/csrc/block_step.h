// The block step's shared types (block_step.cpp runs them): the block kinds (the enums that
// models/plan_blocks.py mirrors), each kind's arguments as the constructor reads them
// (block_layout.cpp), the batch the mixers read, and the ATen compositions more than one kind
// calls. The kinds' forwards live by concern: block_recurrent.cpp (GDN, Mamba2, short conv,
// KDA), block_attention.cpp (GQA, gated attention, MLA), block_mlp.cpp (the MLPs and MoEs).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace hs::blocks {

enum Norm : int64_t { kDeferred = 0, kPre = 1, kPost = 2, kSandwich = 3 };
enum MixerKind : int64_t {
  kNoMixer = 0, kGdn = 1, kMamba2 = 2, kAttention = 3, kGatedAttention = 4, kParallel = 5,
  kKda = 6, kShortConv = 7, kMla = 8,
};
enum MlpKind : int64_t {
  kNoMlp = 0, kSwiglu = 1, kRelu2 = 2, kSparseMoe = 3, kRelu2Moe = 4, kTopkMoe = 5,
  kSigmoidMoe = 6, kGroupedMoe = 7,
};
// q/k norms of the attention: none, one RMSNorm over all heads' channels (OLMo-Hybrid), or one
// per head over head_dim (LFM2)
enum QkNorm : int64_t { kNoQkNorm = 0, kWholeQkNorm = 1, kPerHeadQkNorm = 2 };
// The routed experts' C++ op runs up to this many (token, expert) rows (kernels/cpp_ops.py
// ROUTED_MAX_ROWS; beyond, the eager step runs the reference, so the plan does not).
constexpr int64_t kRoutedMaxRows = 256;

struct Gdn {
  int64_t layer, key_heads;
  double eps, beta_scale;
  std::vector<at::Tensor> w;  // qkvz, ba, conv weight, A_log, dt_bias, norm, out_proj
};

struct Mamba2 {
  int64_t layer, groups;
  double eps, dt_min, dt_max, in_mult, out_mult;
  at::Tensor in_proj, conv_weight, A_log, dt_bias, D, out_proj;
  std::optional<at::Tensor> conv_bias, norm, scale;
};

struct Attention {
  int64_t layer, heads, kv_heads, qk_norm, rope, window;
  double scale, qk_eps, key_mult, in_mult, out_mult;
  std::vector<at::Tensor> w;  // q, k, v, o
  at::Tensor q_norm, k_norm;  // undefined: no q/k norms
  std::optional<at::Tensor> gate;
};

struct ShortConv {
  int64_t layer;
  at::Tensor in_proj, conv_weight, out_proj;
};

struct GatedAttention {
  int64_t layer, heads;
  double eps, scale;
  std::vector<at::Tensor> w;  // q with its gate, k, v, q_norm, k_norm, o
};

struct Kda {
  int64_t layer;
  bool full_rank;  // Ling-3's f and g projections, else Kimi's low-rank f_a/f_b, g_a/g_b
  double eps;
  std::optional<double> lower_bound;  // Ling-3's bounded forget gate
  // q, k, v, b, then f_a, g_a, f_b, g_b (or f, g), then conv, A_log, dt_bias, norm, o
  std::vector<at::Tensor> w;
};

struct Mla {
  int64_t layer, heads, rank, nope, rope_dim, v_dim;
  bool rope;
  double scale, q_eps, kv_eps;
  std::optional<at::Tensor> q_proj, q_a, q_a_norm, q_b, g_proj;  // q, or q_a, its norm and q_b
  at::Tensor kv_a, kv_a_norm, kv_b, o_proj;
};

struct Mlp {
  int64_t kind = kNoMlp, top_k = 0, n_group = 0, topk_group = 0;
  bool flag = false;     // SwiGLU: fused gate|up; the MoEs: norm_topk_prob
  bool softmax = false;  // grouped MoE: softmax scores over the experts (else sigmoid)
  double gate_mult = 1.0, out_mult = 1.0;  // relu^2 MoE: out_mult is the routed scaling
  double limit = 0.0, shared_limit = 0.0;  // grouped MoE: the SwiGLU clamps (0: none)
  std::vector<at::Tensor> w;
};

struct Block {
  int64_t norm_kind, mixer_kind;
  at::Tensor mixer_norm, mlp_norm;
  double mixer_eps = 0.0, mlp_eps = 0.0;
  at::Tensor mixer_out_norm, mlp_out_norm;  // kSandwich: the sublayers' output norms
  double mixer_out_eps = 0.0, mlp_out_eps = 0.0;
  std::optional<Gdn> gdn;
  std::optional<Mamba2> mamba;
  std::optional<Attention> attn;
  std::optional<GatedAttention> gated;
  std::optional<ShortConv> conv;
  std::optional<Kda> kda;
  std::optional<Mla> mla;
  Mlp mlp;
};

// What the mixers read besides their own weights: the batch and the pools.
struct Batch {
  at::Tensor cos, sin, k_all, v_all, conv_state, ssm_state, slots, starts, steps, out_loc,
      req_to_token, req_slots, seq_lens;
  int64_t max_seq_len;  // 0: the largest seq_len
  bool bf16;
  bool extend = false;  // verify: GQA attends as the eager extend (else as its decode)
};

// x * multiplier, as the families' `scaled` (no op at 1)
inline at::Tensor scaled(const at::Tensor& x, double multiplier) {
  return multiplier == 1.0 ? x : x * multiplier;
}

// kernels/rmsnorm.py rms_norm_plain
inline at::Tensor rms_norm_plain(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(at::IntArrayRef{-1}, /*keepdim=*/true) + eps);
  return (weight.to(at::kFloat) * xf).to(x.scalar_type());
}

// kernels/attn_step.py apply_rope: x [T, heads, D], cos/sin [T, rot]
inline at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rot = cos.size(-1), D = x.size(-1);
  const at::Tensor x_rot = x.narrow(-1, 0, rot), x_pass = x.narrow(-1, rot, D - rot);
  const at::Tensor x1 = x_rot.narrow(-1, 0, rot / 2), x2 = x_rot.narrow(-1, rot / 2, rot - rot / 2);
  const at::Tensor rotated = at::cat({-x2, x1}, -1);
  return at::cat({x_rot * cos.unsqueeze(1) + rotated * sin.unsqueeze(1), x_pass}, -1);
}

// block_layout.cpp: the blocks of the constructor's flat lists (its layout is written there),
// every argument checked against its kind; TORCH_CHECK fails on a malformed list
std::vector<Block> read_blocks(const std::vector<at::Tensor>& tensors,
                               const std::vector<int64_t>& ints,
                               const std::vector<double>& floats);

// The sublayers' decode forwards: h the normed input [B, hidden] -> the output [B, hidden]; the
// mixers update the pools of `b` in place.
// block_recurrent.cpp
at::Tensor gdn(const at::Tensor& h, const Gdn& g, const Batch& b);
at::Tensor mamba2(const at::Tensor& x, const Mamba2& m, const Batch& b);
at::Tensor short_conv(const at::Tensor& h, const ShortConv& s, const Batch& b);
at::Tensor kda(const at::Tensor& h, const Kda& k, const Batch& b);
// block_attention.cpp
at::Tensor attention(const at::Tensor& x, const Attention& a, const Batch& b);
at::Tensor gated_attention(const at::Tensor& h, const GatedAttention& a, const Batch& b);
at::Tensor mla(const at::Tensor& h, const Mla& a, const Batch& b);
// block_mlp.cpp: the MLP of kind m.kind
at::Tensor mlp(const at::Tensor& h, const Mlp& m, bool bf16);

}  // namespace hs::blocks
