// The routed experts of a MoE layer in one call, at decode sizes: the torch op and
// `hs::routed_experts_into` (the decode step's MoE blocks, block_mlp.cpp) over the GEMV jobs of
// routed_experts.h, whose header states the contract: a row's result is the same bits whatever
// rows share its batch. Decode batches come here (kernels/cpp_ops.py sends inputs past
// ROUTED_MAX_ROWS rows to torch); the torch reference (kernels/experts.py `routed_experts`)
// agrees to rounding.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "decode_ops.h"
#include "routed_experts.h"
#include "tensor_args.h"

namespace hs {

void routed_experts_into(const float* xs, const at::Tensor& gate_up, const at::Tensor& down,
                         const std::vector<int64_t>& counts, float* y, float limit,
                         bool bf16_products) {
  routed_experts_rows(xs, gate_up.data_ptr(), down.data_ptr(), gate_up.scalar_type(),
                      counts.data(), static_cast<int64_t>(counts.size()),
                      hs::in_features(gate_up), hs::in_features(down), y, limit, bf16_products);
}

}  // namespace hs

namespace {

// xs [T, H] fp32 sorted by expert; gate_up [E, 2I, H], down [E, H, I] (fp32, bf16, int8 or
// int4, alike); counts [E] int64 summing to T -> [T, H] fp32: row t is
// down_e(silu(gate_e x_t) * up_e x_t) for the expert e whose slice holds t (with a limit > 0,
// the clamped SwiGLU: routed_experts.h `swiglu_row`). `bf16_products`: bf16 experts are K-pair
// panels (the bf16 route, decode_ops.h), multiplied by the panel product.
at::Tensor routed_experts(const at::Tensor& xs, const at::Tensor& gate_up, const at::Tensor& down,
                          const at::Tensor& counts, double limit, bool bf16_products) {
  TORCH_CHECK(xs.is_contiguous() && gate_up.is_contiguous() && down.is_contiguous() &&
                  counts.is_contiguous(),
              "routed_experts: contiguous inputs");
  TORCH_CHECK(xs.scalar_type() == at::kFloat && counts.scalar_type() == at::kLong,
              "routed_experts: fp32 rows and int64 counts expected");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type() && hs::weight_dtype(down.scalar_type()),
              "routed_experts: fp32, bf16, int8 or int4 weights, both alike");
  TORCH_CHECK(xs.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && counts.dim() == 1,
              "routed_experts: ranks");
  const int64_t T = xs.size(0), H = xs.size(1), E = gate_up.size(0), I = hs::in_features(down);
  TORCH_CHECK(gate_up.size(1) == 2 * I && hs::in_features(gate_up) == H && down.size(0) == E &&
                  down.size(1) == H && counts.size(0) == E,
              "routed_experts: shapes");
  const int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<int64_t> cnt(cp, cp + E);
  int64_t sum = 0;
  for (int64_t c : cnt) {
    TORCH_CHECK(c >= 0, "routed_experts: negative count");
    sum += c;
  }
  TORCH_CHECK(sum == T, "routed_experts: counts sum to ", sum, " for ", T, " rows");
  auto y = at::empty({T, H}, xs.options());
  hs::routed_experts_into(xs.data_ptr<float>(), gate_up, down, cnt, y.data_ptr<float>(),
                          static_cast<float>(limit), bf16_products);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("routed_experts(Tensor xs, Tensor gate_up, Tensor down, Tensor counts, "
        "float limit=0.0, bool bf16_products=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("routed_experts", &routed_experts);
}
