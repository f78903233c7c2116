// Gated full attention of one decode step after its projections, one op per layer: q/k
// RMSNorm, partial NeoX RoPE, the KV-pool write, attention over each request's cached keys and
// the sigmoid output gate. Reference and contract: kernels/attn_step.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "lanes.h"
#include "decode_ops.h"
#include "simd.h"

namespace {

// dst = rope(x / rms(x) * (1 + w)) for one head of D channels; the first `rot` rotate in
// pairs (j, j + rot/2) by cos/sin [rot].
inline void norm_rope(const float* x, const float* w, const float* cos, const float* sin,
                      float* dst, int64_t D, int64_t rot, float eps) {
  const float ss = hs::dot8(x, x, D);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) dst[i] = (x[i] * inv) * (1.f + w[i]);
  const int64_t half = rot / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = dst[j], x2 = dst[j + half];
    dst[j] = x1 * cos[j] + (-x2) * sin[j];
    dst[j + half] = x2 * cos[j + half] + x1 * sin[j + half];
  }
}

// Cached rows are read in token order but sit wherever the pool put them: fetch the row
// kAhead tokens on while this one is used.
constexpr int64_t kAhead = 6;
inline void prefetch_row(const float* row, int64_t D) {
  for (int64_t i = 0; i < D; i += 16) hs::simd::prefetch(row + i);
}

}  // namespace

