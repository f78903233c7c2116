// CPU kernels for the decode step, registered as torch ops `hybrid_serve::*`.
//
// Built at first use by kernels/cpp_build.py (torch.utils.cpp_extension.load, -O3 -march=native).
// Each op has a pure-torch reference in kernels/*.py with the same meaning; see the Python
// wrappers (kernels/*_cpp.py) for the contracts. Every op takes contiguous tensors; the
// wrappers make them so.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HS_AVX2 1
#endif

namespace {

// ---- gated delta rule, recurrent form on the state pool, in place -----------------------------

// Rows whose slot is negative, or repeats a slot of an earlier row, are padding: they read and
// write nothing (zero output). A repeated slot can only be the reserved padding slot 0; skipping
// it keeps two threads from updating one state at once.
std::vector<int64_t> live_slots(const at::Tensor& indices) {
  const int64_t B = indices.size(0);
  const int64_t* idx = indices.data_ptr<int64_t>();
  std::vector<int64_t> slots(idx, idx + B);
  for (int64_t b = 0; b < B; ++b) {
    if (slots[b] < 0) continue;
    for (int64_t p = 0; p < b; ++p) {
      if (slots[p] == slots[b]) {
        slots[b] = -1;
        break;
      }
    }
  }
  return slots;
}

// Normalised (optionally) and scaled copy of one K-vector.
inline void load_qk(const float* src, float* dst, int64_t K, bool l2norm, float scale) {
  float mult = scale;
  if (l2norm) {
    float ss = 0.f;
    for (int64_t i = 0; i < K; ++i) ss += src[i] * src[i];
    mult *= 1.f / std::sqrt(ss + 1e-6f);
  }
  for (int64_t i = 0; i < K; ++i) dst[i] = src[i] * mult;
}

// q, k [B,T,H,K]; v [B,T,HV,V]; g, beta [B,T,HV] (all fp32); pool [S,HV,K,V] fp32 (in place);
// indices [B] int64. Returns o [B,T,HV,V] fp32. Per (row, value head), token by token:
//   S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q
at::Tensor gdr_recurrent_pool(const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta, at::Tensor pool,
                                 const at::Tensor& indices, double scale, bool l2norm) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && g.is_contiguous() &&
                  beta.is_contiguous() && pool.is_contiguous() && indices.is_contiguous(),
              "gdr_recurrent_pool: contiguous inputs expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && pool.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat &&
                  beta.scalar_type() == at::kFloat && indices.scalar_type() == at::kLong,
              "gdr_recurrent_pool: fp32 tensors and int64 indices expected");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3), S = pool.size(0);
  TORCH_CHECK(pool.size(1) == HV && pool.size(2) == K && pool.size(3) == V, "pool shape");
  TORCH_CHECK(HV % H == 0 && indices.size(0) == B, "head ratio / indices");
  const int64_t ratio = HV / H;
  auto out = at::zeros({B, T, HV, V}, q.options());
  const std::vector<int64_t> slots = live_slots(indices);
  for (int64_t s : slots) TORCH_CHECK(s < S, "slot ", s, " out of range for a pool of ", S);

  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *pp = pool.data_ptr<float>(), *op = out.data_ptr<float>();

  at::parallel_for(0, B * HV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(K), ks(K), delta(V), acc(V);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / HV, hv = job % HV, hk = hv / ratio;
      if (slots[b] < 0) continue;
      float* state = pp + (slots[b] * HV + hv) * K * V;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t qk_off = ((b * T + t) * H + hk) * K;
        const int64_t vh = (b * T + t) * HV + hv;
        load_qk(qp + qk_off, qs.data(), K, l2norm, static_cast<float>(scale));
        load_qk(kp + qk_off, ks.data(), K, l2norm, 1.f);
        const float decay = std::exp(gp[vh]), bt = bp[vh];
        const float* vt = vp + vh * V;
        // pass 1: decay the state, predicted = S^T k
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = 0; i < K; ++i) {
          float* row = state + i * V;
          const float ki = ks[i];
          for (int64_t j = 0; j < V; ++j) {
            row[j] *= decay;
            acc[j] += ki * row[j];
          }
        }
        for (int64_t j = 0; j < V; ++j) delta[j] = (vt[j] - acc[j]) * bt;
        // pass 2 (state still in cache): S += k delta^T, o = S^T q
        float* o = op + vh * V;
        for (int64_t i = 0; i < K; ++i) {
          float* row = state + i * V;
          const float ki = ks[i], qi = qs[i];
          for (int64_t j = 0; j < V; ++j) {
            row[j] += ki * delta[j];
            o[j] += qi * row[j];
          }
        }
      }
    }
  });
  return out;
}

// ---- causal conv1d, one decode step on the state pool, in place ---------------------------

