// The CPU linear ops: `skinny_linear` (the weight-streaming GEMV, gemv.h, and the integer GEMV,
// qgemv.h), `tiled_linear` (the tiled GEMM, gemm.h) and `linear`, the product by row count
// (decode_ops.h). x [M, K] fp32, w [N, K] fp32, bf16, int8 or int4 (weights.h's formats), both
// contiguous -> y [M, N] fp32, accumulated in fp32.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "decode_ops.h"
#include "gemm.h"
#include "gemv.h"
#include "tensor_args.h"

namespace hs {

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w) {
  return linear_op("skinny_linear", x, w,
                   [](const float* xp, auto* wp, float* yp, int64_t M, int64_t N, int64_t K) {
                     skinny_linear_into(xp, wp, yp, M, N, K);
                   });
}

at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& w) {
  return linear_op("tiled_linear", x, w,
                   [](const float* xp, auto* wp, float* yp, int64_t M, int64_t N, int64_t K) {
                     tiled::gemm_into(xp, wp, yp, M, N, K);
                   });
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
  m.def("tiled_linear(Tensor x, Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("skinny_linear", &hs::skinny_linear);
  m.impl("tiled_linear", &hs::tiled_linear);
  m.impl("linear", [](const at::Tensor& x, const at::Tensor& w) { return hs::linear(x, w); });
}