namespace hs {

// qg [T, nH * 2D] (per head: D query channels, then D gate channels); k, v [T, nKV * D];
// q_norm_w, k_norm_w [D]; cos, sin [T, rot]; k_buffer, v_buffer [locs, nKV, D] (written at
// out_loc); out_loc, req_slots, seq_lens [T] int64; req_to_token [rows, max_context] int32 or
// int64. Returns softmax(q k^T * scale) v * sigmoid(gate), [T, nH * D]. fp32 throughout.
at::Tensor attn_decode(const at::Tensor& qg, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& q_norm_w, const at::Tensor& k_norm_w,
                       const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_buffer,
                       at::Tensor v_buffer, const at::Tensor& out_loc,
                       const at::Tensor& req_to_token, const at::Tensor& req_slots,
                       const at::Tensor& seq_lens, int64_t num_heads, double scale,
                       double eps) {
  for (const at::Tensor* t : {&qg, &k, &v, &q_norm_w, &k_norm_w, &cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat,
                "attn_decode: contiguous fp32 activations and weights expected");
  }
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous() &&
                  k_buffer.scalar_type() == at::kFloat && v_buffer.scalar_type() == at::kFloat,
              "attn_decode: contiguous fp32 KV buffers expected");
  for (const at::Tensor* t : {&out_loc, &req_slots, &seq_lens}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong,
                "attn_decode: int64 out_loc, req_slots, seq_lens expected");
  }
  TORCH_CHECK(req_to_token.is_contiguous() && (req_to_token.scalar_type() == at::kInt ||
                                               req_to_token.scalar_type() == at::kLong),
              "attn_decode: int32 or int64 req_to_token expected");
  const int64_t T = qg.size(0), nKV = k_buffer.size(1), D = k_buffer.size(2);
  const int64_t nH = num_heads, group = nH / nKV, rot = cos.size(1);
  const int64_t locs = k_buffer.size(0), ctx = req_to_token.size(1);
  TORCH_CHECK(nH % nKV == 0 && qg.size(1) == nH * 2 * D && k.size(1) == nKV * D &&
                  v.size(1) == nKV * D && k.size(0) == T && v.size(0) == T &&
                  cos.size(0) == T && sin.sizes() == cos.sizes() && rot <= D && rot % 2 == 0,
              "attn_decode: shapes");
  TORCH_CHECK(out_loc.numel() == T && req_slots.numel() == T && seq_lens.numel() == T,
              "attn_decode: one out_loc, req_slot and seq_len per row");
  const int64_t *olp = out_loc.data_ptr<int64_t>(), *rsp = req_slots.data_ptr<int64_t>();
  const int64_t* slp = seq_lens.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(olp[t] >= 0 && olp[t] < locs, "attn_decode: out_loc out of range");
    TORCH_CHECK(rsp[t] >= 0 && rsp[t] < req_to_token.size(0) && slp[t] >= 1 && slp[t] <= ctx,
                "attn_decode: req_slot or seq_len out of range");
  }
  const bool idx32 = req_to_token.scalar_type() == at::kInt;
  const int32_t* r32 = idx32 ? req_to_token.data_ptr<int32_t>() : nullptr;
  const int64_t* r64 = idx32 ? nullptr : req_to_token.data_ptr<int64_t>();
  auto loc_of = [&](int64_t t, int64_t l) -> int64_t {
    const int64_t i = rsp[t] * ctx + l;
    return idx32 ? static_cast<int64_t>(r32[i]) : r64[i];
  };

  const float *qp = qg.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *qw = q_norm_w.data_ptr<float>(), *kw = k_norm_w.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kb = k_buffer.data_ptr<float>(), *vb = v_buffer.data_ptr<float>();
  const float e = static_cast<float>(eps), sc = static_cast<float>(scale);

  // the new tokens' K/V first: each request attends to its own new token too
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < nKV; ++j) {
      float* kd = kb + (olp[t] * nKV + j) * D;
      norm_rope(kp + (t * nKV + j) * D, kw, cp + t * rot, sp + t * rot, kd, D, rot, e);
      std::copy_n(vp + (t * nKV + j) * D, D, vb + (olp[t] * nKV + j) * D);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t l = 0; l < slp[t]; ++l) {
      const int64_t loc = loc_of(t, l);
      TORCH_CHECK(loc >= 0 && loc < locs, "attn_decode: req_to_token location out of range");
    }
  }

  // one job per (row, KV head): the group of query heads that share the KV head reads each
  // cached key and value row once; each head's sums run in the same order as alone
  auto out = at::empty({T, nH * D}, qg.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * nKV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * D), scores, acc(group * D), mx(group), sum(group);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t t = job / nKV, j = job % nKV, L = slp[t], h0 = j * group;
      for (int64_t g = 0; g < group; ++g) {
        norm_rope(qp + (t * nH + h0 + g) * 2 * D, qw, cp + t * rot, sp + t * rot,
                  q.data() + g * D, D, rot, e);
      }
      scores.resize(group * L);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      for (int64_t l = 0; l < L; ++l) {
        if (l + kAhead < L) prefetch_row(kb + (loc_of(t, l + kAhead) * nKV + j) * D, D);
        const float* kr = kb + (loc_of(t, l) * nKV + j) * D;
        for (int64_t g = 0; g < group; ++g) {
          const float s = hs::dot8(q.data() + g * D, kr, D) * sc;
          scores[g * L + l] = s;
          mx[g] = std::max(mx[g], s);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * L;
        float total = 0.f;
        for (int64_t l = 0; l < L; ++l) {
          sg[l] = std::exp(sg[l] - mx[g]);
          total += sg[l];
        }
        sum[g] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        if (l + kAhead < L) prefetch_row(vb + (loc_of(t, l + kAhead) * nKV + j) * D, D);
        const float* vr = vb + (loc_of(t, l) * nKV + j) * D;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * L + l] / sum[g];
          float* ag = acc.data() + g * D;
          for (int64_t i = 0; i < D; ++i) ag[i] += p * vr[i];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* gate = qp + (t * nH + h0 + g) * 2 * D + D;
        const float* ag = acc.data() + g * D;
        float* o = op + (t * nH + h0 + g) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = ag[i] * (1.f / (1.f + std::exp(-gate[i])));
      }
    }
  });
  return out;
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("attn_decode(Tensor qg, Tensor k, Tensor v, Tensor q_norm_w, Tensor k_norm_w, "
        "Tensor cos, Tensor sin, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor out_loc, "
        "Tensor req_to_token, Tensor req_slots, Tensor seq_lens, int num_heads, float scale, "
        "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) { m.impl("attn_decode", &hs::attn_decode); }
