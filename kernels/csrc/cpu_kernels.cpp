// CPU kernels for the decode step, registered as torch ops `hybrid_serve::*`.
//
// Built at first use by kernels/cpp_build.py (torch.utils.cpp_extension.load, -O3 -march=native).
// Each op has a pure-torch reference in kernels/*.py with the same meaning; see the Python
// wrappers (kernels/*_cpp.py) for the contracts. Every op takes contiguous tensors; the
// wrappers make them so.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "delta_rule.h"
#include "decode_ops.h"
#include "gemv.h"
#include "pool_slots.h"

namespace {

// ---- gated delta rule, recurrent form on the state pool, in place -----------------------------

// Normalised (optionally) and scaled copy of one K-vector.
inline void load_qk(const float* src, float* dst, int64_t K, bool l2norm, float scale) {
  float mult = scale;
  if (l2norm) {
    float ss = 0.f;
    for (int64_t i = 0; i < K; ++i) ss += src[i] * src[i];
    mult *= 1.f / std::sqrt(ss + 1e-6f);
  }
  for (int64_t i = 0; i < K; ++i) dst[i] = src[i] * mult;
}

// q, k [B,T,H,K]; v [B,T,HV,V]; g, beta [B,T,HV] (all fp32); pool [S,HV,K,V] fp32 (in place);
// indices [B] int64. Returns o [B,T,HV,V] fp32. Per (row, value head), token by token:
//   S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q
at::Tensor gdr_recurrent_pool(const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta, at::Tensor pool,
                                 const at::Tensor& indices, double scale, bool l2norm) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && g.is_contiguous() &&
                  beta.is_contiguous() && pool.is_contiguous() && indices.is_contiguous(),
              "gdr_recurrent_pool: contiguous inputs expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && pool.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat &&
                  beta.scalar_type() == at::kFloat && indices.scalar_type() == at::kLong,
              "gdr_recurrent_pool: fp32 tensors and int64 indices expected");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3), S = pool.size(0);
  TORCH_CHECK(pool.size(1) == HV && pool.size(2) == K && pool.size(3) == V, "pool shape");
  TORCH_CHECK(HV % H == 0 && indices.size(0) == B, "head ratio / indices");
  const int64_t ratio = HV / H;
  auto out = at::zeros({B, T, HV, V}, q.options());
  const std::vector<int64_t> slots = hs::live_slots(indices, S);

  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *pp = pool.data_ptr<float>(), *op = out.data_ptr<float>();

  at::parallel_for(0, B * HV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(K), ks(K), delta(V), acc(V);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / HV, hv = job % HV, hk = hv / ratio;
      if (slots[b] < 0) continue;
      float* state = pp + (slots[b] * HV + hv) * K * V;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t qk_off = ((b * T + t) * H + hk) * K;
        const int64_t vh = (b * T + t) * HV + hv;
        load_qk(qp + qk_off, qs.data(), K, l2norm, static_cast<float>(scale));
        load_qk(kp + qk_off, ks.data(), K, l2norm, 1.f);
        const float decay = std::exp(gp[vh]), bt = bp[vh];
        const float* vt = vp + vh * V;
        hs::delta_rule_token(state, ks.data(), qs.data(), vt, decay, bt, K, V, acc.data(),
                             delta.data(), op + vh * V);
      }
    }
  });
  return out;
}

// ---- causal conv1d, one decode step on the state pool, in place ---------------------------

// x [B,D] fp32; conv_state [S,D,W-1] fp32 (in place); weight [D,W] fp32; indices [B] int64.
// Returns silu(conv) [B,D] (or the plain conv when silu is false). Padding rows as above.
at::Tensor conv1d_update_pool(const at::Tensor& x, at::Tensor conv_state,
                                 const at::Tensor& weight, const at::Tensor& indices,
                                 bool silu) {
  TORCH_CHECK(x.is_contiguous() && conv_state.is_contiguous() && weight.is_contiguous() &&
                  indices.is_contiguous(),
              "conv1d_update_pool: contiguous inputs expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && conv_state.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && indices.scalar_type() == at::kLong,
              "conv1d_update_pool: fp32 tensors and int64 indices expected");
  const int64_t B = x.size(0), D = x.size(1), W = weight.size(1), S = conv_state.size(0);
  TORCH_CHECK(conv_state.size(1) == D && conv_state.size(2) == W - 1 && weight.size(0) == D,
              "conv1d_update_pool: shapes");
  auto out = at::zeros({B, D}, x.options());
  const std::vector<int64_t> slots = hs::live_slots(indices, S);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = conv_state.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (slots[b] < 0) continue;
      float* st = sp + slots[b] * D * (W - 1);
      for (int64_t c = 0; c < D; ++c) {
        float* h = st + c * (W - 1);
        const float* w = wp + c * W;
        const float xc = xp[b * D + c];
        float y = w[W - 1] * xc;
        for (int64_t j = 0; j < W - 1; ++j) y += w[j] * h[j];
        for (int64_t j = 0; j + 1 < W - 1; ++j) h[j] = h[j + 1];
        h[W - 2] = xc;
        op[b * D + c] = silu ? y / (1.f + std::exp(-y)) : y;
      }
    }
  });
  return out;
}

}  // namespace

namespace hs {

// x [M,K] fp32, w [N,K] fp32 or bf16 -> y [M,N] fp32, accumulated in fp32.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w) {
  return hs::linear_op("skinny_linear", x, w,
                       [](const float* xp, auto* wp, float* yp, int64_t M, int64_t N, int64_t K) {
                         hs::skinny_linear_into(xp, wp, yp, M, N, K);
                       });
}

}  // namespace hs

TORCH_LIBRARY(hybrid_serve, m) {
  m.def("gdr_recurrent_pool(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, "
        "Tensor indices, float scale, bool l2norm) -> Tensor");
  m.def("conv1d_update_pool(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor indices, "
        "bool silu) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("gdr_recurrent_pool", &gdr_recurrent_pool);
  m.impl("conv1d_update_pool", &conv1d_update_pool);
  m.impl("skinny_linear", &hs::skinny_linear);
}
