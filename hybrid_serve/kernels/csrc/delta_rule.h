// The gated delta rule on recurrent states, in place: one token on a head's fp32 state (the pool
// decode kernels of delta_rule_pool.cpp and gdn_decode.cpp), and the prefill's per-token pass over a
// double block of state columns (gdr_varlen_pool).
#pragma once

#include <algorithm>
#include <cstdint>

#include "prefetch.h"
#include "simd.h"

namespace hs {

// state S [dk, dv] row-major; k, q [dk] (normalised and scaled by the caller); v [dv];
// acc, delta: dv-long scratch; o [dv] is accumulated into (the caller zeroes it):
//   S = decay S;  delta = beta (v - S^T k);  S += k delta^T;  o += S^T q
// Pass 1 decays S and forms S^T k; pass 2 updates S while it is still in cache and reads o off
// it, so each state is read from memory once and written once. `next` (or null) is the state
// the caller updates next: both passes fetch it into L2 alongside (prefetch.h), half a row of
// it per row of S (spread over both passes, not all in pass 1), a second stream of reads that
// keeps more of the memory's parallelism busy than one sequential run per core.
inline void delta_rule_token(float* state, const float* k, const float* q, const float* v,
                             float decay, float beta, int64_t dk, int64_t dv, float* acc,
                             float* delta, float* o, const float* next = nullptr) {
  Fetch ahead;  // the next state, contiguous, over both passes' 2 dk rows
  const int64_t bytes = dk * dv * int64_t(sizeof(float));
  if (next != nullptr) ahead = Fetch(next, 1, bytes, bytes, 2 * dk);
  std::fill(acc, acc + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = state + i * dv;
    const float ki = k[i];
    ahead.step();
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= decay;
      acc[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - acc[j]) * beta;
  for (int64_t i = 0; i < dk; ++i) {
    float* row = state + i * dv;
    const float ki = k[i], qi = q[i];
    ahead.step();
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * delta[j];
      o[j] += qi * row[j];
    }
  }
}

// Tokens of one sequence on a dense block of 16 state columns (S [dk, 16], double), one pass
// over the block per token. The pass for token t is handed a = S_{t-1}^T k_t (from the pass
// before, or `block_dot` for the first token) and, while each row is in registers, forms:
//   delta = beta (v - decay a);  S = decay S + k delta^T;  o = S^T q;  a' = S^T k_next
// (decay S_{t-1}^T k_t = decay a: the same product as delta_rule_token's, rounded in double).
// o [16] and a' (into a) are written; k_next may be any dk-vector for the last token.
constexpr int kBlockCols = 16;

inline void block_dot(const double* __restrict__ s, const double* __restrict__ k, int64_t dk,
                      double* __restrict__ a) {  // a [16] = S^T k
  std::fill(a, a + kBlockCols, 0.0);
  for (int64_t i = 0; i < dk; ++i)
    for (int j = 0; j < kBlockCols; ++j) a[j] += k[i] * s[i * kBlockCols + j];
}

inline void delta_rule_pass(double* __restrict__ s, const double* __restrict__ k,
                            const double* __restrict__ q, const double* __restrict__ k_next,
                            const double* __restrict__ v, double decay, double beta, int64_t dk,
                            double* __restrict__ a, double* __restrict__ o) {
  if constexpr (!simd::kVector) {  // generic x86: plain double loops (no FMA instruction)
    double delta[kBlockCols];
    for (int j = 0; j < kBlockCols; ++j) {
      delta[j] = (v[j] - decay * a[j]) * beta;
      o[j] = a[j] = 0.0;
    }
    for (int64_t i = 0; i < dk; ++i) {
      double* r = s + i * kBlockCols;
      for (int j = 0; j < kBlockCols; ++j) {
        r[j] = r[j] * decay + k[i] * delta[j];
        o[j] += q[i] * r[j];
        a[j] += k_next[i] * r[j];
      }
    }
  } else {
    // the 16 columns as 16 / kLanesD vectors (all in registers once the loops are unrolled)
    namespace V = simd;
    constexpr int L = V::kLanesD, NV = kBlockCols / L;
    const V::vd dc = V::bcast_d(decay), bt = V::bcast_d(beta);
    V::vd dl[NV], ov[NV], av[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      dl[c] = V::mul(V::fnma(dc, V::load_d(a + c * L), V::load_d(v + c * L)), bt);
      ov[c] = av[c] = V::zero_d();
    }
    for (int64_t i = 0; i < dk; ++i) {
      double* r = s + i * kBlockCols;
      const V::vd ki = V::bcast_d(k[i]), qi = V::bcast_d(q[i]), ni = V::bcast_d(k_next[i]);
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) {
        const V::vd rc = V::fma(ki, dl[c], V::mul(V::load_d(r + c * L), dc));
        V::store_d(r + c * L, rc);
        ov[c] = V::fma(qi, rc, ov[c]);
        av[c] = V::fma(ni, rc, av[c]);
      }
    }
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      V::store_d(o + c * L, ov[c]);
      V::store_d(a + c * L, av[c]);
    }
  }
}

}  // namespace hs
