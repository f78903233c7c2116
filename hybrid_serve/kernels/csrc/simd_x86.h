// simd.h's vocabulary on x86: AVX2 + FMA, AVX-512 (F/BW/DQ/VL), and VNNI (EVEX on AVX-512
// levels, VEX AVX-VNNI otherwise) for the integer dot. Included by simd.h only; the contracts
// and the scalar reference of each entry are there.
#pragma once

#include <immintrin.h>

namespace hs::simd {

constexpr bool kVector = true;

// ---- f8, i32x8, b32: 256-bit at every x86 level ----
struct f8 {
  __m256 v;
};
struct i32x8 {
  __m256i v;
};
struct b32 {
  __m256i v;
};

inline f8 zero8() { return {_mm256_setzero_ps()}; }
inline f8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store8(float* p, f8 a) { _mm256_storeu_ps(p, a.v); }
inline f8 bcast8(float x) { return {_mm256_set1_ps(x)}; }
inline f8 add(f8 a, f8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline f8 sub(f8 a, f8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline f8 mul(f8 a, f8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline f8 div(f8 a, f8 b) { return {_mm256_div_ps(a.v, b.v)}; }
inline f8 fma(f8 a, f8 b, f8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline f8 fnma(f8 a, f8 b, f8 c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
inline f8 min(f8 a, f8 b) { return {_mm256_min_ps(a.v, b.v)}; }
inline f8 max(f8 a, f8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline f8 round_even(f8 a) {
  return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline f8 pow2i(f8 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
}
inline float hsum(f8 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline f8 to_float(i32x8 a) { return {_mm256_cvtepi32_ps(a.v)}; }

inline b32 load32(const int8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))};
}
inline void store32(int8_t* p, b32 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.v);
}
inline b32 q4_nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return {_mm256_and_si256(both, _mm256_set1_epi8(0x0F))};
}
inline b32 q4_unpack(const uint8_t* p) {
  return {_mm256_sub_epi8(q4_nibbles(p).v, _mm256_set1_epi8(8))};
}
inline __m256i bcast_quad(const int8_t* q) {
  int32_t bits;
  std::memcpy(&bits, q, sizeof bits);
  return _mm256_set1_epi32(bits);
}
// int4 tiles: each quad of activations broadcast (a load) against 8 rows' nibbles of it. With
// VNNI one vpdpbusd per quad; with AVX2 the quads' maddubs pairs summed in int16 (8 quads of
// 15 x 127 pairs: at most 30480, no saturation) and widened once. (A 512-bit body, two quads
// per register against a permutation of the activations, ran no faster on Zen 4 at one row and
// slower at four; two tiles per 512-bit register, their quads against one broadcast, ran
// faster from cache but reads two streams and ran slower from memory: 256-bit here at every
// level.) The body's loads are what it is short of on Zen 4, so the unpack reads each 32 bytes
// once (the compiler otherwise folds a load into each of the two nibbles' ops) and with
// AVX512-VNNI the quad's broadcast rides in vpdpbusd's memory operand (EVEX embedded
// broadcast, which the compiler does not form from the intrinsics): the same integers.
struct q4x8 {
  __m256i quad[8];
};
inline q4x8 q4x8_unpack(const uint8_t* p) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  q4x8 r;
  for (int j = 0; j < 4; ++j) {
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j));
    asm("" : "+v"(b));  // b in a register: one load for both nibbles
    r.quad[j] = _mm256_and_si256(b, m);
    r.quad[j + 4] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
  }
  return r;
}
inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) {
#if defined(HS_VNNI_EVEX)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#if defined(HS_VNNI_EVEX)
// acc + vpdpbusd(u, the 4 bytes at q in every lane), the broadcast in the memory operand
inline __m256i dpbusd8_quad(__m256i acc, __m256i u, const int8_t* q) {
  asm("vpdpbusd %2%{1to8%}, %1, %0"
      : "+v"(acc)
      : "v"(u), "m"(*reinterpret_cast<const int32_t*>(q)));
  return acc;
}
#else
inline __m256i dpbusd8_quad(__m256i acc, __m256i u, const int8_t* q) {
  return dpbusd8(acc, u, bcast_quad(q));
}
#endif
inline i32x8 q4x8_dot(const q4x8& w, int32_t c, const int8_t* q) {
#if defined(HS_VNNI_EVEX) || defined(HS_VNNI_VEX)
  __m256i a = _mm256_set1_epi32(c), b = _mm256_setzero_si256();
  for (int j = 0; j < 8; j += 2) {
    a = dpbusd8_quad(a, w.quad[j], q + 4 * j);
    b = dpbusd8_quad(b, w.quad[j + 1], q + 4 * j + 4);
  }
  return {_mm256_add_epi32(a, b)};
#else
  __m256i s = _mm256_maddubs_epi16(w.quad[0], bcast_quad(q));
  for (int j = 1; j < 8; ++j)
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w.quad[j], bcast_quad(q + 4 * j)));
  return {_mm256_add_epi32(_mm256_set1_epi32(c), _mm256_madd_epi16(s, _mm256_set1_epi16(1)))};
