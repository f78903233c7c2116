// The one home of intrinsics: the vector vocabulary every kernel in kernels/csrc is written in.
//
// The library is compiled once per named ISA level (kernels/cpu_levels.py): generic, x86-64-v3
// (AVX2 + FMA), x86-64-v3-vnni (+ AVX-VNNI), x86-64-v4 (AVX-512), x86-64-v4-vnni (+ AVX512-VNNI),
// x86-64-v4-bf16 (+ AVX512-BF16), sapphirerapids (x86-64-v4-bf16's bodies tuned for Sapphire
// Rapids: nothing here reads its FP16 or AMX macros, no AMX tiles) and, on aarch64, generic
// (NEON) and armv8.2-a+dotprod. This
// header reads the compiler's target macros (the only place in kernels/csrc that does) and
// includes the body of each entry for that target: simd_x86.h, simd_neon.h, or the scalar bodies
// below, which are also every entry's reference (namespace hs::simd::ref, always compiled).
//
// The vocabulary:
// - `vec`: the widest fp32 register (kLanes = 16 with AVX-512, 8 with AVX2, 4 with NEON, 8
//   scalar lanes at generic x86): zero, load, store, add, mul, fma, bcast, bcast_pair (two bf16
//   widened exactly), load_w (kLanes fp32 or bf16 weights), load_w2 (2 kLanes weights in two
//   registers: fp32 as they lie, the first kLanes then the next; bf16 as pairs, lo lane i =
//   p[2i] and hi lane i = p[2i + 1], one load and two integer ops per 2 kLanes), load_w2_n
//   (bf16 pairs as load_w2, only the first n of them read, the lanes past n zero: a masked
//   load at AVX2 and AVX-512, a zeroed copy at NEON), hsum.
//   `kVector` says whether it is a hardware register (a kernel may then prefer a plain loop,
//   which the compiler vectorizes).
// - `f8`: 8 fp32 lanes at every level (the integer products' accumulators, exp, the conv
//   window): zero8, load8, store8, bcast8, add, sub, mul, div, fma, fnma, min, max, round_even,
//   pow2i, hsum, exp (composed below from the others).
// - `b32` / `i32x8`: a block of 32 int8 values and 8 int32 lanes: load32, store32, q4_unpack
//   (16 bytes of int4 nibbles, each - 8), q4_nibbles (the same nibbles as stored, 0..15),
//   to_float, widen; quantize32 (Q8_0's rounding of 32 activations).
// - `q4x8`: one block of an int4 tile (weights.h: 8 weight rows by 32 k, 128 bytes of nibbles)
//   unpacked for the dot: q4x8_unpack (quad j < 4 the low nibbles of bytes [32 j, 32 j + 32),
//   quad j + 4 their high nibbles, byte 4 r + i of quad j holding row r's element 4 j + i as
//   0..15), q4x8_dot (lane r = c + sum over j, i of that nibble times the activation q[4 j + i]:
//   VNNI vpdpbusd or AVX2 maddubs on a broadcast of each quad, NEON sdot, or the scalar body:
//   the same integers), load8_bf16 (8 bf16 widened exactly).
// - `q8x8`: one block of an int8 tile (weights.h: 8 weight rows by 32 k, 256 bytes, byte
//   32 j + 4 r + i row r's element 4 j + i): q8x8_load, q8x8_dot (lane r = the exact sum over
//   j, i of that byte times the activation q[4 j + i]; `sum` is the 32 activations' sum, which
//   the VNNI bodies need: they offset the weights by 128 to make them unsigned for vpdpbusd and
//   start the lanes at -128 sum; AVX2 maddubs with the signs moved to the activations, NEON
//   sdot, or the scalar body: the same integers). A q8x8 is 8 registers of 256 bits (16 of 128
//   bits with NEON): the GEMV's passes hold one beside kQPassRows accumulators (qgemv.h).
// - `ivec` / `bvec`: the widest integer register as kLanes int32 lanes / 4 kLanes bytes (the
//   tiled integer GEMM's, qgemm.h): zero_i, load_i, load_b, bcast4 (4 bytes into every lane),
//   dot_acc (lane i += the exact sum of bytes 4i..4i+3's signed products), dotu_acc (the same
//   with the first operand's bytes unsigned), to_vec (exact below 2^24). `kDotU8` says whether
//   dotu_acc takes the whole u8 range (one VNNI vpdpbusd; the scalar body); without it (AVX2
//   maddubs pairs, NEON sdot) the unsigned bytes must lie in [0, 127]. flip (each byte + 128
//   mod 256: int8 weights as unsigned bytes for dotu_acc), nib_lo / nib_hi (each byte's low /
//   high nibble, 0..15: int4 weights read from their tiles).
// - `bpairs`: kLanes pairs of bf16 values (k and k + 1) as the bf16 dot takes them (the bf16
//   panel product's, bpanel.h): load_pairs (kLanes pairs), load_pairs_n
//   (the first n pairs, 1 <= n <= kLanes, lanes past n zero, nothing past them read),
//   bcast_bpair (one pair into every lane),
//   dot_pairs (acc lane i + a's pair i times b's, both products exact in fp32: one
//   `vdpbf16ps` where the level has AVX512-BF16 (its two adds in its own order, denormal
//   inputs read as zero), else the pair widened exactly and two FMAs, even element first).
// - `vd`: the widest fp64 register (kLanesD): zero_d, load_d, store_d, bcast_d, add, mul, fma,
//   fnma.
// - deinterleave3 / shift_in3: eight channels' windows of 3 floats ([c][3] interleaved).
// - prefetch (into L1), prefetch_l2, prefetch_w (for a write); madd (a * b + c as GCC rounds
//   `y += a * b` at the level: fused at every vector level).
//
// Contracts. `fma` rounds once at every level (the scalar body is std::fma), `hsum` adds the
// lanes as a halving tree (lanes i and i + n/2, then again), whatever the width. So every
// composition of entries gives the same bits at every level: the integer products (qgemv.h) and
// the tiled GEMM (gemm.h) are bit-identical across levels, generic included. The fp32/bf16 GEMV
// (gemv.h) runs its lanes along k, so its last bits depend on kLanes (a different summation
// order, never a different result within one level). Preconditions: `q8x8_dot` takes weights
// in [-127, 127] and activations in [-127, 127] (AVX2's maddubs pairs then never saturate); so
// does `dot_acc`; `dotu_acc` takes unsigned bytes as above and signed ones in [-127, 127].
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#define HS_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define HS_AVX512 1
#endif
#if defined(HS_AVX512) && defined(__AVX512BF16__)
#define HS_BF16 1
#endif
#if defined(HS_AVX512) && defined(__AVX512VNNI__)
#define HS_VNNI_EVEX 1
#elif defined(__AVXVNNI__)
#define HS_VNNI_VEX 1
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define HS_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define HS_DOTPROD 1
#endif
#endif

