// The short causal conv's one-token update on a channel-first window, in place, and softplus:
// shared by the fused recurrent decode ops (gdn_decode.cpp, kda_decode.cpp, mamba2_decode.cpp).
// Reference: kernels/causal_conv1d.py `causal_conv1d_update` with silu.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "silu.h"
#include "simd.h"

namespace hs {

// Kernel size 4, channels [c0, c0 + 8) of one row: the 24 window floats (3 per channel)
// de-interleaved, y = w3 x + w0 h0 + w1 h1 + w2 h2 (+ bias) in 8 lanes, and the window shifted
// in place with x as its newest entry (simd.h's shift_in3 may read one float past the block:
// the caller keeps c0 + 8 < D). `wt` holds the weights transposed, [4][D]; `bias` may be null.
inline void conv4_block8(const float* x, float* window, const float* wt, const float* bias,
                         float* y, int64_t D, int64_t c0) {
  namespace v = hs::simd;
  float* h = window + c0 * 3;
  v::f8 h0, h1, h2;
  v::deinterleave3(h, h0, h1, h2);
  const v::f8 xv = v::load8(x + c0);
  v::f8 acc = v::mul(v::load8(wt + 3 * D + c0), xv);
  acc = v::fma(v::load8(wt + c0), h0, acc);
  acc = v::fma(v::load8(wt + D + c0), h1, acc);
  acc = v::fma(v::load8(wt + 2 * D + c0), h2, acc);
  if (bias != nullptr) acc = v::add(acc, v::load8(bias + c0));
  v::store8(y + c0, acc);
  v::shift_in3(h, xv);
}

// One row's conv update: window [D, W-1] shifted in place, y [D] = silu(conv (+ bias)). `wt` is
// the weight transposed, [W][D] (`conv_weight_transposed`); `bias` [D] may be null.
inline void conv_update_row(const float* x, float* window, const float* wt, const float* bias,
                            float* y, int64_t D, int64_t W) {
  int64_t c = 0;
  if (W == 4 && simd::kVector) {  // the kernel size of Qwen3-Next and the Mamba2 families
    for (; c + 8 < D; c += 8) conv4_block8(x, window, wt, bias, y, D, c);
  }
  for (; c < D; ++c) {
    float* h = window + c * (W - 1);
    float acc = wt[(W - 1) * D + c] * x[c];
    for (int64_t j = 0; j < W - 1; ++j) acc = simd::madd(wt[j * D + c], h[j], acc);
    for (int64_t j = 0; j + 1 < W - 1; ++j) h[j] = h[j + 1];
    h[W - 2] = x[c];
    y[c] = bias != nullptr ? acc + bias[c] : acc;
  }
  silu_inplace(y, D);
}

// `conv_update_row` over the rows of a decode batch, in parallel: row b's first D columns of
// x [T, row] on the window of its slot in `windows` [slots, D, W-1], into act [T, D]; rows whose
// slot is negative (padding, pool_slots.h) are skipped.
inline void conv_update_rows(const float* x, int64_t row, float* windows, const float* wt,
                             const std::vector<int64_t>& slots, float* act, int64_t D,
                             int64_t W) {
  at::parallel_for(0, int64_t(slots.size()), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (slots[b] < 0) continue;
      conv_update_row(x + b * row, windows + slots[b] * D * (W - 1), wt, nullptr, act + b * D, D,
                      W);
    }
  });
}

// The conv weight [D, W] transposed, [W][D].
inline std::vector<float> conv_weight_transposed(const at::Tensor& conv_weight) {
  const int64_t D = conv_weight.size(0), W = conv_weight.size(1);
  std::vector<float> wt(W * D);
  const float* cwp = conv_weight.data_ptr<float>();
  for (int64_t c = 0; c < D; ++c) {
    for (int64_t j = 0; j < W; ++j) wt[j * D + c] = cwp[c * W + j];
  }
  return wt;
}

// torch's softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

}  // namespace hs