#endif
}
// int8 tiles: with VNNI the bytes plus 128 (unsigned) against each broadcast quad (with
// AVX512-VNNI in vpdpbusd's memory operand, as int4's), the lanes started at -128 sum; with
// AVX2 maddubs of |w| and the quad given w's signs (|w| and |q| <= 127: a pair at most 32258,
// no saturation), widened to int32 per quad. (A 512-bit body, two quads of the 8 rows per
// register against a permutation of the activations per pair, spent 4 permutes and a fold per
// row and block: twice the 256-bit body's work per row on Zen 4, where a 512-bit op takes two
// 256-bit slots.)
struct q8x8 {
  __m256i quad[8];
};
inline q8x8 q8x8_load(const int8_t* p) {
  q8x8 r;
  for (int j = 0; j < 8; ++j) {
    r.quad[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j));
#if defined(HS_VNNI_EVEX) || defined(HS_VNNI_VEX)
    r.quad[j] = _mm256_xor_si256(r.quad[j], _mm256_set1_epi8(int8_t(0x80)));
#endif
  }
  return r;
}
inline i32x8 q8x8_dot(const q8x8& w, int32_t sum, const int8_t* q) {
#if defined(HS_VNNI_EVEX) || defined(HS_VNNI_VEX)
  __m256i a = _mm256_set1_epi32(-128 * sum), b = _mm256_setzero_si256();
  for (int j = 0; j < 8; j += 2) {
    a = dpbusd8_quad(a, w.quad[j], q + 4 * j);
    b = dpbusd8_quad(b, w.quad[j + 1], q + 4 * j + 4);
  }
  return {_mm256_add_epi32(a, b)};
#else
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  for (int j = 0; j < 8; j += 2) {
    const __m256i w0 = w.quad[j], w1 = w.quad[j + 1];
    const __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0),
                                            _mm256_sign_epi8(bcast_quad(q + 4 * j), w0));
    const __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1),
                                            _mm256_sign_epi8(bcast_quad(q + 4 * j + 4), w1));
    a = _mm256_add_epi32(a, _mm256_madd_epi16(p0, ones));
    b = _mm256_add_epi32(b, _mm256_madd_epi16(p1, ones));
  }
  return {_mm256_add_epi32(a, b)};
#endif
}
inline f8 load8_bf16(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
inline void widen(b32 q, float s, float* out) {
  const __m256 sv = _mm256_set1_ps(s);
  const auto put = [&](float* o, __m128i v) {  // the low 8 bytes' values, scaled
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), sv));
  };
  const __m128i lo = _mm256_castsi256_si128(q.v), hi = _mm256_extracti128_si256(q.v, 1);
  put(out, lo);
  put(out + 8, _mm_srli_si128(lo, 8));
  put(out + 16, hi);
  put(out + 24, _mm_srli_si128(hi, 8));
}
inline float quantize32(const float* x, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // packs interleave the 128-bit lanes: 0-3 8-11 4-7 12-15 | 16-19 24-27 20-23 28-31 as dwords
  // of 4 bytes; one dword permutation restores the order
  const __m256i b =
      _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return amax;
}