namespace hs::simd {

// The features this build's vocabulary uses, for the start-up log and the level tests.
inline const char* features() {
#if defined(HS_AVX512) && defined(HS_VNNI_EVEX) && defined(HS_BF16)
  return "avx512 avx512-vnni avx512-bf16";
#elif defined(HS_AVX512) && defined(HS_VNNI_EVEX)
  return "avx512 avx512-vnni";
#elif defined(HS_AVX512)
  return "avx512";
#elif defined(HS_VNNI_VEX)
  return "avx2 fma avx-vnni";
#elif defined(HS_AVX2)
  return "avx2 fma";
#elif defined(HS_DOTPROD)
  return "neon dotprod";
#elif defined(HS_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

// a * b + c rounded once, at every level.
inline float fma1(float a, float b, float c) { return std::fma(a, b, c); }

// The scalar bodies: the generic level's vocabulary and every entry's reference.
namespace ref {

template <typename T, int N>
struct lanes {
  T v[N];
};
using f8 = lanes<float, 8>;
using i32x8 = lanes<int32_t, 8>;
using b32 = lanes<int8_t, 32>;
using vd = lanes<double, 4>;

template <typename T, int N, typename F>
inline lanes<T, N> map(const F& f) {
  lanes<T, N> r;
  for (int i = 0; i < N; ++i) r.v[i] = f(i);
  return r;
}

template <typename T, int N>
inline lanes<T, N> add(lanes<T, N> a, lanes<T, N> b) {
  return map<T, N>([&](int i) { return a.v[i] + b.v[i]; });
}
template <typename T, int N>
inline lanes<T, N> sub(lanes<T, N> a, lanes<T, N> b) {
  return map<T, N>([&](int i) { return a.v[i] - b.v[i]; });
}
template <typename T, int N>
inline lanes<T, N> mul(lanes<T, N> a, lanes<T, N> b) {
  return map<T, N>([&](int i) { return a.v[i] * b.v[i]; });
}
template <typename T, int N>
inline lanes<T, N> div(lanes<T, N> a, lanes<T, N> b) {
  return map<T, N>([&](int i) { return a.v[i] / b.v[i]; });
}
template <typename T, int N>  // a * b + c, rounded once
inline lanes<T, N> fma(lanes<T, N> a, lanes<T, N> b, lanes<T, N> c) {
  return map<T, N>([&](int i) { return std::fma(a.v[i], b.v[i], c.v[i]); });
}
template <typename T, int N>  // c - a * b, rounded once
inline lanes<T, N> fnma(lanes<T, N> a, lanes<T, N> b, lanes<T, N> c) {
  return map<T, N>([&](int i) { return std::fma(-a.v[i], b.v[i], c.v[i]); });
}
template <typename T, int N>
inline lanes<T, N> min(lanes<T, N> a, lanes<T, N> b) {
  return map<T, N>([&](int i) { return a.v[i] < b.v[i] ? a.v[i] : b.v[i]; });
}
template <typename T, int N>
inline lanes<T, N> max(lanes<T, N> a, lanes<T, N> b) {
  return map<T, N>([&](int i) { return a.v[i] > b.v[i] ? a.v[i] : b.v[i]; });
}
template <typename T, int N>
inline lanes<T, N> splat(T x) {
  return map<T, N>([&](int) { return x; });
}
template <typename T, int N>
inline lanes<T, N> load_n(const T* p) {
  return map<T, N>([&](int i) { return p[i]; });
}
template <typename T, int N>
inline void store_n(T* p, lanes<T, N> a) {
  std::copy(a.v, a.v + N, p);
}
template <typename T, int N>  // the halving tree: lanes i and i + N/2 first
inline T hsum(lanes<T, N> a) {
  for (int n = N / 2; n >= 1; n /= 2)
    for (int i = 0; i < n; ++i) a.v[i] = a.v[i] + a.v[i + n];
  return a.v[0];
}

template <int N>  // to the nearest integer, ties to even (the default rounding mode)
inline lanes<float, N> round_even(lanes<float, N> a) {
  return map<float, N>([&](int i) { return std::nearbyint(a.v[i]); });
}
template <int N>  // 2^n for integral n in [-126, 127]
inline lanes<float, N> pow2i(lanes<float, N> n) {
  return map<float, N>([&](int i) {
    const uint32_t bits = uint32_t(int32_t(n.v[i]) + 127) << 23;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  });
}
inline f8 to_float(i32x8 a) {
  return map<float, 8>([&](int i) { return float(a.v[i]); });
}
inline b32 load32(const int8_t* p) { return load_n<int8_t, 32>(p); }
inline void store32(int8_t* p, b32 a) { store_n(p, a); }
inline b32 q4_nibbles(const uint8_t* p) {  // byte j: element j low nibble, j + 16 high
  return map<int8_t, 32>([&](int i) { return int8_t(i < 16 ? p[i] & 15 : p[i - 16] >> 4); });
}
inline b32 q4_unpack(const uint8_t* p) {  // q4_nibbles, each - 8
  return map<int8_t, 32>([&](int i) {
    return int8_t(i < 16 ? int(p[i] & 15) - 8 : int(p[i - 16] >> 4) - 8);
  });
}
inline void widen(b32 q, float s, float* out) {  // out[j] = q[j] * s
  for (int j = 0; j < 32; ++j) out[j] = float(q.v[j]) * s;
}
struct q4x8 {
  b32 quad[8];
};
inline q4x8 q4x8_unpack(const uint8_t* p) {
  q4x8 r;
  for (int j = 0; j < 8; ++j)
    for (int t = 0; t < 32; ++t)
      r.quad[j].v[t] = int8_t(j < 4 ? p[32 * j + t] & 15 : p[32 * (j - 4) + t] >> 4);
  return r;
}
inline i32x8 q4x8_dot(const q4x8& w, int32_t c, const int8_t* q) {
  return map<int32_t, 8>([&](int r) {
    int32_t s = c;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) s += int32_t(w.quad[j].v[4 * r + i]) * int32_t(q[4 * j + i]);
    return s;
  });
}
inline f8 load8_bf16(const c10::BFloat16* p) {
  return map<float, 8>([&](int i) { return float(p[i]); });
}
struct q8x8 {
  b32 quad[8];
};
inline q8x8 q8x8_load(const int8_t* p) {
  q8x8 r;
  for (int j = 0; j < 8; ++j) r.quad[j] = load32(p + 32 * j);
  return r;
}
inline i32x8 q8x8_dot(const q8x8& w, int32_t, const int8_t* q) {
  return map<int32_t, 8>([&](int r) {
    int32_t s = 0;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) s += int32_t(w.quad[j].v[4 * r + i]) * int32_t(q[4 * j + i]);
    return s;
  });
}
template <int N>
inline lanes<int8_t, N> flip(lanes<int8_t, N> a) {
  return map<int8_t, N>([&](int i) { return int8_t(uint8_t(a.v[i]) ^ 0x80u); });
}
template <int N>
inline lanes<int8_t, N> nib_lo(lanes<int8_t, N> a) {
  return map<int8_t, N>([&](int i) { return int8_t(uint8_t(a.v[i]) & 15); });
}
template <int N>
inline lanes<int8_t, N> nib_hi(lanes<int8_t, N> a) {
  return map<int8_t, N>([&](int i) { return int8_t(uint8_t(a.v[i]) >> 4); });
}
template <int N>  // the 4 bytes at p in each of N int32 lanes
inline lanes<int8_t, 4 * N> bcast4(const int8_t* p) {
  return map<int8_t, 4 * N>([&](int i) { return p[i % 4]; });
}
template <int N>  // lane i += sum_t w[4i + t] a[4i + t], signed bytes
inline lanes<int32_t, N> dot_acc(lanes<int32_t, N> acc, lanes<int8_t, 4 * N> w,
                                 lanes<int8_t, 4 * N> a) {
  return map<int32_t, N>([&](int i) {
    int32_t s = acc.v[i];
    for (int j = 4 * i; j < 4 * i + 4; ++j) s += int32_t(w.v[j]) * int32_t(a.v[j]);
    return s;
  });
}
template <int N>  // lane i += sum_t u[4i + t] s[4i + t], u's bytes read unsigned
inline lanes<int32_t, N> dotu_acc(lanes<int32_t, N> acc, lanes<int8_t, 4 * N> u,
                                  lanes<int8_t, 4 * N> s) {
  return map<int32_t, N>([&](int i) {
    int32_t t = acc.v[i];
    for (int j = 4 * i; j < 4 * i + 4; ++j) t += int32_t(uint8_t(u.v[j])) * int32_t(s.v[j]);
    return t;
  });
}
template <int N>
inline lanes<float, N> to_vec(lanes<int32_t, N> a) {
  return map<float, N>([&](int i) { return float(a.v[i]); });
}
// Q8_0's rounding of 32 values: q[j] = round_even(x[j] * (127 / max |x|)); returns max |x|.
inline float quantize32(const float* x, int8_t* q) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int j = 0; j < 32; ++j) q[j] = int8_t(std::nearbyint(x[j] * id));
  return amax;
}
// p[3i + j] -> h_j lane i, for eight channels' windows of three.
inline void deinterleave3(const float* p, f8& h0, f8& h1, f8& h2) {
  for (int i = 0; i < 8; ++i) {
    h0.v[i] = p[3 * i];
    h1.v[i] = p[3 * i + 1];
    h2.v[i] = p[3 * i + 2];
  }
}
// Each channel's window moves down one and takes x as its newest entry:
// p[3i] = p[3i + 1], p[3i + 1] = p[3i + 2], p[3i + 2] = x_i. The SIMD bodies may read p[24].
inline void shift_in3(float* p, f8 x) {
  for (int i = 0; i < 8; ++i) {
    p[3 * i] = p[3 * i + 1];
    p[3 * i + 1] = p[3 * i + 2];
    p[3 * i + 2] = x.v[i];
  }
}

}  // namespace ref

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
inline void prefetch_w(const void* p) { __builtin_prefetch(p, 1, 3); }  // for a write

}  // namespace hs::simd

