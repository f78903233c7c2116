// The gated delta rule on recurrent states, in place: one token on a head's fp32 state (the pool
// decode kernels of cpu_kernels.cpp and gdn_decode.cpp), and the prefill's per-token pass over a
// double block of state columns (gdr_varlen_pool).
#pragma once

#include <algorithm>
#include <cstdint>

#include "prefetch.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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
#if defined(__AVX512F__) && defined(__FMA__)
  // the 16 columns as two 8-wide vectors: the AVX2 branch's operations, lane for lane
  const __m512d dc = _mm512_set1_pd(decay), bt = _mm512_set1_pd(beta);
  auto delta = [&](int c) {
    return _mm512_mul_pd(_mm512_fnmadd_pd(dc, _mm512_loadu_pd(a + c), _mm512_loadu_pd(v + c)), bt);
  };
  const __m512d d0 = delta(0), d1 = delta(8);
  __m512d o0 = _mm512_setzero_pd(), o1 = o0, a0 = o0, a1 = o0;
  for (int64_t i = 0; i < dk; ++i) {
    double* r = s + i * kBlockCols;
    const __m512d ki = _mm512_set1_pd(k[i]), qi = _mm512_set1_pd(q[i]);
    const __m512d ni = _mm512_set1_pd(k_next[i]);
    const __m512d r0 = _mm512_fmadd_pd(ki, d0, _mm512_mul_pd(_mm512_loadu_pd(r), dc));
    const __m512d r1 = _mm512_fmadd_pd(ki, d1, _mm512_mul_pd(_mm512_loadu_pd(r + 8), dc));
    _mm512_storeu_pd(r, r0);
    _mm512_storeu_pd(r + 8, r1);
    o0 = _mm512_fmadd_pd(qi, r0, o0);
    o1 = _mm512_fmadd_pd(qi, r1, o1);
    a0 = _mm512_fmadd_pd(ni, r0, a0);
    a1 = _mm512_fmadd_pd(ni, r1, a1);
  }
  _mm512_storeu_pd(o, o0);
  _mm512_storeu_pd(o + 8, o1);
  _mm512_storeu_pd(a, a0);
  _mm512_storeu_pd(a + 8, a1);
#elif defined(__AVX2__) && defined(__FMA__)
  // the 16 columns as four 4-wide vectors, every accumulator named (arrays of vectors would
  // be kept in memory by the compiler, stored and reloaded on every row)
  const __m256d dc = _mm256_set1_pd(decay), bt = _mm256_set1_pd(beta);
  auto delta = [&](int c) {
    return _mm256_mul_pd(_mm256_fnmadd_pd(dc, _mm256_loadu_pd(a + c), _mm256_loadu_pd(v + c)), bt);
  };
  const __m256d d0 = delta(0), d1 = delta(4), d2 = delta(8), d3 = delta(12);
  __m256d o0 = _mm256_setzero_pd(), o1 = o0, o2 = o0, o3 = o0, a0 = o0, a1 = o0, a2 = o0, a3 = o0;
  for (int64_t i = 0; i < dk; ++i) {
    double* r = s + i * kBlockCols;
    const __m256d ki = _mm256_broadcast_sd(k + i), qi = _mm256_broadcast_sd(q + i);
    const __m256d ni = _mm256_broadcast_sd(k_next + i);
    const __m256d r0 = _mm256_fmadd_pd(ki, d0, _mm256_mul_pd(_mm256_loadu_pd(r), dc));
    const __m256d r1 = _mm256_fmadd_pd(ki, d1, _mm256_mul_pd(_mm256_loadu_pd(r + 4), dc));
    const __m256d r2 = _mm256_fmadd_pd(ki, d2, _mm256_mul_pd(_mm256_loadu_pd(r + 8), dc));
    const __m256d r3 = _mm256_fmadd_pd(ki, d3, _mm256_mul_pd(_mm256_loadu_pd(r + 12), dc));
    _mm256_storeu_pd(r, r0);
    _mm256_storeu_pd(r + 4, r1);
    _mm256_storeu_pd(r + 8, r2);
    _mm256_storeu_pd(r + 12, r3);
    o0 = _mm256_fmadd_pd(qi, r0, o0);
    o1 = _mm256_fmadd_pd(qi, r1, o1);
    o2 = _mm256_fmadd_pd(qi, r2, o2);
    o3 = _mm256_fmadd_pd(qi, r3, o3);
    a0 = _mm256_fmadd_pd(ni, r0, a0);
    a1 = _mm256_fmadd_pd(ni, r1, a1);
    a2 = _mm256_fmadd_pd(ni, r2, a2);
    a3 = _mm256_fmadd_pd(ni, r3, a3);
  }
  _mm256_storeu_pd(o, o0);
  _mm256_storeu_pd(o + 4, o1);
  _mm256_storeu_pd(o + 8, o2);
  _mm256_storeu_pd(o + 12, o3);
  _mm256_storeu_pd(a, a0);
  _mm256_storeu_pd(a + 4, a1);
  _mm256_storeu_pd(a + 8, a2);
  _mm256_storeu_pd(a + 12, a3);
#else
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
#endif
}

}  // namespace hs
