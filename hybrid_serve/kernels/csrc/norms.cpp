// Residual add + zero-centred RMSNorm for the decoder layers (SGLang's fused_add_rmsnorm
// contract), and the GDN output's gated RMSNorm, fp32. Reference and contracts:
// kernels/rmsnorm.py `fused_add_rmsnorm`, `rms_norm`, `rms_norm_gated`.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "lanes.h"
#include "decode_ops.h"
#include "gated_norm.h"

namespace {

// One row: r = x + res (r, res null: r is x); y = r / rms(r) * (1 + w). Squares summed in 8
// lanes (`hs::dot8`).
inline void add_rmsnorm_row(const float* x, const float* res, const float* w, float* y,
                            float* r, int64_t D, float eps) {
  const float* src = x;
  if (res != nullptr) {
    for (int64_t i = 0; i < D; ++i) r[i] = x[i] + res[i];
    src = r;
  }
  const float ss = hs::dot8(src, src, D);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) y[i] = (src[i] * inv) * (1.f + w[i]);
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rmsnorm: contiguous inputs");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rmsnorm: fp32 tensors expected");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rmsnorm: x [M, D] and weight [D] expected");
}

void run_rows(const float* x, const float* res, const float* w, float* y, float* r, int64_t M,
              int64_t D, double eps) {
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, D));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      add_rmsnorm_row(x + m * D, res ? res + m * D : nullptr, w, y + m * D,
                      r ? r + m * D : nullptr, D, static_cast<float>(eps));
    }
  });
}

}  // namespace

namespace hs {

// x, z [M, D]; weight [D] -> weight * (x / rms(x)) * silu(z) (RMSNormGated: one pass per row
// instead of the reference's ~8 torch ops).
at::Tensor rmsnorm_gated(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight,
                         double eps) {
  check(x, weight);
  TORCH_CHECK(z.is_contiguous() && z.scalar_type() == at::kFloat && z.sizes() == x.sizes(),
              "rmsnorm_gated: z must match x");
  auto y = at::empty_like(x);
  const int64_t M = x.size(0), D = x.size(1);
  const float *xp = x.data_ptr<float>(), *zp = z.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, D));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      gated_rmsnorm_row(xp + m * D, zp + m * D, wp, yp + m * D, D, static_cast<float>(eps));
  });
  return y;
}

// x [M, D], weight [D] -> x / rms(x) * (1 + weight).
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  auto y = at::empty_like(x);
  run_rows(x.data_ptr<float>(), nullptr, weight.data_ptr<float>(), y.data_ptr<float>(), nullptr,
           x.size(0), x.size(1), eps);
  return y;
}

// x, residual [M, D]; weight [D] -> (y, r): r = x + residual, y = r / rms(r) * (1 + weight).
std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.scalar_type() == at::kFloat &&
                  residual.sizes() == x.sizes(),
              "add_rmsnorm: residual must match x");
  auto y = at::empty_like(x);
  auto r = at::empty_like(x);
  run_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
           y.data_ptr<float>(), r.data_ptr<float>(), x.size(0), x.size(1), eps);
  return {y, r};
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rmsnorm_gated(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("rmsnorm", &hs::rmsnorm);
  m.impl("add_rmsnorm", &hs::add_rmsnorm);
  m.impl("rmsnorm_gated", &hs::rmsnorm_gated);
}
