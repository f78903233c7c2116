// The register vector of the CPU GEMV and GEMMs (gemv.h, gemm.cpp): 16 fp32
// lanes where the compiler targets AVX-512 (`-march=native` on such a CPU), 8 with AVX2 + FMA.
// In the GEMMs the lanes run along outputs, never along k, so every output is the same chain of
// fused multiply-adds whatever the width: the two builds give bit-identical results. The GEMV's
// lanes run along k, so its last bits differ between the builds (never within one). On an
// AVX-512 CPU each FMA does twice the work of an AVX2 one, so the narrower build would waste half
// the FMA peak.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HS_AVX2 1
#endif

#ifdef HS_AVX2
namespace hs::simd {
// The sum of 8 fp32 lanes, in one fixed order at every width: the integer GEMV (qgemv.h) keeps
// 8-lane accumulators whatever the build targets.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
}  // namespace hs::simd
#endif

#if defined(__AVX512F__) && defined(HS_AVX2)
#define HS_SIMD 1
namespace hs::simd {
constexpr int kLanes = 16;
using vec = __m512;
inline vec zero() { return _mm512_setzero_ps(); }
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline vec load_aligned(const float* p) { return _mm512_load_ps(p); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline void store_aligned(float* p, vec v) { _mm512_store_ps(p, v); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec bcast(float v) { return _mm512_set1_ps(v); }
// Two adjacent bf16 values p[0], p[1] (one 4-byte load) widened exactly, each in every lane.
inline void bcast_pair(const void* p, vec& lo, vec& hi) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  const __m512i pair = _mm512_set1_epi32(bits);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
// kLanes weights, bf16 widened exactly.
inline vec load_w(const float* p) { return _mm512_loadu_ps(p); }
inline vec load_w(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
}  // namespace hs::simd
#elif defined(HS_AVX2)
#define HS_SIMD 1
namespace hs::simd {
constexpr int kLanes = 8;
using vec = __m256;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline vec load_aligned(const float* p) { return _mm256_load_ps(p); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline void store_aligned(float* p, vec v) { _mm256_store_ps(p, v); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec bcast(float v) { return _mm256_set1_ps(v); }
inline void bcast_pair(const void* p, vec& lo, vec& hi) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  const __m256i pair = _mm256_set1_epi32(bits);
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(pair, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline vec load_w(const float* p) { return _mm256_loadu_ps(p); }
inline vec load_w(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(vec v) { return hsum8(v); }
}  // namespace hs::simd
#else
namespace hs::simd {
constexpr int kLanes = 8;  // the scalar fallbacks keep the AVX2 build's blocking
}  // namespace hs::simd
#endif