#if defined(HS_AVX2)
#include "simd_x86.h"
#elif defined(HS_NEON)
#include "simd_neon.h"
#else
namespace hs::simd {
constexpr bool kVector = false;
constexpr int kLanes = 8;  // the AVX2 build's blocking
constexpr int kLanesD = 4;
using vec = ref::lanes<float, kLanes>;
using f8 = ref::f8;
using i32x8 = ref::i32x8;
using b32 = ref::b32;
using vd = ref::vd;
using ref::add, ref::sub, ref::mul, ref::div, ref::fma, ref::fnma, ref::min, ref::max;
using ref::deinterleave3, ref::hsum, ref::load32;
using ref::pow2i, ref::q4_nibbles, ref::q4x8, ref::q4x8_dot, ref::q4x8_unpack, ref::load8_bf16;
using ref::q8x8, ref::q8x8_dot, ref::q8x8_load;
using ref::q4_unpack, ref::store32;
using ref::quantize32, ref::round_even, ref::shift_in3, ref::to_float, ref::widen;
inline vec zero() { return ref::splat<float, kLanes>(0.f); }
inline vec load(const float* p) { return ref::load_n<float, kLanes>(p); }
inline void store(float* p, vec v) { ref::store_n(p, v); }
inline vec bcast(float x) { return ref::splat<float, kLanes>(x); }
inline vec load_w(const float* p) { return load(p); }
inline vec load_w(const c10::BFloat16* p) {
  return ref::map<float, kLanes>([&](int i) { return float(p[i]); });
}
inline void load_w2(const float* p, vec& lo, vec& hi) {
  lo = load(p);
  hi = load(p + kLanes);
}
inline void load_w2(const c10::BFloat16* p, vec& lo, vec& hi) {
  lo = ref::map<float, kLanes>([&](int i) { return float(p[2 * i]); });
  hi = ref::map<float, kLanes>([&](int i) { return float(p[2 * i + 1]); });
}
inline void load_w2_n(const c10::BFloat16* p, int n, vec& lo, vec& hi) {
  lo = ref::map<float, kLanes>([&](int i) { return i < n ? float(p[2 * i]) : 0.f; });
  hi = ref::map<float, kLanes>([&](int i) { return i < n ? float(p[2 * i + 1]) : 0.f; });
}
inline void bcast_pair(const void* p, vec& lo, vec& hi) {
  const auto* b = static_cast<const c10::BFloat16*>(p);
  lo = bcast(float(b[0]));
  hi = bcast(float(b[1]));
}
inline f8 zero8() { return ref::splat<float, 8>(0.f); }
inline f8 load8(const float* p) { return ref::load_n<float, 8>(p); }
inline void store8(float* p, f8 v) { ref::store_n(p, v); }
inline f8 bcast8(float x) { return ref::splat<float, 8>(x); }
inline vd zero_d() { return ref::splat<double, kLanesD>(0.0); }
inline vd load_d(const double* p) { return ref::load_n<double, kLanesD>(p); }
inline void store_d(double* p, vd v) { ref::store_n(p, v); }
inline vd bcast_d(double x) { return ref::splat<double, kLanesD>(x); }
using ivec = ref::lanes<int32_t, kLanes>;
using bvec = ref::lanes<int8_t, 4 * kLanes>;
constexpr bool kDotU8 = true;
using ref::dot_acc, ref::dotu_acc, ref::to_vec;
inline ivec zero_i() { return ref::splat<int32_t, kLanes>(0); }
inline ivec load_i(const int32_t* p) { return ref::load_n<int32_t, kLanes>(p); }
inline bvec load_b(const int8_t* p) { return ref::load_n<int8_t, 4 * kLanes>(p); }
inline bvec bcast4(const int8_t* p) { return ref::bcast4<kLanes>(p); }
inline bvec flip(bvec a) { return ref::flip(a); }
inline bvec nib_lo(bvec a) { return ref::nib_lo(a); }
inline bvec nib_hi(bvec a) { return ref::nib_hi(a); }
}  // namespace hs::simd
#endif

