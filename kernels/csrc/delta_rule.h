// One token of the gated delta rule on one head's recurrent state, in place. Shared by the pool
// kernels of cpu_kernels.cpp and the fused decode op of gdn_decode.cpp.
#pragma once

#include <algorithm>
#include <cstdint>

namespace hs {

// state S [dk, dv] row-major; k, q [dk] (normalised and scaled by the caller); v [dv];
// acc, delta: dv-long scratch; o [dv] is accumulated into (the caller zeroes it):
//   S = decay S;  delta = beta (v - S^T k);  S += k delta^T;  o += S^T q
// Pass 1 decays S and forms S^T k; pass 2 updates S while it is still in cache and reads o off
// it, so each state is read from memory once and written once.
inline void delta_rule_token(float* state, const float* k, const float* q, const float* v,
                             float decay, float beta, int64_t dk, int64_t dv, float* acc,
                             float* delta, float* o) {
  std::fill(acc, acc + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = state + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= decay;
      acc[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - acc[j]) * beta;
  for (int64_t i = 0; i < dk; ++i) {
    float* row = state + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * delta[j];
      o[j] += qi * row[j];
    }
  }
}

}  // namespace hs
