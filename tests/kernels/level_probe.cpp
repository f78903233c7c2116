// The numeric cores of kernels/csrc behind a C interface, compiled once per ISA level by
// tests/kernels/test_cpu_levels.py (the flags of kernels/cpu_levels.py) and called through
// ctypes, so one process compares every level this CPU runs with the generic one. Only the
// torch-free headers are included: a level compiles in seconds.

#include <cstdint>

#include "bpanel.h"
#include "gemm.h"
#include "gemv.h"
#include "qgemv.h"
#include "routed_experts.h"
#include "silu.h"
#include "delta_rule.h"
#include "simd.h"

namespace {

// 0 fp32, 1 bf16, 2 int8, 3 int4 (weights.h's formats)
template <typename F>
void with_code(int code, const void* w, const F& fn) {
  switch (code) {
    case 1: return fn(static_cast<const c10::BFloat16*>(w));
    case 2: return fn(static_cast<const int8_t*>(w));
    case 3: return fn(static_cast<const uint8_t*>(w));
    default: return fn(static_cast<const float*>(w));
  }
}

}  // namespace

extern "C" {

const char* probe_features() { return hs::simd::features(); }

// y [M, N] = x [M, K] w [N, K]^T: the GEMV up to 8 rows (the integer GEMV for int8/int4 up to
// the level's kQGemvRows: 64 at AVX-512, 16 at AVX2, 8 with NEON), the tiled GEMM beyond, as hs::linear
// chooses.
void probe_linear(int code, const float* x, const void* w, float* y, int64_t M, int64_t N,
                  int64_t K) {
  with_code(code, w, [&](auto* wp) {
    if (M <= (code >= 2 ? hs::kQGemvRows : 8)) {
      hs::skinny_linear_into(x, wp, y, M, N, K);
    } else {
      hs::tiled::gemm_into(x, wp, y, M, N, K);
    }
  });
}

// y [M, N] = bf16(x) [M, K] w [N, K]^T by the panel product (bpanel.h), w packed in K-pair
// panels (weights.h), at every row count.
void probe_bf16_panels(const float* x, const c10::BFloat16* w, float* y, int64_t M, int64_t N,
                       int64_t K) {
  hs::bpanel::linear_into(x, w, y, M, N, K);
}

// The element index of w[n, k] in a panel-packed N x K matrix (weights.h `bpanel_index`).
int64_t probe_bpanel_index(int64_t N, int64_t K, int64_t n, int64_t k) {
  return hs::bpanel_index(N, K, n, k);
}

// routed_experts.h: xs [T, H] sorted by expert (counts [E]) through the experts gate_up
// [E, 2I, H] and down [E, H, I] of format `code` -> y [T, H].
void probe_routed(int code, const float* xs, const void* gate_up, const void* down,
                  const int64_t* counts, int64_t E, int64_t H, int64_t I, float* y, float limit) {
  static constexpr c10::ScalarType kDtypes[] = {c10::kFloat, c10::kBFloat16, c10::kChar,
                                                c10::kByte};
  hs::routed_experts_rows(xs, gate_up, down, kDtypes[code], counts, E, H, I, y, limit);
}

// routed_experts.h with bf16 experts packed in K-pair panels (the panel product).
void probe_routed_panels(const float* xs, const void* gate_up, const void* down,
                         const int64_t* counts, int64_t E, int64_t H, int64_t I, float* y,
                         float limit) {
  hs::routed_experts_rows(xs, gate_up, down, c10::kBFloat16, counts, E, H, I, y, limit, true);
}

float probe_quantize(const float* x, int64_t n, int8_t* q) { return hs::quantize_block(x, n, q); }

void probe_silu(float* y, int64_t n) { hs::silu_inplace(y, n); }

float probe_exp1(float x) { return hs::simd::exp1(x); }

// Eight windows of three at p: de-interleaved into h [3][8], then shifted in place taking x.
void probe_window(float* p, const float* x, float* h) {
  namespace v = hs::simd;
  v::f8 h0, h1, h2;
  v::deinterleave3(p, h0, h1, h2);
  v::store8(h, h0);
  v::store8(h + 8, h1);
  v::store8(h + 16, h2);
  v::shift_in3(p, v::load8(x));
}

// delta_rule.h's pass over a [dk, 16] double block (a and o [16]: see there).
void probe_delta_pass(double* s, const double* k, const double* q, const double* k_next,
                      const double* v, double decay, double beta, int64_t dk, double* a,
                      double* o) {
  hs::delta_rule_pass(s, k, q, k_next, v, decay, beta, dk, a, o);
}

// The same pass with a per-channel gate: decay, next_decay [dk] (see delta_rule.h).
void probe_delta_pass_channels(double* s, const double* k, const double* q, const double* k_next,
                               const double* v, const double* decay, const double* next_decay,
                               double beta, int64_t dk, double* a, double* o) {
  hs::delta_rule_pass_channels(s, k, q, k_next, v, decay, next_decay, beta, dk, a, o);
}

// delta_rule.h's fp32 token step with one decay per row: state [dk, dv] in place, o [dv]
// written (acc, delta: scratch).
void probe_delta_token_channels(float* state, const float* k, const float* q, const float* v,
                                const float* decays, float beta, int64_t dk, int64_t dv,
                                float* acc, float* delta, float* o) {
  std::fill(o, o + dv, 0.f);
  hs::delta_rule_token(state, k, q, v, decays, beta, dk, dv, acc, delta, o);
}

}  // extern "C"
