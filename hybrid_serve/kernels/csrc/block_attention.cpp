// The block step's attention kinds: GQA (RoPE or none, q/k norms, sliding window, LFM3's
// output gate, the families' multipliers), Qwen3-Next's gated attention (attn_decode) and MLA's
// absorbed decode over the latent rows, each the eager step's ops in its order.

#include <ATen/ATen.h>
#include <ATen/TensorIndexing.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "block_step.h"
#include "decode_ops.h"

namespace hs::blocks {

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

// models/qwen3_next_layers.py GatedAttention's decode (attn_decode)
at::Tensor gated_attention(const at::Tensor& h, const GatedAttention& a, const Batch& b) {
  const std::vector<at::Tensor> p = hs::linear_multi(h, {a.w[0], a.w[1], a.w[2]}, b.bf16);
  const at::Tensor o = hs::attn_decode(
      p[0], p[1], p[2], a.w[3], a.w[4], b.cos, b.sin, b.k_all.select(0, a.layer),
      b.v_all.select(0, a.layer), b.out_loc, b.req_to_token, b.req_slots, b.seq_lens, a.heads,
      a.scale, a.eps);
  return hs::linear(o, a.w[5], b.bf16);
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

}  // namespace hs::blocks
