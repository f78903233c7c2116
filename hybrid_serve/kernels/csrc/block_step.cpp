// A whole CPU decode step in one call, built from the model's layer list: the class
// `hybrid_serve::BlockStep` holds a sequence of blocks, each a (norm, mixer kind, MLP kind) with
// its weights and op arguments (taken once by models/cpu_decode.py), and `forward` runs them with
// the eager step's own ops, in its order, called from C++: the C++ kernels where the eager step
// (the C++ kernel set with its fusions) calls them (decode_ops.h: hs::linear, hs::linear_multi,
// the norms, the fused GDN, Mamba2, gated-attention and MoE decode ops, the unfused conv update
// (the short conv's too) and delta rule) and ATen's ops in the sequence of the torch references where it calls those
// (kernels/rmsnorm.py rms_norm_plain, kernels/attn_step.py apply_rope, kernels/attention.py
// store_kv and decode_attention, kernels/gdn_step.py gates, kernels/relu2_moe.py relu2_moe,
// kernels/experts.py fused_experts, the LFM2 modules' elementwise gates and router, Kimi's KDA
// gates and sigmoid-gated norm (kernels/gdn_step.py, kernels/rmsnorm.py) and MLA's absorbed
// decode (models/mla_attention.py)). So its logits and pool updates are bit-identical to the
// eager step's (the constructor's `bf16_products` is the kernel set's), without the trips
// through Python and the dispatcher. A change to one of those references or to a family's layer
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

#include <ATen/ATen.h>
#include <ATen/TensorIndexing.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "decode_ops.h"

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

// The constructor's flat lists, read in order. Per block: ints [norm kind, mixer kind, MLP
// kind]; then for each sublayer present, mixer first: its norm's weight (tensors) and eps
// (floats) (kSandwich: the input norm's, then the output norm's), then its own arguments:
//
//   GDN             ints [pool layer, key heads]; floats [norm eps, beta scale];
//                   tensors [qkvz, ba, conv weight [D, W], A_log, dt_bias, norm, out_proj]
//                   (beta scale 1: the fused gdn_decode; else kernels/gdn_step.py's composition)
//   Mamba2          ints [pool layer, groups, has conv bias, has norm, has zxbcdt scale];
//                   floats [norm eps, dt_min, dt_max, input multiplier, output multiplier];
//                   tensors [in_proj, conv weight [D, K], conv bias?, A_log, dt_bias, D, norm?,
//                   out_proj, zxbcdt scale?]
//   attention       ints [KV layer, heads, KV heads, q/k norm kind (QkNorm), rope, window,
//                   has output gate]; floats [scale, q/k norm eps, key multiplier, input
//                   multiplier, output multiplier]; tensors [q, k, v, o, q_norm?, k_norm?, g?]
//                   (GQA; rope 0: none, 1: the step's cos/sin [B, rot], 2 + s: set s of the
//                   step's stacked cos/sin [sets, B, rot] (LFM3: one set per attention kind);
//                   window > 0: the last `window` keys; g: LFM3's per-head sigmoid gate
//                   [heads, hidden] on the heads' outputs)
//   gated attention ints [KV layer, heads]; floats [q/k norm eps, scale];
//                   tensors [q with its gate, k, v, q_norm, k_norm, o]   (Qwen3-Next)
//   parallel        Mamba2's, then attention's (Falcon-H1: their outputs summed)
//   KDA             ints [pool layer]; floats [norm eps]; tensors [q, k, v, b, f_a, g_a, f_b,
//                   g_b, conv weight [3 H d, W], A_log, dt_bias [H d], norm, o_proj]
//                   (Kimi Delta Attention: the delta rule with a per-channel forget gate)
//   MLA             ints [KV layer, heads, kv_lora_rank, nope, rope, v head dim, has q LoRA,
//                   has head gate, rope]; floats [scale, q LoRA norm eps, latent norm eps];
//                   tensors [q] or [q_a, q_a norm, q_b], then [kv_a, kv_a norm, kv_b, o, g?]
//                   (absorbed decode over the pool's latent rows [c | k_r]; rope: the step's
//                   cos/sin over the rope dims)
//   short conv      ints [pool layer]; tensors [in_proj [3n, H], conv weight [n, K], out_proj]
//                   (LFM2: B | C | x = in_proj(h), out_proj(C * conv(B * x)), the conv window
//                   the pool's K - 1 columns, no activation)
//   SwiGLU          ints [fused gate|up]; floats [gate multiplier, output multiplier];
//                   tensors [gate, up, down] or [gate_up, down]
//   relu^2 MLP      tensors [up, down]
//   sparse MoE      ints [top_k, norm_topk_prob]; tensors [router, experts' gate_up and down,
//                   shared gate, shared gate, up and down]   (Qwen3-Next: moe_decode)
//   relu^2 MoE      ints [top_k, n_group, topk_group, norm_topk_prob, latent]; floats [routed
//                   scaling]; tensors [router, its correction bias, experts' up [E, I, L] and
//                   down [E, L, I], shared up and down, with latent: fc1 [L, H], fc2 [H, L]]
//                   (NemotronH; L = H without latent)
//   top-k MoE       ints [top_k]; floats [output multiplier]; tensors [router, experts'
//                   gate_up and down, shared gate_up and down]   (Granite-4.0-H: the softmax of
//                   the top-k logits, plus the shared SwiGLU)
//   sigmoid MoE     ints [top_k, has expert bias, norm_topk_prob]; floats [routed scaling];
//                   tensors [router (fp32), expert bias?, experts' gate_up and down]
//                   (LFM2-MoE: sigmoid scores, top-k of scores + bias, no shared expert)
//   grouped MoE     ints [top_k, n_group, topk_group, norm_topk_prob, softmax scores];
//                   floats [routed scaling]; tensors [router, its correction bias, experts'
//                   gate_up and down, shared gate, up and down]   (Kimi-Linear: relu^2 MoE's
//                   router, sigmoid or softmax scores, SwiGLU experts plus the shared SwiGLU)
struct Reader {
  const std::vector<at::Tensor>& tensors;
  const std::vector<int64_t>& ints;
  const std::vector<double>& floats;
  size_t t = 0, i = 0, f = 0;

