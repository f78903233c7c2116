// The CPU linear ops: `skinny_linear` (the weight-streaming GEMV, gemv.h, and the integer GEMV,
// qgemv.h), `tiled_linear` (the tiled GEMM, gemm.h), `bf16_panel_linear` (the bf16 route's panel
// product, bpanel.h) and `linear`, the product by row count (decode_ops.h). x [M, K] fp32,
// w [N, K] fp32, bf16, int8 or int4 (weights.h's formats), both contiguous -> y [M, N] fp32,
// accumulated in fp32.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "bpanel.h"
#include "decode_ops.h"
#include "gemm.h"
#include "gemv.h"
#include "tensor_args.h"

namespace hs {

int64_t quant_gemv_rows() { return kQGemvRows; }

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

// The panel product (bpanel.h): x rounded to bf16 times a bf16 w packed in K-pair panels
// (kernels/bf16_pack.py), each output one chain in k order at every row count, rounded to bf16
// and widened: the same bits for a row whatever M.
at::Tensor bf16_panel_linear(const at::Tensor& x_, const at::Tensor& w_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w_.scalar_type() == at::kBFloat16,
              "bf16_panel_linear: fp32 activations and bf16 weights expected");
  TORCH_CHECK(x_.dim() == 2 && w_.dim() == 2 && x_.size(1) == w_.size(1),
              "bf16_panel_linear: shapes");
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  bpanel::linear_into(x.data_ptr<float>(), reinterpret_cast<const c10::BFloat16*>(w.data_ptr()),
                      y.data_ptr<float>(), M, N, K);
  return y;
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
  m.def("tiled_linear(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_panel_linear(Tensor x, Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor w, bool bf16_products=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("skinny_linear", &hs::skinny_linear);
  m.impl("tiled_linear", &hs::tiled_linear);
  m.impl("bf16_panel_linear", &hs::bf16_panel_linear);
  m.impl("linear", [](const at::Tensor& x, const at::Tensor& w, bool bf16_products) {
    return hs::linear(x, w, bf16_products);
  });
}
