// simd.h's vocabulary on aarch64: NEON (every AArch64 CPU) and, where the level has it, the
// dot-product extension (sdot) for the integer dot. Included by simd.h only; the contracts and
// the scalar reference of each entry are there.
#pragma once

#include <arm_neon.h>

namespace hs::simd {

constexpr bool kVector = true;

// ---- f8, i32x8, b32: two 128-bit registers each ----
struct f8 {
  float32x4_t lo, hi;
};
struct i32x8 {
  int32x4_t lo, hi;
};
struct b32 {
  int8x16_t lo, hi;  // elements 0-15, 16-31
};

inline f8 zero8() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
inline f8 load8(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline void store8(float* p, f8 a) {
  vst1q_f32(p, a.lo);
  vst1q_f32(p + 4, a.hi);
}
inline f8 bcast8(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }
inline f8 add(f8 a, f8 b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
inline f8 sub(f8 a, f8 b) { return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
inline f8 mul(f8 a, f8 b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
inline f8 div(f8 a, f8 b) { return {vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)}; }
inline f8 fma(f8 a, f8 b, f8 c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
inline f8 fnma(f8 a, f8 b, f8 c) {
  return {vfmsq_f32(c.lo, a.lo, b.lo), vfmsq_f32(c.hi, a.hi, b.hi)};
}
inline f8 min(f8 a, f8 b) { return {vminq_f32(a.lo, b.lo), vminq_f32(a.hi, b.hi)}; }
inline f8 max(f8 a, f8 b) { return {vmaxq_f32(a.lo, b.lo), vmaxq_f32(a.hi, b.hi)}; }
inline f8 round_even(f8 a) { return {vrndnq_f32(a.lo), vrndnq_f32(a.hi)}; }
inline float32x4_t pow2i4(float32x4_t n) {
  const int32x4_t e = vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127));
  return vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
}
inline f8 pow2i(f8 n) { return {pow2i4(n.lo), pow2i4(n.hi)}; }
inline float hsum4(float32x4_t v) {  // the halving tree: (0 + 2, 1 + 3), then the pair
  const float32x2_t s = vadd_f32(vget_low_f32(v), vget_high_f32(v));
  return vget_lane_f32(s, 0) + vget_lane_f32(s, 1);
}
inline float hsum(f8 a) { return hsum4(vaddq_f32(a.lo, a.hi)); }
inline f8 to_float(i32x8 a) { return {vcvtq_f32_s32(a.lo), vcvtq_f32_s32(a.hi)}; }

inline b32 load32(const int8_t* p) { return {vld1q_s8(p), vld1q_s8(p + 16)}; }
inline void store32(int8_t* p, b32 a) {
  vst1q_s8(p, a.lo);
  vst1q_s8(p + 16, a.hi);
}
inline b32 q4_nibbles(const uint8_t* p) {
  const uint8x16_t b = vld1q_u8(p);
  return {vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F))), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))};
}
inline b32 q4_unpack(const uint8_t* p) {
  const b32 n = q4_nibbles(p);
  const int8x16_t eight = vdupq_n_s8(8);
  return {vsubq_s8(n.lo, eight), vsubq_s8(n.hi, eight)};
}
inline int32x4_t dot16(int8x16_t w, int8x16_t a) {  // lane i: bytes 4i..4i+3
#if defined(HS_DOTPROD)
  return vdotq_s32(vdupq_n_s32(0), w, a);
#else
  const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(a)));
  const int32x4_t hi = vpaddlq_s16(vmull_s8(vget_high_s8(w), vget_high_s8(a)));
  return vpaddq_s32(lo, hi);