  at::Tensor tensor() {
    TORCH_CHECK(t < tensors.size(), "BlockStep: too few tensors");
    return tensors[t++];
  }
  std::optional<at::Tensor> maybe(bool present) {
    return present ? std::optional<at::Tensor>(tensor()) : std::nullopt;
  }
  std::vector<at::Tensor> take(int n) {
    std::vector<at::Tensor> out;
    for (int j = 0; j < n; ++j) out.push_back(tensor());
    return out;
  }
  int64_t integer() {
    TORCH_CHECK(i < ints.size(), "BlockStep: too few ints");
    return ints[i++];
  }
  double real() {
    TORCH_CHECK(f < floats.size(), "BlockStep: too few floats");
    return floats[f++];
  }
  void done() const {
    TORCH_CHECK(t == tensors.size() && i == ints.size() && f == floats.size(), "BlockStep: ",
                tensors.size() - t, " tensors, ", ints.size() - i, " ints and ",
                floats.size() - f, " floats left over");
  }
};

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
  double eps;
  std::vector<at::Tensor> w;  // q, k, v, b, f_a, g_a, f_b, g_b, conv, A_log, dt_bias, norm, o
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

Gdn read_gdn(Reader& r) {
  Gdn g;
  g.layer = r.integer();
  g.key_heads = r.integer();
  g.eps = r.real();
  g.beta_scale = r.real();
  g.w = r.take(7);
  return g;
}

Mamba2 read_mamba(Reader& r) {
  Mamba2 m;
  m.layer = r.integer();
  m.groups = r.integer();
  const bool bias = r.integer() != 0, norm = r.integer() != 0, scale = r.integer() != 0;
  m.eps = r.real();
  m.dt_min = r.real();
  m.dt_max = r.real();
  m.in_mult = r.real();
  m.out_mult = r.real();
  m.in_proj = r.tensor();
  m.conv_weight = r.tensor();
  m.conv_bias = r.maybe(bias);
  m.A_log = r.tensor();
  m.dt_bias = r.tensor();
  m.D = r.tensor();
  m.norm = r.maybe(norm);
  m.out_proj = r.tensor();
  m.scale = r.maybe(scale);
  return m;
}

Attention read_attention(Reader& r) {
  Attention a;
  a.layer = r.integer();
  a.heads = r.integer();
  a.kv_heads = r.integer();
  a.qk_norm = r.integer();
  TORCH_CHECK(a.qk_norm >= kNoQkNorm && a.qk_norm <= kPerHeadQkNorm, "BlockStep: q/k norm kind ",
              a.qk_norm);
  a.rope = r.integer();
  a.window = r.integer();
  const bool gate = r.integer() != 0;
  TORCH_CHECK(a.rope >= 0 && a.window >= 0, "BlockStep: rope ", a.rope, ", window ", a.window);
  a.scale = r.real();
  a.qk_eps = r.real();
  a.key_mult = r.real();
  a.in_mult = r.real();
  a.out_mult = r.real();
  a.w = r.take(4);
  if (a.qk_norm != kNoQkNorm) {
    a.q_norm = r.tensor();
    a.k_norm = r.tensor();
  }
  a.gate = r.maybe(gate);
  return a;
}

Kda read_kda(Reader& r) {
  Kda k;
  k.layer = r.integer();
  k.eps = r.real();
  k.w = r.take(13);
  return k;
}