namespace hs::simd {

#if !defined(HS_BF16)  // (simd_x86.h has them in vdpbf16ps's form)
struct bpairs {
  vec lo, hi;  // the even and the odd elements, widened
};
inline bpairs load_pairs(const c10::BFloat16* p) {
  bpairs r;
  load_w2(p, r.lo, r.hi);
  return r;
}
inline bpairs load_pairs_n(const c10::BFloat16* p, int n) {
  bpairs r;
  load_w2_n(p, n, r.lo, r.hi);
  return r;
}
inline bpairs bcast_bpair(const c10::BFloat16* p) {
  bpairs r;
  bcast_pair(p, r.lo, r.hi);
  return r;
}
inline vec dot_pairs(vec acc, bpairs a, bpairs b) {
  return fma(a.hi, b.hi, fma(a.lo, b.lo, acc));
}
#endif

// dst = src (n floats) for data the caller will not read again soon: where the level has
// streaming stores and dst is aligned for them, written past the caches (no read of dst's lines
// first, no lines evicted from what the caller still works on), else std::copy. The values
// stored are the same either way.
inline void stream_copy(const float* src, float* dst, int64_t n) {
#if defined(HS_AVX512) || defined(HS_AVX2)
  if (reinterpret_cast<std::uintptr_t>(dst) % (kLanes * sizeof(float)) == 0) {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
#if defined(HS_AVX512)
      _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#else
      _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
    }
    std::copy(src + i, src + n, dst + i);
    _mm_sfence();  // the streamed lines are visible before the caller goes on
    return;
  }
#endif
  std::copy(src, src + n, dst);
}

