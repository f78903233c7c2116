// silu(y) = y / (1 + exp(-y)) and sigmoid(y) in place, with simd.h's polynomial exp (eight lanes
// at a time, the tail through the same polynomial, so a value's result does not depend on where
// it sits): shared by the fused GDN and KDA decodes (gdn_decode.cpp, kda_decode.cpp), the
// prefill conv (conv_pool.cpp) and the experts' swiglu (routed_experts.cpp).
#pragma once

#include <cstdint>

#include "simd.h"

namespace hs {

// y[i] = y[i] / (1 + exp(-y[i])), in place.
inline void silu_inplace(float* y, int64_t n) {
  namespace v = simd;
  int64_t i = 0;
  const v::f8 one = v::bcast8(1.f);
  for (; i + 8 <= n; i += 8) {
    const v::f8 x = v::load8(y + i);
    v::store8(y + i, v::div(x, v::add(one, v::exp(v::sub(v::zero8(), x)))));
  }
  for (; i < n; ++i) y[i] = y[i] / (1.f + v::exp1(-y[i]));
}

// y[i] = 1 / (1 + exp(-y[i])), in place (the same exp).
inline void sigmoid_inplace(float* y, int64_t n) {
  namespace v = simd;
  int64_t i = 0;
  const v::f8 one = v::bcast8(1.f);
  for (; i + 8 <= n; i += 8) {
    const v::f8 x = v::load8(y + i);
    v::store8(y + i, v::div(one, v::add(one, v::exp(v::sub(v::zero8(), x)))));
  }
  for (; i < n; ++i) y[i] = 1.f / (1.f + v::exp1(-y[i]));
}

}  // namespace hs
