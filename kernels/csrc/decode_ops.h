// The decode step's ops as C++ functions, for the step runner (decode_step.cpp) to call without
// the dispatcher. Each is also a torch op `hybrid_serve::<name>` with the same arguments; its
// contract is in the file that defines it and in the Python reference named there.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace hs {

// norms.cpp
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps);
// The decode products' choice by row count, as kernels/linear_cpp.py makes it: the
// weight-streaming GEMV up to kGemvRows rows (`SKINNY_ROWS` there), the tiled GEMM beyond.
constexpr int64_t kGemvRows = 8;
// cpu_kernels.cpp, multi_linear.cpp
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w);
std::vector<at::Tensor> skinny_linear_multi(const at::Tensor& x, at::TensorList weights);
// gemm.cpp: tiled_linear; routed_experts_into writes y [T, H] for xs [T, H] sorted by expert,
// counts[e] rows each (summing to T), gate_up [E, 2I, H] and down [E, H, I] alike fp32 or bf16
at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& w);
void routed_experts_into(const float* xs, const at::Tensor& gate_up, const at::Tensor& down,
                         const std::vector<int64_t>& counts, float* y);
// gemm_amx.cpp: y [M, N] fp32 = bf16(x) [M, K] w [N, K]^T on AMX tiles (amx.h), where
// amx_linear_fits: an AMX-BF16 CPU whose OS grants the tile state (amx_ready), bf16 w,
// K % 32 == 0, N % 16 == 0
bool amx_ready();
bool set_amx(bool on);
bool amx_linear_fits(const at::Tensor& x, const at::Tensor& w);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w);
// A decode product by row count, as kernels/linear_cpp.py picks it: the GEMV up to kGemvRows
// rows; beyond, AMX where it fits (bf16 weights), else the tiled GEMM.
inline at::Tensor decode_product(const at::Tensor& x, const at::Tensor& w) {
  if (x.size(0) <= kGemvRows) return skinny_linear(x, w);
  return amx_linear_fits(x, w) ? amx_linear(x, w) : tiled_linear(x, w);
}
// gemm_packed.cpp: columns [n0, n1) of y [M, N] = x [M, K] w [N, K]^T on the calling thread
// (x, w, y contiguous), bit for bit the tiled GEMM's outputs
void packed_cols(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t M,
                 int64_t n0, int64_t n1);
void packed_cols(const float* x, const at::BFloat16* w, float* y, int64_t N, int64_t K,
                 int64_t M, int64_t n0, int64_t n1);
// gdn_decode.cpp
at::Tensor gdn_decode(const at::Tensor& qkvz, const at::Tensor& ba, at::Tensor conv_state,
                      const at::Tensor& conv_weight, at::Tensor ssm_state, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                      const at::Tensor& slots_t, int64_t num_k_heads, double eps);
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
                      int64_t top_k, bool norm_topk_prob);

}  // namespace hs
