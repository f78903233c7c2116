// The Gated DeltaNet decode step after its projections, one op per layer, in place on the
// layer's conv and recurrent states. Reference and contract: kernels/gdn_decode.py.
//
//   [q | k | v] = silu(conv1d update of qkv on the conv window);  q, k l2-normalised, q * dk^-0.5
//   g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
//   S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q          (per value head, in place)
//   y = norm_weight * (o / rms(o)) * silu(z)                          -> [T, value_dim]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "pool_slots.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GDN_AVX2 1
#endif

namespace {

#ifdef GDN_AVX2
// exp on 8 lanes: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), p a
// degree-6 minimax polynomial: within 2 ulp of expf over [-87, 88].
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// y[i] = y[i] / (1 + exp(-y[i])), in place.
inline void silu_inplace(float* y, int64_t n) {
  int64_t i = 0;
#ifdef GDN_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(y + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
    _mm256_storeu_ps(y + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) y[i] = y[i] / (1.f + std::exp(-y[i]));
}

// One row's conv update: window [D, W-1] shifted in place, y [D] = silu(conv).
inline void conv_row(const float* x, float* window, const float* weight, float* y, int64_t D,
                     int64_t W) {
  if (W == 4) {  // Qwen3-Next's kernel size: the window is 3 floats per channel
    for (int64_t c = 0; c < D; ++c) {
      float* h = window + c * 3;
      const float* w = weight + c * 4;
      const float h0 = h[0], h1 = h[1], h2 = h[2], xc = x[c];
      y[c] = w[3] * xc + w[0] * h0 + w[1] * h1 + w[2] * h2;
      h[0] = h1;
      h[1] = h2;
      h[2] = xc;
    }
  } else {
    for (int64_t c = 0; c < D; ++c) {
      float* h = window + c * (W - 1);
      const float* w = weight + c * W;
      float acc = w[W - 1] * x[c];
      for (int64_t j = 0; j < W - 1; ++j) acc += w[j] * h[j];
      for (int64_t j = 0; j + 1 < W - 1; ++j) h[j] = h[j + 1];
      h[W - 2] = x[c];
      y[c] = acc;
    }
  }
  silu_inplace(y, D);
}

inline float sum_squares(const float* x, int64_t n) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += x[i + l] * x[i + l];
  }
  float ss = 0.f;
  for (; i < n; ++i) ss += x[i] * x[i];
  for (int l = 0; l < 8; ++l) ss += lanes[l];
  return ss;
}

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

