// Mamba2's recurrence, one token on one head's fp32 state in place: the fused decode and verify
// ops (mamba2_decode.cpp). Reference: kernels/selective_state_update.py.
#pragma once

#include <cstdint>

#include "prefetch.h"
#include "simd.h"

namespace hs {

// state S [P, N] row-major; x [P]; B, C [N] (the head's group); dt, decay = exp(dt A) and the
// skip d already discretized:
//   S = decay S + (dt x) B^T;  y = S C + d x        (y [P] written)
// Each row of S is updated and read against C while in registers, so the state is read from
// memory once and written once. `next` (or null) is the state the caller updates next: it is
// fetched into L2 alongside, a share of it per row of S (prefetch.h).
inline void ssm_token(float* state, const float* x, const float* B, const float* C, float dt,
                      float decay, float d, int64_t P, int64_t N, float* y,
                      const float* next = nullptr) {
  namespace v = simd;
  constexpr int L = v::kLanes;
  Fetch ahead;
  const int64_t bytes = P * N * int64_t(sizeof(float));
  if (next != nullptr) ahead = Fetch(next, 1, bytes, bytes, P);
  const v::vec dv = v::bcast(decay);
  for (int64_t p = 0; p < P; ++p) {
    float* row = state + p * N;
    const float xdt = x[p] * dt;
    const v::vec xv = v::bcast(xdt);
    v::vec acc = v::zero();
    ahead.step();
    int64_t n = 0;
    for (; n + L <= N; n += L) {
      const v::vec s = v::fma(xv, v::load(B + n), v::mul(v::load(row + n), dv));
      v::store(row + n, s);
      acc = v::fma(s, v::load(C + n), acc);
    }
    float tail = 0.f;
    for (; n < N; ++n) {
      row[n] = simd::fma1(xdt, B[n], row[n] * decay);
      tail = simd::fma1(row[n], C[n], tail);
    }
    y[p] = v::hsum(acc) + tail + d * x[p];
  }
}

}  // namespace hs