#endif
}
// int4 tiles: a quad's 8 rows in two registers (rows 0-3, 4-7), each against the quad's
// activations in every lane (nibbles 0..15 read as signed bytes alike).
struct q4x8 {
  int8x16_t quad[8][2];
};
inline q4x8 q4x8_unpack(const uint8_t* p) {
  const uint8x16_t m = vdupq_n_u8(0x0F);
  q4x8 r;
  for (int j = 0; j < 4; ++j)
    for (int h = 0; h < 2; ++h) {
      const uint8x16_t b = vld1q_u8(p + 32 * j + 16 * h);
      r.quad[j][h] = vreinterpretq_s8_u8(vandq_u8(b, m));
      r.quad[j + 4][h] = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
    }
  return r;
}
inline i32x8 q4x8_dot(const q4x8& w, int32_t c, const int8_t* q) {
  int32x4_t lo = vdupq_n_s32(c), hi = vdupq_n_s32(0);
  for (int j = 0; j < 8; ++j) {
    int32_t bits;
    std::memcpy(&bits, q + 4 * j, sizeof bits);
    const int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(bits));
#if defined(HS_DOTPROD)
    lo = vdotq_s32(lo, w.quad[j][0], a);
    hi = vdotq_s32(hi, w.quad[j][1], a);
#else
    lo = vaddq_s32(lo, dot16(w.quad[j][0], a));
    hi = vaddq_s32(hi, dot16(w.quad[j][1], a));
#endif
  }
  return {lo, vaddq_s32(hi, vdupq_n_s32(c))};
}
// int8 tiles: a quad's 8 rows in two registers (rows 0-3, 4-7), each against the quad's
// activations in every lane, signed by signed.
struct q8x8 {
  int8x16_t quad[8][2];
};
inline q8x8 q8x8_load(const int8_t* p) {
  q8x8 r;
  for (int j = 0; j < 8; ++j)
    for (int h = 0; h < 2; ++h) r.quad[j][h] = vld1q_s8(p + 32 * j + 16 * h);
  return r;
}
inline i32x8 q8x8_dot(const q8x8& w, int32_t, const int8_t* q) {
  int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
  for (int j = 0; j < 8; ++j) {
    int32_t bits;
    std::memcpy(&bits, q + 4 * j, sizeof bits);
    const int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(bits));
#if defined(HS_DOTPROD)
    lo = vdotq_s32(lo, w.quad[j][0], a);
    hi = vdotq_s32(hi, w.quad[j][1], a);
#else
    lo = vaddq_s32(lo, dot16(w.quad[j][0], a));
    hi = vaddq_s32(hi, dot16(w.quad[j][1], a));
#endif
  }
  return {lo, hi};
}
inline f8 load8_bf16(const c10::BFloat16* p) {
  const uint16x8_t h = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)),
          vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h), 16))};
}
inline void widen(b32 q, float s, float* out) {
  const float32x4_t sv = vdupq_n_f32(s);
  const auto put = [&](float* o, int16x8_t h) {
    vst1q_f32(o, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), sv));
    vst1q_f32(o + 4, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(h))), sv));
  };
  put(out, vmovl_s8(vget_low_s8(q.lo)));
  put(out + 8, vmovl_s8(vget_high_s8(q.lo)));
  put(out + 16, vmovl_s8(vget_low_s8(q.hi)));
  put(out + 24, vmovl_s8(vget_high_s8(q.hi)));
}
inline float quantize32(const float* x, int8_t* q) {
  float32x4_t v[8], m = vdupq_n_f32(0.f);
  for (int i = 0; i < 8; ++i) {
    v[i] = vld1q_f32(x + 4 * i);
    m = vmaxq_f32(m, vabsq_f32(v[i]));
  }
  const float amax = vmaxvq_f32(m);
  const float32x4_t id = vdupq_n_f32(amax > 0.f ? 127.f / amax : 0.f);
  for (int i = 0; i < 8; i += 2) {  // round to nearest even, narrow: |q| <= 127 fits
    const int16x8_t h = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(v[i], id))),
                                     vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(v[i + 1], id))));
    vst1_s8(q + 4 * i, vqmovn_s16(h));
  }
  return amax;
}

inline void deinterleave3(const float* p, f8& h0, f8& h1, f8& h2) {
  const float32x4x3_t a = vld3q_f32(p), b = vld3q_f32(p + 12);
  h0 = {a.val[0], b.val[0]};
  h1 = {a.val[1], b.val[1]};
  h2 = {a.val[2], b.val[2]};
}
inline void shift_in3(float* p, f8 x) {
  f8 h0, h1, h2;
  deinterleave3(p, h0, h1, h2);
  vst3q_f32(p, float32x4x3_t{{h1.lo, h2.lo, x.lo}});
  vst3q_f32(p + 12, float32x4x3_t{{h1.hi, h2.hi, x.hi}});
}