Mla read_mla(Reader& r) {
  Mla a;
  a.layer = r.integer();
  a.heads = r.integer();
  a.rank = r.integer();
  a.nope = r.integer();
  a.rope_dim = r.integer();
  a.v_dim = r.integer();
  const bool q_lora = r.integer() != 0, gate = r.integer() != 0;
  a.rope = r.integer() != 0;
  a.scale = r.real();
  a.q_eps = r.real();
  a.kv_eps = r.real();
  if (q_lora) {
    a.q_a = r.tensor();
    a.q_a_norm = r.tensor();
    a.q_b = r.tensor();
  } else {
    a.q_proj = r.tensor();
  }
  a.kv_a = r.tensor();
  a.kv_a_norm = r.tensor();
  a.kv_b = r.tensor();
  a.o_proj = r.tensor();
  a.g_proj = r.maybe(gate);
  return a;
}

Mlp read_mlp(Reader& r, int64_t kind) {
  Mlp m;
  m.kind = kind;
  if (kind == kSwiglu) {
    m.flag = r.integer() != 0;
    m.gate_mult = r.real();
    m.out_mult = r.real();
    m.w = r.take(m.flag ? 2 : 3);
  } else if (kind == kRelu2) {
    m.w = r.take(2);
  } else if (kind == kSparseMoe) {
    m.top_k = r.integer();
    m.flag = r.integer() != 0;
    m.w = r.take(7);
  } else if (kind == kRelu2Moe) {
    m.top_k = r.integer();
    m.n_group = r.integer();
    m.topk_group = r.integer();
    m.flag = r.integer() != 0;
    const bool latent = r.integer() != 0;
    m.out_mult = r.real();
    m.w = r.take(latent ? 8 : 6);
  } else if (kind == kTopkMoe) {
    m.top_k = r.integer();
    m.out_mult = r.real();
    m.w = r.take(5);
  } else if (kind == kGroupedMoe) {
    m.top_k = r.integer();
    m.n_group = r.integer();
    m.topk_group = r.integer();
    m.flag = r.integer() != 0;
    m.softmax = r.integer() != 0;
    m.out_mult = r.real();
    m.w = r.take(7);
  } else {
    TORCH_CHECK(kind == kSigmoidMoe, "BlockStep: MLP kind ", kind);
    m.top_k = r.integer();
    const bool bias = r.integer() != 0;
    m.flag = r.integer() != 0;
    m.out_mult = r.real();
    m.w = r.take(bias ? 4 : 3);
  }
  return m;
}

// x * multiplier, as the families' `scaled` (no op at 1)
at::Tensor scaled(const at::Tensor& x, double multiplier) {
  return multiplier == 1.0 ? x : x * multiplier;
}

// kernels/rmsnorm.py rms_norm_plain
at::Tensor rms_norm_plain(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(at::IntArrayRef{-1}, /*keepdim=*/true) + eps);
  return (weight.to(at::kFloat) * xf).to(x.scalar_type());
}

// kernels/attn_step.py apply_rope: x [T, heads, D], cos/sin [T, rot]
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rot = cos.size(-1), D = x.size(-1);
  const at::Tensor x_rot = x.narrow(-1, 0, rot), x_pass = x.narrow(-1, rot, D - rot);
  const at::Tensor x1 = x_rot.narrow(-1, 0, rot / 2), x2 = x_rot.narrow(-1, rot / 2, rot - rot / 2);
  const at::Tensor rotated = at::cat({-x2, x1}, -1);
  return at::cat({x_rot * cos.unsqueeze(1) + rotated * sin.unsqueeze(1), x_pass}, -1);
}

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
// back per token. ids, weights [T, k]; gate_up [E, 2I, H], down [E, H, I].
at::Tensor fused_experts(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& weights,
                         const at::Tensor& gate_up, const at::Tensor& down) {
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
                          ys.data_ptr<float>());
  ys = ys * weights.flatten().index({order}).unsqueeze(1);
  return at::zeros_like(h).index_add_(0, token_of, ys);
}

// models/granite_moe_hybrid.py GraniteMoeHybridMoE (the router's top-k logits' softmax over
// fused_experts) plus the shared SwiGLU, times the residual multiplier
at::Tensor topk_moe(const at::Tensor& h, const Mlp& m, bool bf16) {
  const at::Tensor logits = hs::linear(h, m.w[0], bf16);
  const auto [top_logits, top_ids] = logits.topk(m.top_k, -1);
  const at::Tensor moe = fused_experts(h, top_ids, at::softmax(top_logits, -1), m.w[1], m.w[2]);
  Mlp shared;
  shared.flag = true;
  shared.w = {m.w[3], m.w[4]};
  return scaled(moe + swiglu(h, shared, bf16), m.out_mult);
}