// a * b + c in one rounding where the level has an FMA instruction (every vector level), two at
// generic x86: what GCC makes of `y += a * b` at each level, for a plain loop that must round as
// a vectorized one beside it does.
inline float madd(float a, float b, float c) {
  if constexpr (kVector) return std::fma(a, b, c);
  return a * b + c;
}

// exp: 2^n p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), p a degree-6
// minimax polynomial: within 2 ulp of expf over [-87, 88]; inputs are clamped there. One body
// for f8 and for the scalar lanes of `exp1`, so a value's exp does not depend on its lane.
template <typename V, typename Splat>
inline V exp_poly(V x, const Splat& b) {
  x = min(max(x, b(-87.3f)), b(88.3f));
  const V n = round_even(mul(x, b(1.44269504088896341f)));
  V r = fnma(n, b(0.693359375f), x);
  r = fnma(n, b(-2.12194440e-4f), r);
  V p = b(1.9875691500e-4f);
  p = fma(p, r, b(1.3981999507e-3f));
  p = fma(p, r, b(8.3334519073e-3f));
  p = fma(p, r, b(4.1665795894e-2f));
  p = fma(p, r, b(1.6666665459e-1f));
  p = fma(p, r, b(5.0000001201e-1f));
  p = fma(p, mul(r, r), add(r, b(1.f)));
  return mul(p, pow2i(n));
}

inline f8 exp(f8 x) { return exp_poly(x, bcast8); }

inline float exp1(float x) {
  using one = ref::lanes<float, 1>;
  return exp_poly(one{{x}}, [](float s) { return one{{s}}; }).v[0];
}

}  // namespace hs::simd
