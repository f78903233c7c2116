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

// The job of `w` (a contiguous fp32, bf16, int8 or int4-format matrix, or `rows` rows of it from
// `row0`; a stack [E, N, K] is rows of one matrix, except int8 and int4, whose experts are tiled
// each on its own: one expert's rows, row0 = e N).
inline GemvJob job_of(const float* x, const at::Tensor& w, float* y, int64_t M, int64_t row0 = 0,
                      int64_t rows = -1) {
  TORCH_CHECK(weight_dtype(w.scalar_type()), "GEMV weights: fp32, bf16, int8 or int4");
  const int64_t K = in_features(w), stride = w.size(-1);
  const char* base = static_cast<const char*>(w.data_ptr()) + row0 * stride * w.element_size();
  return {x, base, w.scalar_type(), y, M, rows < 0 ? w.numel() / stride - row0 : rows, K};
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
