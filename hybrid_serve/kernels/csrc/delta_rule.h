// The gated delta rule on recurrent states, in place: one token on a head's fp32 state (the pool
// decode kernels of delta_rule_pool.cpp, gdn_decode.cpp and kda_decode.cpp), and the prefill's
// per-token pass over a double block of state columns (gdr_varlen_pool).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lanes.h"
#include "prefetch.h"
#include "simd.h"

namespace hs {

// state S [dk, dv] row-major; k, q [dk] (normalised and scaled by the caller); v [dv];
// acc, delta: dv-long scratch; o [dv] is accumulated into (the caller zeroes it):
//   S = D S;  delta = beta (v - S^T k);  S += k delta^T;  o += S^T q
// with D = diag(decay(i)): row i of S decays by decay(i), one scalar for every row (Gated
// DeltaNet's gate) or one per key channel (KDA's); the forms below name the two.
// Pass 1 decays S and forms S^T k; pass 2 updates S while it is still in cache and reads o off
// it, so each state is read from memory once and written once. `next` (or null) is the state
// the caller updates next: both passes fetch it into L2 alongside (prefetch.h), half a row of
// it per row of S (spread over both passes, not all in pass 1), a second stream of reads that
// keeps more of the memory's parallelism busy than one sequential run per core.
template <typename RowDecay>
inline void delta_rule_token_rows(float* state, const float* k, const float* q, const float* v,
                                  const RowDecay& decay, float beta, int64_t dk, int64_t dv,
                                  float* acc, float* delta, float* o,
                                  const float* next = nullptr) {
  Fetch ahead;  // the next state, contiguous, over both passes' 2 dk rows
  const int64_t bytes = dk * dv * int64_t(sizeof(float));
  if (next != nullptr) ahead = Fetch(next, 1, bytes, bytes, 2 * dk);
  std::fill(acc, acc + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = state + i * dv;
    const float ki = k[i], di = decay(i);
    ahead.step();
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= di;
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

// One head's q and k for the decode's update, l2-normalised as the references' `l2norm`
// (1e-6 under the root) with q also scaled: qs = q * scale / |q|, ks = k / |k| (dk each).
inline void normalise_qk(const float* q, const float* k, int64_t dk, float scale, float* qs,
                         float* ks) {
  const float qm = scale / std::sqrt(dot8(q, q, dk) + 1e-6f);
  const float km = 1.f / std::sqrt(dot8(k, k, dk) + 1e-6f);
  for (int64_t i = 0; i < dk; ++i) {
    qs[i] = q[i] * qm;
    ks[i] = k[i] * km;
  }
}

// One decay for the whole state (Gated DeltaNet).
inline void delta_rule_token(float* state, const float* k, const float* q, const float* v,
                             float decay, float beta, int64_t dk, int64_t dv, float* acc,
                             float* delta, float* o, const float* next = nullptr) {
  delta_rule_token_rows(state, k, q, v, [decay](int64_t) { return decay; }, beta, dk, dv, acc,
                        delta, o, next);
}

// One decay per row: decays [dk] (KDA's per-channel gate, exp already taken).
inline void delta_rule_token(float* state, const float* k, const float* q, const float* v,
                             const float* decays, float beta, int64_t dk, int64_t dv, float* acc,
                             float* delta, float* o, const float* next = nullptr) {
  delta_rule_token_rows(state, k, q, v, [decays](int64_t i) { return decays[i]; }, beta, dk, dv,
                        acc, delta, o, next);
}

// Tokens of one sequence on a dense block of 16 state columns (S [dk, 16], double), one pass
// over the block per token. The pass for token t is handed a = S_{t-1}^T k_t (from the pass
// before, or `block_dot` for the first token) and, while each row is in registers, forms:
//   delta = beta (v - decay a);  S = decay S + k delta^T;  o = S^T q;  a' = S^T k_next
// (decay S_{t-1}^T k_t = decay a: the same product as delta_rule_token's, rounded in double).
// o [16] and a' (into a) are written; k_next may be any dk-vector for the last token.
// With a per-channel gate (D_t = diag(d_t), `delta_rule_pass_channels`) the decay no longer
// factors out of the product: a is then S_{t-1}^T (d_t * k_t), handed over the same way (the
// pass is given d_{t+1} with k_next), and the rows decay by d_t:
//   delta = beta (v - a);  S = D_t S + k delta^T;  o = S^T q;  a' = S^T (d_{t+1} * k_next)
constexpr int kBlockCols = 16;

// a [16] = S^T (k * scale(i)) over the rows i
template <typename RowScale>
inline void block_dot_rows(const double* __restrict__ s, const double* __restrict__ k, int64_t dk,
                           const RowScale& scale, double* __restrict__ a) {
  std::fill(a, a + kBlockCols, 0.0);
  for (int64_t i = 0; i < dk; ++i) {
    const double ki = k[i] * scale(i);
    for (int j = 0; j < kBlockCols; ++j) a[j] += ki * s[i * kBlockCols + j];
  }
}

inline void block_dot(const double* __restrict__ s, const double* __restrict__ k, int64_t dk,
                      double* __restrict__ a) {  // a [16] = S^T k
  block_dot_rows(s, k, dk, [](int64_t) { return 1.0; }, a);
}

// The pass of either form: `a_decay` scales the a handed in (the scalar decay, or 1), row i
// decays by decay(i), and a' is formed with k_next[i] * next_decay(i) (the scalar form: 1,
// exact, so both forms are one body and the scalar one rounds as it always has).
template <typename RowDecay, typename NextDecay>
inline void delta_rule_pass_rows(double* __restrict__ s, const double* __restrict__ k,
                                 const double* __restrict__ q, const double* __restrict__ k_next,
                                 const double* __restrict__ v, double a_decay,
                                 const RowDecay& decay, const NextDecay& next_decay, double beta,
                                 int64_t dk, double* __restrict__ a, double* __restrict__ o) {
  if constexpr (!simd::kVector) {  // generic x86: plain double loops (no FMA instruction)
    double delta[kBlockCols];
    for (int j = 0; j < kBlockCols; ++j) {
      delta[j] = (v[j] - a_decay * a[j]) * beta;
      o[j] = a[j] = 0.0;
    }
    for (int64_t i = 0; i < dk; ++i) {
      double* r = s + i * kBlockCols;
      const double di = decay(i), ni = k_next[i] * next_decay(i);
      for (int j = 0; j < kBlockCols; ++j) {
        r[j] = r[j] * di + k[i] * delta[j];
        o[j] += q[i] * r[j];
        a[j] += ni * r[j];
      }
    }
  } else {
    // the 16 columns as 16 / kLanesD vectors (all in registers once the loops are unrolled)
    namespace V = simd;
    constexpr int L = V::kLanesD, NV = kBlockCols / L;
    const V::vd ad = V::bcast_d(a_decay), bt = V::bcast_d(beta);
    V::vd dl[NV], ov[NV], av[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      dl[c] = V::mul(V::fnma(ad, V::load_d(a + c * L), V::load_d(v + c * L)), bt);
      ov[c] = av[c] = V::zero_d();
    }
    for (int64_t i = 0; i < dk; ++i) {
      double* r = s + i * kBlockCols;
      const V::vd ki = V::bcast_d(k[i]), qi = V::bcast_d(q[i]);
      const V::vd ni = V::bcast_d(k_next[i] * next_decay(i)), dc = V::bcast_d(decay(i));
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

// One decay for the whole state (Gated DeltaNet).
inline void delta_rule_pass(double* __restrict__ s, const double* __restrict__ k,
                            const double* __restrict__ q, const double* __restrict__ k_next,
                            const double* __restrict__ v, double decay, double beta, int64_t dk,
                            double* __restrict__ a, double* __restrict__ o) {
  delta_rule_pass_rows(s, k, q, k_next, v, decay, [decay](int64_t) { return decay; },
                       [](int64_t) { return 1.0; }, beta, dk, a, o);
}

// One decay per row (KDA): decay = d_t [dk] and next_decay = d_{t+1} [dk] (any dk-vector for
// the last token), exp already taken; a is S^T (d k), as above.
inline void delta_rule_pass_channels(double* __restrict__ s, const double* __restrict__ k,
                                     const double* __restrict__ q,
                                     const double* __restrict__ k_next,
                                     const double* __restrict__ v,
                                     const double* __restrict__ decay,
                                     const double* __restrict__ next_decay, double beta,
                                     int64_t dk, double* __restrict__ a, double* __restrict__ o) {
  delta_rule_pass_rows(s, k, q, k_next, v, 1.0, [decay](int64_t i) { return decay[i]; },
                       [next_decay](int64_t i) { return next_decay[i]; }, beta, dk, a, o);
}

}  // namespace hs
