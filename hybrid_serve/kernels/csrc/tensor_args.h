// The tensor side of the CPU products: a weight tensor's K, the GEMV job of a weight tensor, and
// the checks and dtype dispatch the linear ops share (gemv.h and gemm.h hold the products).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "gemv.h"
#include "weights.h"

namespace hs {

// The K of a weight [..., N, K] as stored (fp32, bf16 or a format of weights.h).
inline int64_t in_features(const at::Tensor& w) {
  if (w.scalar_type() == at::kChar) return w.size(-1) - kScaleBytes;
  if (w.scalar_type() == at::kByte) return w.size(-1) * kQ4Group / (kQ4Group / 2 + 2);
  return w.size(-1);
}

// The job of the whole of `w` (a contiguous fp32, bf16, int8 or int4-format matrix); `panels`:
// the bf16 route (a bf16 `w` is K-pair panels, gemv.h's `GemvJob::panels`; other formats ignore
// it). Experts' slices of a stack are routed_experts.h's `expert_jobs`.
inline GemvJob job_of(const float* x, const at::Tensor& w, float* y, int64_t M,
                      bool panels = false) {
  TORCH_CHECK(weight_dtype(w.scalar_type()), "GEMV weights: fp32, bf16, int8 or int4");
  const int64_t stride = w.size(-1);
  return {x, w.data_ptr(), w.scalar_type(), y, M, w.numel() / stride, in_features(w), panels};
}

// The torch op y [M, N] = x [M, K] w [N, K]^T (x fp32, w fp32, bf16, int8 or int4-format, both 2-D
// contiguous) run by `into(x, w, y, M, N, K)`, a generic callable given w's typed pointer: the
// checks and the dtype dispatch that `skinny_linear` and `tiled_linear` share.
template <typename Into>
at::Tensor linear_op(const char* op, const at::Tensor& x, const at::Tensor& w, const Into& into) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), op, ": contiguous inputs");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": fp32 activations expected");
  TORCH_CHECK(weight_dtype(w.scalar_type()), op, ": fp32, bf16, int8 or int4 weights");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == in_features(w), op, ": shapes");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  with_weight(w.scalar_type(), w.data_ptr(),
              [&](auto* wp) { into(x.data_ptr<float>(), wp, y.data_ptr<float>(), M, N, K); });
  return y;
}

}  // namespace hs