// models/lfm2.py Lfm2SparseMoe: the fp32 router's sigmoid scores, the top-k of the scores plus
// the expert bias (of the scores alone without one), the picked scores renormalised
// (norm_topk_prob) and times the routed scaling, over fused_experts
at::Tensor sigmoid_moe(const at::Tensor& h, const Mlp& m) {
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
  return fused_experts(h, ids, weights, m.w[bias ? 2 : 1], m.w[bias ? 3 : 2]);
}

// models/kimi_moe.py KimiMoE: the grouped router (`route`) over fused_experts, plus the shared
// SwiGLU (models/layers.py MLP)
at::Tensor grouped_moe(const at::Tensor& h, const Mlp& m, bool bf16) {
  const auto [weights, ids] = route(h, m);
  const at::Tensor moe = fused_experts(h, ids, weights, m.w[2], m.w[3]);
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
    default: return sigmoid_moe(h, m);
  }
}

// kernels/attention.py decode_attention over seq_lens' keys (the first `L` columns of each
// request's row of req_to_token; with a window > 0, the last `window` of them)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_slots, const at::Tensor& seq_lens, double scale,
                            int64_t L, int64_t window = 0) {
  using at::indexing::None, at::indexing::Slice;
  const int64_t B = q.size(0), nH = q.size(1), D = q.size(2), nKV = k_buffer.size(1);
  const at::Tensor locs = req_to_token.index({req_slots, Slice(None, L)}).to(at::kLong);
  const at::Tensor pos = at::arange(L, seq_lens.options().dtype(at::kLong)).unsqueeze(0);
  at::Tensor valid = pos < seq_lens.unsqueeze(1);
  if (window > 0) valid.bitwise_and_(pos >= seq_lens.unsqueeze(1) - window);
  const at::Tensor k = k_buffer.index({locs}).to(q.scalar_type()).permute({0, 2, 1, 3});
  const at::Tensor v = v_buffer.index({locs}).to(q.scalar_type()).permute({0, 2, 1, 3});
  const at::Tensor qg = q.reshape({B, nKV, nH / nKV, D});
  at::Tensor scores = at::matmul(qg, k.transpose(-1, -2)).to(at::kFloat) * scale;
  scores = scores.masked_fill(valid.index({Slice(), None, None, Slice()}).bitwise_not(),
                              -std::numeric_limits<double>::infinity());
  const at::Tensor probs = scores.softmax(-1).to(q.scalar_type());
  return at::matmul(probs, v).reshape({B, nH, D});
}

// What the mixers read besides their own weights: the batch and the pools.
struct Batch {
  at::Tensor cos, sin, k_all, v_all, conv_state, ssm_state, slots, starts, steps, out_loc,
      req_to_token, req_slots, seq_lens;
  int64_t max_seq_len;  // 0: the largest seq_len
  bool bf16;
};

// models/gqa_attention.py Attention: projections, q/k norms, key multiplier, rope, store_kv at
// out_loc, decode_attention (over the window where the layer has one), o_proj; with the
// families' input and output multipliers, and LFM3's per-head gate before o_proj
// (models/lfm3.py Lfm3Attention.forward)
at::Tensor attention(const at::Tensor& x, const Attention& a, const Batch& b) {
  const at::Tensor h = scaled(x, a.in_mult);
  const int64_t T = h.size(0);
  const std::vector<at::Tensor> qkv = hs::linear_multi(h, {a.w[0], a.w[1], a.w[2]}, b.bf16);
  at::Tensor q = qkv[0], k = qkv[1];
  const int64_t hd = q.size(1) / a.heads;
  if (a.qk_norm == kWholeQkNorm) {
    q = rms_norm_plain(q, a.q_norm, a.qk_eps);
    k = rms_norm_plain(k, a.k_norm, a.qk_eps);
  } else if (a.qk_norm == kPerHeadQkNorm) {  // models/lfm2.py Lfm2Attention.norm_qk
    q = rms_norm_plain(q.view({T, -1, hd}), a.q_norm, a.qk_eps).view({T, -1});
    k = rms_norm_plain(k.view({T, -1, hd}), a.k_norm, a.qk_eps).view({T, -1});
  }
  q = q.view({T, a.heads, hd});
  k = k.view({T, a.kv_heads, hd});
  const at::Tensor v = qkv[2].view({T, a.kv_heads, hd});
  k = scaled(k, a.key_mult);
  if (a.rope > 0) {
    const at::Tensor cos = a.rope == 1 ? b.cos : b.cos.select(0, a.rope - 2);
    const at::Tensor sin = a.rope == 1 ? b.sin : b.sin.select(0, a.rope - 2);
    q = apply_rope(q, cos, sin);
    k = apply_rope(k, cos, sin);
  }
  const at::Tensor k_buf = b.k_all.select(0, a.layer), v_buf = b.v_all.select(0, a.layer);
  const at::Tensor loc = b.out_loc.to(at::kLong);
  k_buf.index_copy_(0, loc, k.to(k_buf.scalar_type()));
  v_buf.index_copy_(0, loc, v.to(v_buf.scalar_type()));
  const int64_t L = b.max_seq_len > 0 ? b.max_seq_len : b.seq_lens.max().item<int64_t>();
  at::Tensor o = decode_attention(q, k_buf, v_buf, b.req_to_token, b.req_slots, b.seq_lens,
                                  a.scale, L, a.window)
                     .reshape({T, -1});
  if (a.gate.has_value()) {
    const at::Tensor gate = at::sigmoid(hs::linear(h, *a.gate, b.bf16)).unsqueeze(-1);
    o = (o.view({T, a.heads, hd}) * gate).view({T, -1});
  }
  return scaled(hs::linear(o, a.w[3], b.bf16), a.out_mult);
}