// ---- vec and vd ----
constexpr int kLanes = 4;
constexpr int kLanesD = 2;
using vec = float32x4_t;
using vd = float64x2_t;
inline vec zero() { return vdupq_n_f32(0.f); }
inline vec load(const float* p) { return vld1q_f32(p); }
inline void store(float* p, vec v) { vst1q_f32(p, v); }
inline vec add(vec a, vec b) { return vaddq_f32(a, b); }
inline vec mul(vec a, vec b) { return vmulq_f32(a, b); }
inline vec fma(vec a, vec b, vec c) { return vfmaq_f32(c, a, b); }
inline vec bcast(float x) { return vdupq_n_f32(x); }
inline void bcast_pair(const void* p, vec& lo, vec& hi) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  const uint32x4_t pair = vdupq_n_u32(bits);
  lo = vreinterpretq_f32_u32(vshlq_n_u32(pair, 16));
  hi = vreinterpretq_f32_u32(vandq_u32(pair, vdupq_n_u32(0xFFFF0000u)));
}
inline vec load_w(const float* p) { return vld1q_f32(p); }
inline vec load_w(const c10::BFloat16* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}
inline void load_w2(const float* p, vec& lo, vec& hi) {
  lo = vld1q_f32(p);
  hi = vld1q_f32(p + 4);
}
inline void load_w2(const c10::BFloat16* p, vec& lo, vec& hi) {  // 4 pairs: p[2i] low half
  const uint32x4_t pairs = vreinterpretq_u32_u16(vld1q_u16(reinterpret_cast<const uint16_t*>(p)));
  lo = vreinterpretq_f32_u32(vshlq_n_u32(pairs, 16));
  hi = vreinterpretq_f32_u32(vandq_u32(pairs, vdupq_n_u32(0xFFFF0000u)));
}
inline void load_w2_n(const c10::BFloat16* p, int n, vec& lo, vec& hi) {  // n pairs
  uint32_t buf[4] = {0u, 0u, 0u, 0u};  // no masked loads: the n pairs through a zeroed copy
  std::memcpy(buf, p, 4 * size_t(n));
  const uint32x4_t pairs = vld1q_u32(buf);
  lo = vreinterpretq_f32_u32(vshlq_n_u32(pairs, 16));
  hi = vreinterpretq_f32_u32(vandq_u32(pairs, vdupq_n_u32(0xFFFF0000u)));
}
inline float hsum(vec v) { return hsum4(v); }
inline vd zero_d() { return vdupq_n_f64(0.0); }
inline vd load_d(const double* p) { return vld1q_f64(p); }
inline void store_d(double* p, vd v) { vst1q_f64(p, v); }
inline vd bcast_d(double x) { return vdupq_n_f64(x); }
inline vd add(vd a, vd b) { return vaddq_f64(a, b); }
inline vd mul(vd a, vd b) { return vmulq_f64(a, b); }
inline vd fma(vd a, vd b, vd c) { return vfmaq_f64(c, a, b); }
inline vd fnma(vd a, vd b, vd c) { return vfmsq_f64(c, a, b); }

// ---- ivec and bvec: one 128-bit register ----
struct ivec {
  int32x4_t v;
};
struct bvec {
  int8x16_t v;
};
constexpr bool kDotU8 = false;  // sdot: unsigned bytes up to 127 read as the same signed ones
inline ivec zero_i() { return {vdupq_n_s32(0)}; }
inline ivec load_i(const int32_t* p) { return {vld1q_s32(p)}; }
inline bvec load_b(const int8_t* p) { return {vld1q_s8(p)}; }
inline bvec bcast4(const int8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return {vreinterpretq_s8_s32(vdupq_n_s32(bits))};
}
inline vec to_vec(ivec a) { return vcvtq_f32_s32(a.v); }
inline ivec dot_acc(ivec acc, bvec w, bvec a) {
#if defined(HS_DOTPROD)
  return {vdotq_s32(acc.v, w.v, a.v)};
#else
  return {vaddq_s32(acc.v, dot16(w.v, a.v))};
#endif
}
inline ivec dotu_acc(ivec acc, bvec u, bvec s) { return dot_acc(acc, u, s); }
inline bvec flip(bvec a) {
  return {vreinterpretq_s8_u8(veorq_u8(vreinterpretq_u8_s8(a.v), vdupq_n_u8(0x80)))};
}
inline bvec nib_lo(bvec a) {
  return {vreinterpretq_s8_u8(vandq_u8(vreinterpretq_u8_s8(a.v), vdupq_n_u8(0x0F)))};
}
inline bvec nib_hi(bvec a) {
  return {vreinterpretq_s8_u8(vshrq_n_u8(vreinterpretq_u8_s8(a.v), 4))};
}

}  // namespace hs::simd
