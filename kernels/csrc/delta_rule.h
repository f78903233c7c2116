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

// One token on a dense block of NB state columns (S [dk, NB]) in precision T: delta_rule_token's
// sums in the same order, with the columns held in 32-byte vectors (GCC/Clang vector
// extensions, unaligned) and their accumulators in registers; o [NB] is written.
template <typename T, int NB>
inline void delta_rule_block(T* __restrict__ state, const T* __restrict__ k,
                             const T* __restrict__ q, const T* __restrict__ v, T decay, T beta,
                             int64_t dk, T* __restrict__ o) {
  typedef T vec __attribute__((vector_size(32), aligned(alignof(T))));
  constexpr int W = 32 / sizeof(T), NV = NB / W;
  static_assert(NB % W == 0, "whole vectors of columns");
  vec acc[NV], delta[NV], out[NV];
  for (int u = 0; u < NV; ++u) acc[u] = out[u] = vec{};
  for (int64_t i = 0; i < dk; ++i) {
    vec* row = reinterpret_cast<vec*>(state + i * NB);
    const T ki = k[i];
    for (int u = 0; u < NV; ++u) {
      const vec r = row[u] * decay;
      row[u] = r;
      acc[u] += ki * r;
    }
  }
  for (int u = 0; u < NV; ++u) {
    delta[u] = (*reinterpret_cast<const vec*>(v + u * W) - acc[u]) * beta;
  }
  for (int64_t i = 0; i < dk; ++i) {
    vec* row = reinterpret_cast<vec*>(state + i * NB);
    const T ki = k[i], qi = q[i];
    for (int u = 0; u < NV; ++u) {
      const vec r = row[u] + ki * delta[u];
      row[u] = r;
      out[u] += qi * r;
    }
  }
  for (int u = 0; u < NV; ++u) *reinterpret_cast<vec*>(o + u * W) = out[u];
}

}  // namespace hs