at::Tensor gdn_decode(const at::Tensor& qkvz, const at::Tensor& ba, at::Tensor conv_state,
                      const at::Tensor& conv_weight, at::Tensor ssm_state, const at::Tensor& A_log,
                      const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                      const at::Tensor& slots_t, int64_t num_k_heads, double eps) {
  const std::initializer_list<const at::Tensor*> tensors = {
      &qkvz, &ba, &conv_state, &conv_weight, &ssm_state, &A_log, &dt_bias, &norm_weight};
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat,
                "gdn_decode: contiguous fp32 tensors expected");
  }
  TORCH_CHECK(slots_t.is_contiguous() && slots_t.scalar_type() == at::kLong,
              "gdn_decode: int64 slots expected");
  const int64_t T = qkvz.size(0), S = ssm_state.size(0), HV = ssm_state.size(1);
  const int64_t dk = ssm_state.size(2), dv = ssm_state.size(3), H = num_k_heads;
  const int64_t key_dim = H * dk, value_dim = HV * dv, conv_dim = 2 * key_dim + value_dim;
  const int64_t W = conv_weight.size(1);
  TORCH_CHECK(qkvz.dim() == 2 && qkvz.size(1) == conv_dim + value_dim, "gdn_decode: qkvz shape");
  TORCH_CHECK(ba.dim() == 2 && ba.size(0) == T && ba.size(1) == 2 * HV, "gdn_decode: ba shape");
  TORCH_CHECK(conv_state.size(0) == S && conv_state.size(1) == conv_dim &&
                  conv_state.size(2) == W - 1 && conv_weight.size(0) == conv_dim,
              "gdn_decode: conv shapes");
  TORCH_CHECK(HV % H == 0 && A_log.numel() == HV && dt_bias.numel() == HV &&
                  norm_weight.numel() == dv && slots_t.numel() == T,
              "gdn_decode: head shapes");
  const int64_t ratio = HV / H;
  const std::vector<int64_t> slots = hs::live_slots(slots_t, S);
  auto out = at::zeros({T, value_dim}, qkvz.options());
  std::vector<float> act(T * conv_dim);  // silu(conv) of the live rows

  const float *xp = qkvz.data_ptr<float>(), *bap = ba.data_ptr<float>();
  const float *cwp = conv_weight.data_ptr<float>(), *alp = A_log.data_ptr<float>();
  const float *dtp = dt_bias.data_ptr<float>(), *nwp = norm_weight.data_ptr<float>();
  float *csp = conv_state.data_ptr<float>(), *ssp = ssm_state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(dk)), e = static_cast<float>(eps);
  const int64_t row = conv_dim + value_dim;

  at::parallel_for(0, T, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (slots[b] < 0) continue;
      conv_row(xp + b * row, csp + slots[b] * conv_dim * (W - 1), cwp, act.data() + b * conv_dim,
               conv_dim, W);
    }
  });

  at::parallel_for(0, T * HV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(dk), ks(dk), delta(dv), acc(dv), o(dv);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / HV, hv = job % HV, hk = hv / ratio;
      if (slots[b] < 0) continue;
      const float* a_row = act.data() + b * conv_dim;
      const float* qr = a_row + hk * dk;
      const float* kr = a_row + key_dim + hk * dk;
      const float* vr = a_row + 2 * key_dim + hv * dv;
      const float qm = scale / std::sqrt(sum_squares(qr, dk) + 1e-6f);
      const float km = 1.f / std::sqrt(sum_squares(kr, dk) + 1e-6f);
      for (int64_t i = 0; i < dk; ++i) {
        qs[i] = qr[i] * qm;
        ks[i] = kr[i] * km;
      }
      const float bt = 1.f / (1.f + std::exp(-bap[b * 2 * HV + hv]));
      const float g = -std::exp(alp[hv]) * softplus(bap[b * 2 * HV + HV + hv] + dtp[hv]);
      const float decay = std::exp(g);
      float* state = ssp + (slots[b] * HV + hv) * dk * dv;
      // pass 1: decay the state, predicted = S^T k
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        float* srow = state + i * dv;
        const float ki = ks[i];
        for (int64_t j = 0; j < dv; ++j) {
          srow[j] *= decay;
          acc[j] += ki * srow[j];
        }
      }
      for (int64_t j = 0; j < dv; ++j) delta[j] = (vr[j] - acc[j]) * bt;
      // pass 2 (state still in cache): S += k delta^T, o = S^T q
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        float* srow = state + i * dv;
        const float ki = ks[i], qi = qs[i];
        for (int64_t j = 0; j < dv; ++j) {
          srow[j] += ki * delta[j];
          o[j] += qi * srow[j];
        }
      }
      // gated RMSNorm with z
      const float r = 1.f / std::sqrt(sum_squares(o.data(), dv) / static_cast<float>(dv) + e);
      const float* z = xp + b * row + conv_dim + hv * dv;
      float* y = op + b * value_dim + hv * dv;
      for (int64_t j = 0; j < dv; ++j) y[j] = z[j];
      silu_inplace(y, dv);
      for (int64_t j = 0; j < dv; ++j) y[j] = (nwp[j] * (o[j] * r)) * y[j];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("gdn_decode(Tensor qkvz, Tensor ba, Tensor(a!) conv_state, Tensor conv_weight, "
        "Tensor(b!) ssm_state, Tensor A_log, Tensor dt_bias, Tensor norm_weight, Tensor slots, "
        "int num_k_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) { m.impl("gdn_decode", &gdn_decode); }
