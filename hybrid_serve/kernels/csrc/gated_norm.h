// One row of the GDN output's gated RMSNorm, y = (w * (x / rms(x))) * silu(z): shared by the
// fused decode op (gdn_decode.cpp) and the prefill's norm op (norms.cpp), so a prompt's prefill
// and its decode steps round alike. Reference: kernels/rmsnorm.py `rms_norm_gated`. And one
// group of the Mamba2 output's gate-first norm (mamba2_decode.cpp), reference
// `rms_norm_gate_first`. And KDA's sigmoid-gated output norm (kda_decode.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lanes.h"
#include "silu.h"

namespace hs {

inline void gated_rmsnorm_row(const float* x, const float* z, const float* w, float* y, int64_t D,
                              float eps) {
  const float r = 1.f / std::sqrt(dot8(x, x, D) / static_cast<float>(D) + eps);
  std::copy(z, z + D, y);
  silu_inplace(y, D);
  for (int64_t i = 0; i < D; ++i) y[i] = (w[i] * (x[i] * r)) * y[i];
}

// KDA's output norm (kda_decode.cpp), y = w * (x / rms(x)) * sigmoid(z). Reference:
// kernels/rmsnorm.py `rms_norm_gated_sigmoid`.
inline void sigmoid_gated_rmsnorm_row(const float* x, const float* z, const float* w, float* y,
                                      int64_t D, float eps) {
  const float r = 1.f / std::sqrt(dot8(x, x, D) / static_cast<float>(D) + eps);
  std::copy(z, z + D, y);
  sigmoid_inplace(y, D);
  for (int64_t i = 0; i < D; ++i) y[i] = (w[i] * (x[i] * r)) * y[i];
}

// g = x * silu(z); y = w * (g / rms(g)) over these D channels (one group); w null: y = g.
inline void gate_first_rmsnorm_row(const float* x, const float* z, const float* w, float* y,
                                   int64_t D, float eps) {
  std::copy(z, z + D, y);
  silu_inplace(y, D);
  for (int64_t i = 0; i < D; ++i) y[i] = x[i] * y[i];
  if (w == nullptr) return;
  const float r = 1.f / std::sqrt(dot8(y, y, D) / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) y[i] = w[i] * (y[i] * r);
}

}  // namespace hs
