// The decode step's ops as C++ functions, for the step runner (block_*.cpp) to call without
// the dispatcher. Each is also a torch op `hybrid_serve::<name>` with the same arguments; its
// contract is in the file that defines it and in the Python reference named there.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace hs {

// norms.cpp
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps);
at::Tensor rmsnorm_gated(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight,
                         double eps);
// The CPU linear layer's product by row count, the one place that choice is made (the torch op
// hybrid_serve::linear, the fused decode ops and the decode step all call `linear`): the
// weight-streaming GEMV up to kGemvRows rows (int8/int4: `gemv_rows`), the tiled GEMM beyond, prefill included, so a row's
// result depends neither on its batch nor on how a prefill is chunked (benchmarks/gemm_shapes.py
// compares it with MKL by row count: BENCHMARKS.md, "The hand-written products against MKL").
// int8/int4 weights take the integer GEMV further, up to `gemv_rows` (qgemv.h's kQGemvRows:
// 64 at the AVX-512 levels, 16 at AVX2), where it beats the GEMM; the two give the same
// bits (qgemm.h), so the choice is speed only.
constexpr int64_t kGemvRows = 8;
int64_t quant_gemv_rows();  // linear_ops.cpp
inline int64_t gemv_rows(const at::Tensor& w) {
  const at::ScalarType t = w.scalar_type();
  return t == at::kChar || t == at::kByte ? quant_gemv_rows() : kGemvRows;
}
// linear_ops.cpp, multi_linear.cpp
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w);
std::vector<at::Tensor> skinny_linear_multi(const at::Tensor& x, at::TensorList weights,
                                            bool bf16_products = false);
std::vector<at::Tensor> linear_multi(const at::Tensor& x, at::TensorList weights,
                                     bool bf16_products);
// linear_ops.cpp: tiled_linear; routed_experts.cpp: routed_experts_into writes y [T, H] for xs [T, H]
// sorted by expert, counts[e] rows each (summing to T), gate_up [E, 2I, H] and down [E, H, I]
// alike fp32, bf16, int8 or int4 (weights.h's formats); a limit > 0 clamps the SwiGLU
// (kernels/experts.py `swiglu`); `bf16_products`: bf16 experts are panels (the bf16 route,
// below), multiplied by the panel product
at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& w);
void routed_experts_into(const float* xs, const at::Tensor& gate_up, const at::Tensor& down,
                         const std::vector<int64_t>& counts, float* y, float limit = 0.f,
                         bool bf16_products = false);
// The bf16 route: with `bf16_products` (chosen once, at load, for CPUs that multiply bf16 in
// hardware: kernels/kernel_set.py), every bf16 matrix on the CPU is packed at load in K-pair
// panels (weights.h, kernels/bf16_pack.py; models/loader.py `pack_matrices`) and every product
// of one reads it through the panel product (`bf16_panel_linear`, bpanel.h): x rounded to bf16,
// each pair product exact, each output one fp32 chain in k order rounded to bf16 once and
// widened, at every row count, so a row's result does not depend on its batch at all (the
// 1-row GEMV, a verify's rows and prefill chunks agree bit for bit). `bf16_products` therefore
// also says the bf16 weights handed over are panels. No oneDNN on this path: at 128-512 rows
// the panel product measured 0.91-0.97x torch's oneDNN product (issue 58), which would need a
// second, plain copy of the weights (or rows unpacked per call) and would break the row
// contract. Other formats are unchanged.
constexpr int64_t kBf16Rows = 1;
// linear_ops.cpp: the bf16 route's product on a w packed in K-pair panels (bpanel.h)
at::Tensor bf16_panel_linear(const at::Tensor& x, const at::Tensor& w);
// x [M, K] fp32, w [N, K] fp32, bf16, int8 or int4 (gemv.h's formats; both contiguous; a bf16 w
// in panels where `bf16_products`) -> y [M, N] fp32
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& w, bool bf16_products) {
  if (bf16_products && x.size(0) >= kBf16Rows && w.scalar_type() == at::kBFloat16) {
    return bf16_panel_linear(x, w);
  }
  return x.size(0) <= gemv_rows(w) ? skinny_linear(x, w) : tiled_linear(x, w);
}
// conv_pool.cpp, delta_rule_pool.cpp: the unfused GDN decode's conv update and recurrence
at::Tensor conv1d_update_pool(const at::Tensor& x, at::Tensor conv_state,
                              const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              const at::Tensor& indices, bool silu);
at::Tensor gdr_recurrent_pool(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta, at::Tensor pool,
                              const at::Tensor& indices, double scale, bool l2norm);
// gdn_decode.cpp
at::Tensor gdn_decode(const at::Tensor& qkvz, const at::Tensor& ba, at::Tensor conv_state,
                      const at::Tensor& conv_weight, at::Tensor ssm_state, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                      const at::Tensor& slots_t, int64_t num_k_heads, double eps);
at::Tensor gdn_verify(const at::Tensor& qkvz, const at::Tensor& ba, at::Tensor conv_state,
                      const at::Tensor& conv_weight, at::Tensor ssm_state, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                      const at::Tensor& slots_t, const at::Tensor& starts_t,
                      const at::Tensor& steps_t, int64_t num_k_heads, double eps);
// kda_decode.cpp
at::Tensor kda_decode(const at::Tensor& qkvz, const at::Tensor& ba, at::Tensor conv_state,
                      const at::Tensor& conv_weight, at::Tensor ssm_state, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                      const at::Tensor& slots_t, double eps, std::optional<double> lower_bound);
// mamba2_decode.cpp
at::Tensor mamba2_decode(const at::Tensor& zxbcdt, at::Tensor conv_state,
                         const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
                         at::Tensor ssm_state, const at::Tensor& A_log, const at::Tensor& dt_bias,
                         const at::Tensor& D, const std::optional<at::Tensor>& norm_weight,
                         const at::Tensor& slots_t, int64_t num_groups, double eps,
                         double dt_min, double dt_max);
at::Tensor mamba2_verify(const at::Tensor& zxbcdt, at::Tensor conv_state,
                         const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
                         at::Tensor ssm_state, const at::Tensor& A_log, const at::Tensor& dt_bias,
                         const at::Tensor& D, const std::optional<at::Tensor>& norm_weight,
                         const at::Tensor& slots_t, const at::Tensor& starts_t,
                         const at::Tensor& steps_t, int64_t num_groups, double eps,
                         double dt_min, double dt_max);
// attn_decode.cpp
at::Tensor attn_decode(const at::Tensor& qg, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& q_norm_w, const at::Tensor& k_norm_w,
                       const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_buffer,
                       at::Tensor v_buffer, const at::Tensor& out_loc,
                       const at::Tensor& req_to_token, const at::Tensor& req_slots,
                       const at::Tensor& seq_lens, int64_t num_heads, double scale, double eps);
// moe_decode.cpp
at::Tensor moe_decode(const at::Tensor& x, const at::Tensor& router_w,
                      const at::Tensor& experts_gate_up, const at::Tensor& experts_down,
                      const at::Tensor& shared_gate_w, const at::Tensor& shared_gate_proj,
                      const at::Tensor& shared_up_proj, const at::Tensor& shared_down,
                      int64_t top_k, bool norm_topk_prob, bool bf16_products);

}  // namespace hs