// x [B,D] fp32; conv_state [S,D,W-1] fp32 (in place); weight [D,W] fp32; indices [B] int64.
// Returns silu(conv) [B,D] (or the plain conv when silu is false). Padding rows as above.
at::Tensor conv1d_update_pool(const at::Tensor& x, at::Tensor conv_state,
                                 const at::Tensor& weight, const at::Tensor& indices,
                                 bool silu) {
  TORCH_CHECK(x.is_contiguous() && conv_state.is_contiguous() && weight.is_contiguous() &&
                  indices.is_contiguous(),
              "conv1d_update_pool: contiguous inputs expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && conv_state.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat && indices.scalar_type() == at::kLong,
              "conv1d_update_pool: fp32 tensors and int64 indices expected");
  const int64_t B = x.size(0), D = x.size(1), W = weight.size(1), S = conv_state.size(0);
  TORCH_CHECK(conv_state.size(1) == D && conv_state.size(2) == W - 1 && weight.size(0) == D,
              "conv1d_update_pool: shapes");
  auto out = at::zeros({B, D}, x.options());
  const std::vector<int64_t> slots = live_slots(indices);
  for (int64_t s : slots) TORCH_CHECK(s < S, "slot ", s, " out of range for a pool of ", S);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = conv_state.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (slots[b] < 0) continue;
      float* st = sp + slots[b] * D * (W - 1);
      for (int64_t c = 0; c < D; ++c) {
        float* h = st + c * (W - 1);
        const float* w = wp + c * W;
        const float xc = xp[b * D + c];
        float y = w[W - 1] * xc;
        for (int64_t j = 0; j < W - 1; ++j) y += w[j] * h[j];
        for (int64_t j = 0; j + 1 < W - 1; ++j) h[j] = h[j + 1];
        h[W - 2] = xc;
        op[b * D + c] = silu ? y / (1.f + std::exp(-y)) : y;
      }
    }
  });
  return out;
}

// ---- weight-streaming GEMV / skinny GEMM ---------------------------------------------------

template <typename W>
inline float load1(const W* p);
template <>
inline float load1<float>(const float* p) {
  return *p;
}
template <>
inline float load1<at::BFloat16>(const at::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[0]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef HS_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// y[m, n] = sum_k x[m, k] w[n, k] for M rows of x (M <= MAXM): each weight row is read once
// from memory and used for all M rows while it is in registers / L1.
template <typename W, int M>
void gemv_rows(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    int64_t k = 0;
    float tail[M] = {};
#ifdef HS_AVX2
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = load8(wr + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) tail[m] = hsum(acc[m]);
#endif
    for (; k < K; ++k) {
      const float wk = load1(wr + k);
      for (int m = 0; m < M; ++m) tail[m] += wk * x[m * K + k];
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = tail[m];
  }
}

template <typename W>
void gemv_dispatch(int64_t M, const float* x, const W* w, float* y, int64_t N, int64_t K,
                   int64_t n0, int64_t n1) {
  switch (M) {
    case 1: return gemv_rows<W, 1>(x, w, y, N, K, n0, n1);
    case 2: return gemv_rows<W, 2>(x, w, y, N, K, n0, n1);
    case 3: return gemv_rows<W, 3>(x, w, y, N, K, n0, n1);
    case 4: return gemv_rows<W, 4>(x, w, y, N, K, n0, n1);
    case 5: return gemv_rows<W, 5>(x, w, y, N, K, n0, n1);
    case 6: return gemv_rows<W, 6>(x, w, y, N, K, n0, n1);
    case 7: return gemv_rows<W, 7>(x, w, y, N, K, n0, n1);
    default: return gemv_rows<W, 8>(x, w, y, N, K, n0, n1);
  }
}

// Rows of x in blocks of 8 against a block of weight rows small enough to stay in L1/L2 (about
// 16 KB), so each weight row comes from memory once for any M.
template <typename W>
void skinny_range(int64_t M, const float* x, const W* w, float* y, int64_t N, int64_t K,
                  int64_t n0, int64_t n1) {
  const int64_t nb = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K * sizeof(W)));
  for (int64_t b0 = n0; b0 < n1; b0 += nb) {
    const int64_t b1 = std::min(n1, b0 + nb);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      gemv_dispatch(std::min<int64_t>(8, M - m0), x + m0 * K, w, y + m0 * N, N, K, b0, b1);
    }
  }
}

// x [M,K] fp32, w [N,K] fp32 or bf16 -> y [M,N] fp32, accumulated in fp32.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: contiguous inputs");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "skinny_linear: fp32 activations expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: shapes");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // grain: about 64 KB of weights per task, so small matrices stay on one thread
  const int64_t grain =
      std::max<int64_t>(16, (1 << 16) / std::max<int64_t>(1, K * w.element_size()));
  if (w.scalar_type() == at::kFloat) {
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, N, grain,
                     [&](int64_t n0, int64_t n1) { skinny_range(M, xp, wp, yp, N, K, n0, n1); });
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "skinny_linear: fp32 or bf16 weights");
    const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
    at::parallel_for(0, N, grain,
                     [&](int64_t n0, int64_t n1) { skinny_range(M, xp, wp, yp, N, K, n0, n1); });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(hybrid_serve, m) {
  m.def("gdr_recurrent_pool(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, "
        "Tensor indices, float scale, bool l2norm) -> Tensor");
  m.def("conv1d_update_pool(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor indices, "
        "bool silu) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("gdr_recurrent_pool", &gdr_recurrent_pool);
  m.impl("conv1d_update_pool", &conv1d_update_pool);
  m.impl("skinny_linear", &skinny_linear);
}
