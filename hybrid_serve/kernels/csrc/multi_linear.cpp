// Several projections of one input in one op: y_i = x w_i^T, fp32 activations, fp32, bf16, int8
// or int4 weights (gemv.h). Up to hs::kGemvRows rows the weight-streaming GEMV for all weights in
// one parallel region (hs::skinny_linear_jobs); beyond, hs::linear per weight. With
// `bf16_products`, bf16 weights are K-pair panels and take the panel product at every size, as
// hs::linear's (decode_ops.h: the bf16 route).
// Reference and contract: kernels/multi_linear.py.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "decode_ops.h"
#include "gemv.h"
#include "tensor_args.h"

namespace hs {

std::vector<at::Tensor> skinny_linear_multi(const at::Tensor& x, at::TensorList weights,
                                            bool bf16_products) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "skinny_linear_multi: x [M, K] contiguous fp32 expected");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> out;
  std::vector<hs::GemvJob> jobs;
  out.reserve(weights.size());
  jobs.reserve(weights.size());
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.is_contiguous() && w.dim() == 2 && hs::in_features(w) == K,
                "skinny_linear_multi: contiguous [N, K] weights expected");
    out.push_back(at::empty({M, w.size(0)}, x.options()));
    jobs.push_back(hs::job_of(x.data_ptr<float>(), w, out.back().data_ptr<float>(), M,
                              bf16_products));
  }
  hs::skinny_linear_jobs(jobs.data(), static_cast<int64_t>(jobs.size()));  // one region
  return out;
}

std::vector<at::Tensor> linear_multi(const at::Tensor& x, at::TensorList weights,
                                     bool bf16_products) {
  const bool gemv = std::all_of(weights.begin(), weights.end(),
                                [&](const at::Tensor& w) { return x.size(0) <= gemv_rows(w); });
  if (gemv) return skinny_linear_multi(x, weights, bf16_products);
  std::vector<at::Tensor> out;
  for (const at::Tensor& w : weights) out.push_back(hs::linear(x, w, bf16_products));
  return out;
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("skinny_linear_multi(Tensor x, Tensor[] weights) -> Tensor[]");
  m.def("linear_multi(Tensor x, Tensor[] weights, bool bf16_products=False) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("skinny_linear_multi", [](const at::Tensor& x, at::TensorList weights) {
    return hs::skinny_linear_multi(x, weights);
  });
  m.impl("linear_multi", &hs::linear_multi);
}
