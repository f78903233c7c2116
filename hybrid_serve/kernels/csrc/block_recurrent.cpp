// The block step's recurrent mixer kinds: GDN (the fused gdn_decode, its verify, or with a beta
// scale the eager step's composition), Mamba2 (mamba2_decode), LFM2's gated short conv and
// KDA (kda_decode: Kimi's gates or Ling-3's), each the eager step's ops in its order, the states
// updated in the pools' slots.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "block_step.h"
#include "decode_ops.h"

namespace hs::blocks {

// models/mamba2_mixer.py Mamba2Mixer's decode: the input multiplier, in_proj, the segments'
// multipliers, mamba2_decode (a verify batch: mamba2_verify, as the mixer's _verify), out_proj;
// then the family's output multiplier
at::Tensor mamba2(const at::Tensor& x, const Mamba2& m, const Batch& b) {
  at::Tensor zxbcdt = hs::linear(scaled(x, m.in_mult), m.in_proj, b.bf16);
  if (m.scale.has_value()) zxbcdt = zxbcdt * *m.scale;
  const at::Tensor conv = b.conv_state.select(0, m.layer), ssm = b.ssm_state.select(0, m.layer);
  const at::Tensor y =
      b.starts.defined()
          ? hs::mamba2_verify(zxbcdt.contiguous(), conv, m.conv_weight.contiguous(), m.conv_bias,
                              ssm, m.A_log, m.dt_bias, m.D, m.norm, b.slots, b.starts, b.steps,
                              m.groups, m.eps, m.dt_min, m.dt_max)
          : hs::mamba2_decode(zxbcdt, conv, m.conv_weight, m.conv_bias, ssm, m.A_log, m.dt_bias,
                              m.D, m.norm, b.slots, m.groups, m.eps, m.dt_min, m.dt_max);
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

// models/kda_mixer.py KimiDeltaAttention's decode (DeltaRuleMixer._decode over the fused
// kda_decode, kda_decode.cpp): the six products of h in one linear_multi, Kimi's low-rank ups of
// the forget gate and the output gate (Ling-3's full-rank gates have none), [q | k | v | z] and
// [b | f] joined as `in_projections` joins them, the fused op with the layer's gate bound,
// o_proj
at::Tensor kda(const at::Tensor& h, const Kda& k, const Batch& b) {
  const std::vector<at::Tensor>& w = k.w;
  const std::vector<at::Tensor> p =
      hs::linear_multi(h, {w[0], w[1], w[2], w[3], w[4], w[5]}, b.bf16);
  at::Tensor f = p[4], z = p[5];
  size_t i = 6;  // the conv weight's index
  if (!k.full_rank) {
    f = hs::linear(p[4], w[6], b.bf16);
    z = hs::linear(p[5], w[7], b.bf16);
    i = 8;
  }
  const at::Tensor y = hs::kda_decode(
      at::cat({p[0], p[1], p[2], z}, -1), at::cat({p[3], f}, -1),
      b.conv_state.select(0, k.layer), w[i], b.ssm_state.select(0, k.layer), w[i + 1],
      w[i + 2], w[i + 3], b.slots.to(at::kLong).contiguous(), k.eps, k.lower_bound);
  return hs::linear(y, w[i + 4], b.bf16);
}

}  // namespace hs::blocks