// The 24 floats of eight windows as three loads, de-interleaved with blends and lane permutes.
inline void deinterleave3(const float* p, f8& h0, f8& h1, f8& h2) {
  const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8), c = _mm256_loadu_ps(p + 16);
  h0.v = _mm256_permutevar8x32_ps(_mm256_blend_ps(_mm256_blend_ps(a, b, 0x92), c, 0x24),
                                  _mm256_setr_epi32(0, 3, 6, 1, 4, 7, 2, 5));
  h1.v = _mm256_permutevar8x32_ps(_mm256_blend_ps(_mm256_blend_ps(a, b, 0x24), c, 0x49),
                                  _mm256_setr_epi32(1, 4, 7, 2, 5, 0, 3, 6));
  h2.v = _mm256_permutevar8x32_ps(_mm256_blend_ps(_mm256_blend_ps(a, b, 0x49), c, 0x92),
                                  _mm256_setr_epi32(2, 5, 0, 3, 6, 1, 4, 7));
}
// The block moved down one float (three loads at p + 1: reads p[24]) with x blended into every
// third lane.
inline void shift_in3(float* p, f8 x) {
  const __m256 a1 = _mm256_loadu_ps(p + 1), b1 = _mm256_loadu_ps(p + 9);
  const __m256 c1 = _mm256_loadu_ps(p + 17);
  const __m256 xa = _mm256_permutevar8x32_ps(x.v, _mm256_setr_epi32(0, 0, 0, 0, 0, 1, 0, 0));
  const __m256 xb = _mm256_permutevar8x32_ps(x.v, _mm256_setr_epi32(2, 0, 0, 3, 0, 0, 4, 0));
  const __m256 xc = _mm256_permutevar8x32_ps(x.v, _mm256_setr_epi32(0, 5, 0, 0, 6, 0, 0, 7));
  _mm256_storeu_ps(p, _mm256_blend_ps(a1, xa, 0x24));
  _mm256_storeu_ps(p + 8, _mm256_blend_ps(b1, xb, 0x49));
  _mm256_storeu_ps(p + 16, _mm256_blend_ps(c1, xc, 0x92));
}

