// The tiled GEMM's torch op, `hybrid_serve::tiled_linear` (the GEMM itself: gemm.h), and
// `hybrid_serve::linear`, the CPU linear layer's product by row count (decode_ops.h).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "decode_ops.h"
#include "gemm.h"
#include "tensor_args.h"

namespace hs {

// x [M, K] fp32, w [N, K] fp32, bf16, int8 or int4-format -> y [M, N] fp32.
at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& w) {
  return linear_op("tiled_linear", x, w,
                   [](const float* xp, auto* wp, float* yp, int64_t M, int64_t N, int64_t K) {
                     tiled::gemm_into(xp, wp, yp, M, N, K);
                   });
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("tiled_linear(Tensor x, Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("tiled_linear", &hs::tiled_linear);
  m.impl("linear", [](const at::Tensor& x, const at::Tensor& w) { return hs::linear(x, w); });
}