// models/mamba2_mixer.py Mamba2Mixer's decode: the input multiplier, in_proj, the segments'
// multipliers, mamba2_decode, out_proj; then the family's output multiplier
at::Tensor mamba2(const at::Tensor& x, const Mamba2& m, const Batch& b) {
  at::Tensor zxbcdt = hs::linear(scaled(x, m.in_mult), m.in_proj, b.bf16);
  if (m.scale.has_value()) zxbcdt = zxbcdt * *m.scale;
  const at::Tensor y = hs::mamba2_decode(
      zxbcdt, b.conv_state.select(0, m.layer), m.conv_weight, m.conv_bias,
      b.ssm_state.select(0, m.layer), m.A_log, m.dt_bias, m.D, m.norm, b.slots, m.groups, m.eps,
      m.dt_min, m.dt_max);
  return scaled(hs::linear(y, m.out_proj, b.bf16), m.out_mult);
}

// kernels/gdn_step.py gdn_decode with a beta scale (OLMo-Hybrid): the C++ conv update, the gates
// in ATen, the C++ delta rule and gated norm, as the eager step composes them
at::Tensor gdn_composed(const at::Tensor& qkvz, const at::Tensor& ba, const Gdn& g,
                        const Batch& b) {
  const at::Tensor conv = b.conv_state.select(0, g.layer), ssm = b.ssm_state.select(0, g.layer);
  const int64_t T = qkvz.size(0), HV = ssm.size(1), dk = ssm.size(2), dv = ssm.size(3);
  const int64_t key_dim = g.key_heads * dk, value_dim = HV * dv;
  const std::vector<at::Tensor> qkv_z = qkvz.split({2 * key_dim + value_dim, value_dim}, -1);
  const std::vector<at::Tensor> b_a = ba.split({HV, HV}, -1);
  const at::Tensor slots = b.slots.to(at::kLong).contiguous();
  const at::Tensor mixed = hs::conv1d_update_pool(qkv_z[0].contiguous(), conv,
                                                  g.w[2].contiguous(), std::nullopt, slots, true);
  const std::vector<at::Tensor> qkv = mixed.split({key_dim, key_dim, value_dim}, -1);
  const at::Tensor q = qkv[0].reshape({T, 1, g.key_heads, dk});
  const at::Tensor k = qkv[1].reshape({T, 1, g.key_heads, dk});
  const at::Tensor v = qkv[2].reshape({T, 1, HV, dv});
  at::Tensor beta = b_a[0].sigmoid();
  if (g.beta_scale != 1.0) beta = beta * g.beta_scale;
  const at::Tensor gate =
      -g.w[3].to(at::kFloat).exp() * at::softplus(b_a[1].to(at::kFloat) + g.w[4]);
  const at::Tensor core = hs::gdr_recurrent_pool(
      q.contiguous(), k.contiguous(), v.contiguous(), gate.unsqueeze(1).contiguous(),
      beta.unsqueeze(1).contiguous(), ssm, slots, std::pow(static_cast<double>(dk), -0.5), true);
  const at::Tensor normed = hs::rmsnorm_gated(core.reshape({T * HV, dv}).contiguous(),
                                              qkv_z[1].reshape({T * HV, dv}).contiguous(),
                                              g.w[5], g.eps);
  return normed.reshape({T, value_dim});
}