// ---- vec and vd: the widest registers ----
#if defined(HS_AVX512)
constexpr int kLanes = 16;
constexpr int kLanesD = 8;
using vec = __m512;
using vd = __m512d;
inline vec zero() { return _mm512_setzero_ps(); }
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec bcast(float x) { return _mm512_set1_ps(x); }
inline void bcast_pair(const void* p, vec& lo, vec& hi) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  const __m512i pair = _mm512_set1_epi32(bits);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
inline vec load_w(const float* p) { return _mm512_loadu_ps(p); }
inline vec load_w(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void load_w2(const float* p, vec& lo, vec& hi) {
  lo = _mm512_loadu_ps(p);
  hi = _mm512_loadu_ps(p + 16);
}
inline void load_w2(const c10::BFloat16* p, vec& lo, vec& hi) {  // 16 pairs: p[2i] low half
  const __m512i pairs = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
inline void load_w2_n(const c10::BFloat16* p, int n, vec& lo, vec& hi) {  // n pairs, masked
  const __m512i pairs = _mm512_maskz_loadu_epi32(__mmask16((1u << n) - 1u), p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
inline float hsum(vec v) {  // halves first, then simd.h's 8-lane tree
  return hsum(f8{_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))});
}
inline vd zero_d() { return _mm512_setzero_pd(); }
inline vd load_d(const double* p) { return _mm512_loadu_pd(p); }
inline void store_d(double* p, vd v) { _mm512_storeu_pd(p, v); }
inline vd bcast_d(double x) { return _mm512_set1_pd(x); }
inline vd add(vd a, vd b) { return _mm512_add_pd(a, b); }
inline vd mul(vd a, vd b) { return _mm512_mul_pd(a, b); }
inline vd fma(vd a, vd b, vd c) { return _mm512_fmadd_pd(a, b, c); }
inline vd fnma(vd a, vd b, vd c) { return _mm512_fnmadd_pd(a, b, c); }

// ---- ivec and bvec: 512-bit ----
struct ivec {
  __m512i v;
};
struct bvec {
  __m512i v;
};
inline ivec zero_i() { return {_mm512_setzero_si512()}; }
inline ivec load_i(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
inline bvec load_b(const int8_t* p) { return {_mm512_loadu_si512(p)}; }
inline bvec bcast4(const int8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return {_mm512_set1_epi32(bits)};
}
inline vec to_vec(ivec a) { return _mm512_cvtepi32_ps(a.v); }
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
#if defined(HS_VNNI_EVEX)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
inline ivec dot_acc(ivec acc, bvec w, bvec a) {  // |w| times a with w's signs
  const __mmask64 neg = _mm512_movepi8_mask(w.v);
  const __m512i a_signed = _mm512_mask_sub_epi8(a.v, neg, _mm512_setzero_si512(), a.v);
  return {dpbusd(acc.v, _mm512_abs_epi8(w.v), a_signed)};
}
inline ivec dotu_acc(ivec acc, bvec u, bvec s) { return {dpbusd(acc.v, u.v, s.v)}; }
inline bvec flip(bvec a) { return {_mm512_xor_si512(a.v, _mm512_set1_epi8(int8_t(0x80)))}; }
inline bvec nib_lo(bvec a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
inline bvec nib_hi(bvec a) {
  return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))};
}

#if defined(HS_BF16)
// ---- bpairs: 16 bf16 pairs for vdpbf16ps ----
struct bpairs {
  __m512i v;
};
inline bpairs load_pairs(const c10::BFloat16* p) { return {_mm512_loadu_si512(p)}; }
inline bpairs load_pairs_n(const c10::BFloat16* p, int n) {
  return {_mm512_maskz_loadu_epi32(__mmask16((1u << n) - 1u), p)};
}
inline bpairs bcast_bpair(const c10::BFloat16* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return {_mm512_set1_epi32(bits)};
}
inline vec dot_pairs(vec acc, bpairs a, bpairs b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a.v), reinterpret_cast<__m512bh&>(b.v));
}
#endif
#else
constexpr int kLanes = 8;
constexpr int kLanesD = 4;
using vec = __m256;
using vd = __m256d;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec bcast(float x) { return _mm256_set1_ps(x); }
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
inline void load_w2(const float* p, vec& lo, vec& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load_w2(const c10::BFloat16* p, vec& lo, vec& hi) {  // 8 pairs: p[2i] low half
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline void load_w2_n(const c10::BFloat16* p, int n, vec& lo, vec& hi) {  // n pairs, masked
  const __m256i keep =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i pairs = _mm256_maskload_epi32(reinterpret_cast<const int*>(p), keep);
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline float hsum(vec v) { return hsum(f8{v}); }
inline vd zero_d() { return _mm256_setzero_pd(); }
inline vd load_d(const double* p) { return _mm256_loadu_pd(p); }
inline void store_d(double* p, vd v) { _mm256_storeu_pd(p, v); }
inline vd bcast_d(double x) { return _mm256_set1_pd(x); }
inline vd add(vd a, vd b) { return _mm256_add_pd(a, b); }
inline vd mul(vd a, vd b) { return _mm256_mul_pd(a, b); }
inline vd fma(vd a, vd b, vd c) { return _mm256_fmadd_pd(a, b, c); }
inline vd fnma(vd a, vd b, vd c) { return _mm256_fnmadd_pd(a, b, c); }

// ---- ivec and bvec: the 256-bit i32x8 and b32 ----
using ivec = i32x8;
using bvec = b32;
inline ivec zero_i() { return {_mm256_setzero_si256()}; }
inline ivec load_i(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))};
}
inline bvec load_b(const int8_t* p) { return load32(p); }
inline bvec bcast4(const int8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return {_mm256_set1_epi32(bits)};
}
inline vec to_vec(ivec a) { return _mm256_cvtepi32_ps(a.v); }
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(HS_VNNI_EVEX)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(HS_VNNI_VEX)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline ivec dot_acc(ivec acc, bvec w, bvec a) {  // |w| times a with w's signs
  return {dpbusd(acc.v, _mm256_sign_epi8(w.v, w.v), _mm256_sign_epi8(a.v, w.v))};
}
inline ivec dotu_acc(ivec acc, bvec u, bvec s) { return {dpbusd(acc.v, u.v, s.v)}; }
inline bvec flip(bvec a) { return {_mm256_xor_si256(a.v, _mm256_set1_epi8(int8_t(0x80)))}; }
inline bvec nib_lo(bvec a) { return {_mm256_and_si256(a.v, _mm256_set1_epi8(0x0F))}; }
inline bvec nib_hi(bvec a) {
  return {_mm256_and_si256(_mm256_srli_epi16(a.v, 4), _mm256_set1_epi8(0x0F))};
}
#endif

#if defined(HS_VNNI_EVEX) || defined(HS_VNNI_VEX)
constexpr bool kDotU8 = true;  // vpdpbusd: u8 times s8 summed straight into int32
#else
constexpr bool kDotU8 = false;  // maddubs: a pair of u8 * s8 products saturates past int16
#endif

}  // namespace hs::simd
