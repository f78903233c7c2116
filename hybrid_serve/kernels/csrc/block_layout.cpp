// The block step's layout: how `BlockStep`'s constructor reads the flat lists that
// models/plan_blocks.py `Blocks` writes, block by block, into block_step.h's types.
//
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
//   KDA             ints [pool layer, full-rank gates, bounded gate]; floats [norm eps, lower
//                   bound (read, unused without the bound)]; tensors [q, k, v, b, f_a, g_a, f_b,
//                   g_b] (Kimi's low-rank gates) or [q, k, v, b, f, g] (Ling-3's full-rank
//                   ones), then [conv weight [3 H d, W], A_log, dt_bias [H d], norm, o_proj]
//                   (Kimi Delta Attention: the delta rule with a per-channel forget gate, the
//                   fused kda_decode)
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
//                   floats [routed scaling, routed SwiGLU limit, shared SwiGLU limit (0: none)];
//                   tensors [router, its correction bias, experts' gate_up and down, shared
//                   gate, up and down]   (Kimi-Linear and Ling-3: relu^2 MoE's router, sigmoid
//                   or softmax scores, SwiGLU experts plus the shared SwiGLU, Ling-3's clamped)

#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "block_step.h"

namespace hs::blocks {

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
  k.full_rank = r.integer() != 0;
  const bool bounded = r.integer() != 0;
  k.eps = r.real();
  const double bound = r.real();
  if (bounded) k.lower_bound = bound;
  k.w = r.take(k.full_rank ? 11 : 13);
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
    m.limit = r.real();
    m.shared_limit = r.real();
    TORCH_CHECK(m.limit >= 0.0 && m.shared_limit >= 0.0, "BlockStep: SwiGLU limits ", m.limit,
                ", ", m.shared_limit);
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

std::vector<Block> read_blocks(const std::vector<at::Tensor>& tensors,
                               const std::vector<int64_t>& ints,
                               const std::vector<double>& floats) {
  std::vector<Block> blocks;
  bool deferred = false;
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
  return blocks;
}

}  // namespace hs::blocks