at::Tensor gdn(const at::Tensor& h, const Gdn& g, const Batch& b) {
  const std::vector<at::Tensor> p = hs::linear_multi(h, {g.w[0], g.w[1]}, b.bf16);
  const at::Tensor conv = b.conv_state.select(0, g.layer), ssm = b.ssm_state.select(0, g.layer);
  at::Tensor y;
  if (b.starts.defined()) {
    TORCH_CHECK(g.beta_scale == 1.0, "BlockStep.verify: a GDN with a beta scale");
    y = hs::gdn_verify(p[0], p[1], conv, g.w[2], ssm, g.w[3], g.w[4], g.w[5], b.slots, b.starts,
                       b.steps, g.key_heads, g.eps);
  } else if (g.beta_scale == 1.0) {
    y = hs::gdn_decode(p[0], p[1], conv, g.w[2], ssm, g.w[3], g.w[4], g.w[5], b.slots,
                       g.key_heads, g.eps);
  } else {
    y = gdn_composed(p[0], p[1], g, b);
  }
  return hs::linear(y, g.w[6], b.bf16);
}

// models/qwen3_next_layers.py GatedAttention's decode (attn_decode)
at::Tensor gated_attention(const at::Tensor& h, const GatedAttention& a, const Batch& b) {
  const std::vector<at::Tensor> p = hs::linear_multi(h, {a.w[0], a.w[1], a.w[2]}, b.bf16);
  const at::Tensor o = hs::attn_decode(
      p[0], p[1], p[2], a.w[3], a.w[4], b.cos, b.sin, b.k_all.select(0, a.layer),
      b.v_all.select(0, a.layer), b.out_loc, b.req_to_token, b.req_slots, b.seq_lens, a.heads,
      a.scale, a.eps);
  return hs::linear(o, a.w[5], b.bf16);
}

// models/lfm2.py Lfm2ShortConv's decode: B | C | x = in_proj(h), the conv update of B * x over
// the pool's window (no bias, no activation: the eager step's causal_conv1d_update), then
// out_proj(C * y)
at::Tensor short_conv(const at::Tensor& h, const ShortConv& s, const Batch& b) {
  const int64_t n = s.conv_weight.size(0);
  const std::vector<at::Tensor> bcx = hs::linear(h, s.in_proj, b.bf16).split(n, -1);
  const at::Tensor bx = (bcx[0] * bcx[2]).contiguous();
  const at::Tensor y = hs::conv1d_update_pool(bx, b.conv_state.select(0, s.layer), s.conv_weight,
                                              std::nullopt, b.slots, /*silu=*/false);
  return hs::linear(bcx[1] * y, s.out_proj, b.bf16);
}

// models/kda_mixer.py KimiDeltaAttention's decode (DeltaRuleMixer._decode over
// kernels/gdn_step.py gdn_decode with the C++ conv update and delta rule and
// kernels/rmsnorm.py rms_norm_gated_sigmoid): the six products of h in one linear_multi, the
// low-rank ups of the forget gate and the output gate, the conv update of [q | k | v], the
// per-channel gate -exp(A_log[h]) softplus(f + dt_bias), the delta rule, the sigmoid-gated norm,
// o_proj
at::Tensor kda(const at::Tensor& h, const Kda& k, const Batch& b) {
  const std::vector<at::Tensor>& w = k.w;
  const std::vector<at::Tensor> p =
      hs::linear_multi(h, {w[0], w[1], w[2], w[3], w[4], w[5]}, b.bf16);
  const at::Tensor f = hs::linear(p[4], w[6], b.bf16), z = hs::linear(p[5], w[7], b.bf16);
  const at::Tensor conv = b.conv_state.select(0, k.layer), ssm = b.ssm_state.select(0, k.layer);
  const int64_t T = h.size(0), H = ssm.size(1), d = ssm.size(2);
  const at::Tensor slots = b.slots.to(at::kLong).contiguous();
  const at::Tensor mixed = hs::conv1d_update_pool(at::cat({p[0], p[1], p[2]}, -1), conv,
                                                  w[8].contiguous(), std::nullopt, slots, true);
  const std::vector<at::Tensor> qkv = mixed.split({H * d, H * d, H * d}, -1);
  // b and a as the eager step's column slices of [b | a]: ATen's elementwise ops may round a
  // strided input otherwise than a contiguous one
  const at::Tensor ba = at::cat({p[3], f}, -1);
  const at::Tensor beta = ba.narrow(-1, 0, H).sigmoid();
  const at::Tensor decay = -w[9].to(at::kFloat).reshape({H}).exp();
  const at::Tensor a = ba.narrow(-1, H, H * d).to(at::kFloat);
  const at::Tensor gate = decay.unsqueeze(-1) * at::softplus(a + w[10]).unflatten(-1, {H, -1});
  const at::Tensor core = hs::gdr_recurrent_pool(
      qkv[0].reshape({T, 1, H, d}).contiguous(), qkv[1].reshape({T, 1, H, d}).contiguous(),
      qkv[2].reshape({T, 1, H, d}).contiguous(), gate.unsqueeze(1).contiguous(),
      beta.unsqueeze(1).contiguous(), ssm, slots, std::pow(static_cast<double>(d), -0.5), true);
  const at::Tensor xf = core.reshape({T * H, d}).to(at::kFloat);
  const at::Tensor normed =
      xf * at::rsqrt(xf.pow(2).mean(at::IntArrayRef{-1}, /*keepdim=*/true) + k.eps);
  const at::Tensor zf = z.reshape({T * H, d}).to(at::kFloat);
  const at::Tensor y = (w[11].to(at::kFloat) * normed * zf.sigmoid()).to(core.scalar_type());
  return hs::linear(y.reshape({T, H * d}), w[12], b.bf16);
}

// models/mla_attention.py rope_interleaved: pairs (2j, 2j+1) de-interleaved, then apply_rope
at::Tensor rope_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  using at::indexing::None, at::indexing::Slice, at::indexing::Ellipsis;
  const at::Tensor evens = x.index({Ellipsis, Slice(0, None, 2)});
  const at::Tensor odds = x.index({Ellipsis, Slice(1, None, 2)});
  return apply_rope(at::cat({evens, odds}, -1), cos, sin);
}

// models/mla_attention.py MLAAttention's decode: write_latent (the queries, the latent row
// [rms(c) | k_r] at out_loc), attend_absorbed (q_n through W_UK, attention over the latent rows
// with K = V = the row, the attended latent through W_UV), project_out (the head gate, o_proj)
at::Tensor mla(const at::Tensor& h, const Mla& a, const Batch& b) {
  const int64_t T = h.size(0), H = a.heads, r = a.rank, nope = a.nope;
  at::Tensor q = a.q_proj.has_value()
                     ? hs::linear(h, *a.q_proj, b.bf16)
                     : hs::linear(rms_norm_plain(hs::linear(h, *a.q_a, b.bf16), *a.q_a_norm,
                                                 a.q_eps),
                                  *a.q_b, b.bf16);
  q = q.view({T, H, nope + a.rope_dim});
  const std::vector<at::Tensor> ck = hs::linear(h, a.kv_a, b.bf16).split({r, a.rope_dim}, -1);
  const at::Tensor c = rms_norm_plain(ck[0], a.kv_a_norm, a.kv_eps);
  at::Tensor k_r = ck[1].unsqueeze(1);
  if (a.rope) {
    const at::Tensor q_r =
        rope_interleaved(q.narrow(-1, nope, a.rope_dim), b.cos, b.sin).to(q.scalar_type());
    q = at::cat({q.narrow(-1, 0, nope), q_r}, -1);
    k_r = rope_interleaved(k_r, b.cos, b.sin).to(c.scalar_type());
  }
  const at::Tensor latent = b.k_all.select(0, a.layer);  // [locs, 1, r + rope]
  const at::Tensor row = at::cat({c.unsqueeze(1), k_r}, -1);
  latent.index_copy_(0, b.out_loc.to(at::kLong), row.to(latent.scalar_type()));
  const at::Tensor w = a.kv_b.view({H, nope + a.v_dim, r});
  const at::Tensor w_uk = w.narrow(1, 0, nope), w_uv = w.narrow(1, nope, a.v_dim);
  const at::Tensor q_lat =
      at::bmm(q.narrow(-1, 0, nope).transpose(0, 1), w_uk.to(q.scalar_type()));  // [H, T, r]
  const at::Tensor q_abs = at::cat({q_lat.transpose(0, 1), q.narrow(-1, nope, a.rope_dim)}, -1);
  const int64_t L = b.max_seq_len > 0 ? b.max_seq_len : b.seq_lens.max().item<int64_t>();
  const at::Tensor o =
      decode_attention(q_abs, latent, latent, b.req_to_token, b.req_slots, b.seq_lens, a.scale, L);
  const at::Tensor o_lat = o.narrow(-1, 0, r).transpose(0, 1);  // [H, T, r]
  at::Tensor y = at::bmm(o_lat, w_uv.to(o.scalar_type()).transpose(1, 2)).transpose(0, 1);
  if (a.g_proj.has_value()) {
    const at::Tensor g = hs::linear(h, *a.g_proj, b.bf16).to(at::kFloat).sigmoid();
    y = y * g.to(y.scalar_type()).unsqueeze(-1);
  }
  return hs::linear(y.reshape({T, -1}), a.o_proj, b.bf16);
}

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
    Reader r{tensors, ints, floats};
    while (r.i < ints.size()) {
      Block l;
      l.norm_kind = r.integer();
      l.mixer_kind = r.integer();
      const int64_t mlp_kind = r.integer();
      TORCH_CHECK(l.norm_kind >= kDeferred && l.norm_kind <= kSandwich, "BlockStep: norm kind ",
                  l.norm_kind);
      TORCH_CHECK(l.mixer_kind >= kNoMixer && l.mixer_kind <= kMla, "BlockStep: mixer kind ",
                  l.mixer_kind);
      TORCH_CHECK(mlp_kind >= kNoMlp && mlp_kind <= kGroupedMoe, "BlockStep: MLP kind ",
                  mlp_kind);
      TORCH_CHECK(l.mixer_kind != kNoMixer || mlp_kind != kNoMlp, "BlockStep: an empty block");
      TORCH_CHECK(blocks.empty() || deferred == (l.norm_kind == kDeferred),
                  "BlockStep: deferred-residual blocks mixed with others");
      deferred = l.norm_kind == kDeferred;
      if (l.mixer_kind != kNoMixer) {
        l.mixer_norm = r.tensor();
        l.mixer_eps = r.real();
        if (l.norm_kind == kSandwich) {
          l.mixer_out_norm = r.tensor();
          l.mixer_out_eps = r.real();
        }
        if (l.mixer_kind == kGdn) l.gdn = read_gdn(r);
        if (l.mixer_kind == kMamba2 || l.mixer_kind == kParallel) l.mamba = read_mamba(r);
        if (l.mixer_kind == kAttention || l.mixer_kind == kParallel) l.attn = read_attention(r);
        if (l.mixer_kind == kGatedAttention) {
          GatedAttention a;
          a.layer = r.integer();
          a.heads = r.integer();
          a.eps = r.real();
          a.scale = r.real();
          a.w = r.take(6);
          l.gated = std::move(a);
        }
        if (l.mixer_kind == kKda) l.kda = read_kda(r);
        if (l.mixer_kind == kMla) l.mla = read_mla(r);
        if (l.mixer_kind == kShortConv) {
          ShortConv s;
          s.layer = r.integer();
          s.in_proj = r.tensor();
          s.conv_weight = r.tensor();
          s.out_proj = r.tensor();
          l.conv = std::move(s);
        }
      }
      if (mlp_kind != kNoMlp) {
        l.mlp_norm = r.tensor();
        l.mlp_eps = r.real();
        if (l.norm_kind == kSandwich) {
          l.mlp_out_norm = r.tensor();
          l.mlp_out_eps = r.real();
        }
        l.mlp = read_mlp(r, mlp_kind);
      }
      blocks.push_back(std::move(l));
    }
    r.done();
  }

  // x [B, hidden] the embedded tokens; cos, sin [B, rot] or [sets, B, rot] (empty without
  // positions); the pools as the model's (k_all, v_all [attention layers, locs, kv heads, head dim]; conv_state,
  // ssm_state [recurrent layers, slots, ...]), updated in place; slots, out_loc, req_slots,
  // seq_lens [B] int64; req_to_token [rows, context]; max_seq_len the batch's (0: the largest
  // seq_len). Returns the logits [B, vocab].
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_all,
                     at::Tensor v_all, at::Tensor conv_state, at::Tensor ssm_state,
                     at::Tensor slots, at::Tensor out_loc, at::Tensor req_to_token,
                     at::Tensor req_slots, at::Tensor seq_lens, int64_t max_seq_len) {
    const Batch b{cos, sin, k_all, v_all, conv_state, ssm_state, slots, {}, {}, out_loc,
                  req_to_token, req_slots, seq_lens, max_seq_len, bf16_products};
    return hs::linear(run(x, b), lm_head, bf16_products);
  }

  // Speculative verify (blocks of GDN without a beta scale and gated attention only): the B
  // rows are N requests' few tokens each, request n's rows [starts[n], starts[n+1]) at
  // consecutive positions (their seq_lens), its state in slots[n] [N] stepped through them in
  // order, the state after each row but its last kept in steps[n] (gdn_verify); attention sees
  // each row's earlier rows (attn_decode writes every row's K/V first). Returns (logits
  // [B, vocab], final normed hidden [B, hidden]).
  std::tuple<at::Tensor, at::Tensor> verify(
      at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_all, at::Tensor v_all,
      at::Tensor conv_state, at::Tensor ssm_state, at::Tensor slots, at::Tensor starts,
      at::Tensor steps, at::Tensor out_loc, at::Tensor req_to_token, at::Tensor req_slots,
      at::Tensor seq_lens) {
    TORCH_CHECK(starts.defined() && steps.defined(), "BlockStep.verify: starts and steps");
    for (const Block& l : blocks) {
      TORCH_CHECK(l.mixer_kind == kGdn || l.mixer_kind == kGatedAttention,
                  "BlockStep.verify: GDN and gated attention blocks only");
    }
    const Batch b{cos, sin, k_all, v_all, conv_state, ssm_state, slots, starts, steps, out_loc,
                  req_to_token, req_slots, seq_lens, 0, bf16_products};
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
