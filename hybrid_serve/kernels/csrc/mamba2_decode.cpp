// The Mamba2 decode step after its input projection, one op per layer, in place on the layer's
// conv window and SSM state (reference and contract: kernels/mamba2_step.py `mamba2_decode`);
// and its speculative-verify form, a few tokens per request in order, keeping each state
// (`mamba2_verify`).
//
//   z | xBC | dt = zxbcdt;   x | B | C = silu(conv1d update of xBC on the window + conv bias)
//   dt = clamp(softplus(dt + dt_bias), lo, hi);   A = -exp(A_log)
//   S = exp(dt A) S + dt x B^T;   y = S C + D x                 (per head h, group h / (H/G))
//   out = norm_weight * g / rms(g) per group of I/G,  g = y * silu(z)     (no norm: out = g)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "conv_update.h"
#include "decode_ops.h"
#include "gated_norm.h"
#include "pool_slots.h"
#include "ssm_update.h"

namespace {

// The layer's shapes and parameters; `act` [T, conv_dim] (silu(conv) per row) and `y` [T, I]
// (the SSM's output per row) are scratch.
struct Mamba2Layer {
  int64_t H, P, N, G, inner, conv_dim, row, W;
  const float *zx, *conv_bias, *A_log, *dt_bias, *D, *norm_w;  // conv_bias, norm_w: may be null
  float *conv, *ssm, *out;
  float eps, dt_lo, dt_hi;
  std::vector<float> wt, act, y;  // the conv weight transposed [W][conv_dim]; scratch

  float* window(int64_t slot) const { return conv + slot * conv_dim * (W - 1); }
  float* state(int64_t slot, int64_t h) const { return ssm + (slot * H + h) * P * N; }

  // Row b's conv on the window of `slot`, shifted in place: act[b] = silu(conv + bias).
  void conv_row(int64_t b, int64_t slot) {
    hs::conv_update_row(zx + b * row + inner, window(slot), wt.data(), conv_bias,
                        act.data() + b * conv_dim, conv_dim, W);
  }

  // Head h of row b on `st`, in place: y[b, h] = S C + D x.
  void head_token(int64_t b, int64_t h, float* st, const float* next) {
    const int64_t g = h / (H / G);
    const float* a = act.data() + b * conv_dim;
    float dt = hs::softplus(zx[b * row + inner + conv_dim + h] + dt_bias[h]);
    dt = std::min(std::max(dt, dt_lo), dt_hi);
    const float decay = std::exp(dt * -std::exp(A_log[h]));
    hs::ssm_token(st, a + h * P, a + inner + g * N, a + inner + (G + g) * N, dt, decay, D[h], P,
                  N, y.data() + b * inner + h * P, next);
  }

  // Group g of row b: out[b] = norm(y * silu(z)) over the group's I/G channels.
  void norm_group(int64_t b, int64_t g) {
    const int64_t gs = inner / G, at = b * inner + g * gs;
    hs::gate_first_rmsnorm_row(y.data() + at, zx + b * row + g * gs,
                               norm_w == nullptr ? nullptr : norm_w + g * gs, out + at, gs, eps);
  }
};

const float* optional_ptr(const std::optional<at::Tensor>& t, int64_t numel, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == numel,
              "mamba2_decode: ", name, ": contiguous fp32 [", numel, "] expected");
  return t->data_ptr<float>();
}

// Checks shared by both ops; the layer with `out` [T, I] allocated (zeros) and scratch sized.
Mamba2Layer mamba2_layer(const at::Tensor& zxbcdt, at::Tensor& conv_state,
                         const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
                         at::Tensor& ssm_state, const at::Tensor& A_log, const at::Tensor& dt_bias,
                         const at::Tensor& D, const std::optional<at::Tensor>& norm_weight,
                         int64_t num_groups, double eps, double dt_min, double dt_max,
                         at::Tensor& out) {
  const std::initializer_list<const at::Tensor*> tensors = {
      &zxbcdt, &conv_state, &conv_weight, &ssm_state, &A_log, &dt_bias, &D};
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat,
                "mamba2_decode: contiguous fp32 tensors expected");
  }
  TORCH_CHECK(ssm_state.dim() == 4 && conv_state.dim() == 3 && zxbcdt.dim() == 2 &&
                  conv_weight.dim() == 2,
              "mamba2_decode: ranks");
  const int64_t T = zxbcdt.size(0), S = ssm_state.size(0), H = ssm_state.size(1);
  const int64_t P = ssm_state.size(2), N = ssm_state.size(3), G = num_groups;
  const int64_t inner = H * P, conv_dim = inner + 2 * G * N, W = conv_weight.size(1);
  TORCH_CHECK(G >= 1 && H % G == 0, "mamba2_decode: ", H, " heads over ", G, " groups");
  TORCH_CHECK(zxbcdt.size(1) == inner + conv_dim + H, "mamba2_decode: zxbcdt width");
  TORCH_CHECK(W >= 2 && conv_weight.size(0) == conv_dim && conv_state.size(0) == S &&
                  conv_state.size(1) == conv_dim && conv_state.size(2) == W - 1,
              "mamba2_decode: conv shapes");
  TORCH_CHECK(A_log.numel() == H && dt_bias.numel() == H && D.numel() == H,
              "mamba2_decode: head parameters");
  out = at::zeros({T, inner}, zxbcdt.options());
  Mamba2Layer L{H, P, N, G, inner, conv_dim, zxbcdt.size(1), W,
                zxbcdt.data_ptr<float>(), optional_ptr(conv_bias, conv_dim, "conv_bias"),
                A_log.data_ptr<float>(), dt_bias.data_ptr<float>(), D.data_ptr<float>(),
                optional_ptr(norm_weight, inner, "norm_weight"), conv_state.data_ptr<float>(),
                ssm_state.data_ptr<float>(), out.data_ptr<float>(), static_cast<float>(eps),
                static_cast<float>(dt_min), static_cast<float>(dt_max),
                hs::conv_weight_transposed(conv_weight), {}, {}};
  L.act.resize(T * conv_dim);
  L.y.resize(T * inner);
  return L;
}

}  // namespace

namespace hs {

at::Tensor mamba2_decode(const at::Tensor& zxbcdt, at::Tensor conv_state,
                         const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
                         at::Tensor ssm_state, const at::Tensor& A_log, const at::Tensor& dt_bias,
                         const at::Tensor& D, const std::optional<at::Tensor>& norm_weight,
                         const at::Tensor& slots_t, int64_t num_groups, double eps,
                         double dt_min, double dt_max) {
  at::Tensor out;
  Mamba2Layer L = mamba2_layer(zxbcdt, conv_state, conv_weight, conv_bias, ssm_state, A_log,
                               dt_bias, D, norm_weight, num_groups, eps, dt_min, dt_max, out);
  TORCH_CHECK(slots_t.is_contiguous() && slots_t.scalar_type() == at::kLong &&
                  slots_t.numel() == zxbcdt.size(0),
              "mamba2_decode: int64 slots, one per row, expected");
  const int64_t T = zxbcdt.size(0), H = L.H, G = L.G;
  const std::vector<int64_t> slots = hs::live_slots(slots_t, ssm_state.size(0));

  at::parallel_for(0, T, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (slots[b] >= 0) L.conv_row(b, slots[b]);
    }
  });
  at::parallel_for(0, T * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / H, h = job % H;
      if (slots[b] < 0) continue;
      const int64_t next_slot = job + 1 < end ? slots[(job + 1) / H] : -1;
      const float* next = next_slot >= 0 ? L.state(next_slot, (job + 1) % H) : nullptr;
      L.head_token(b, h, L.state(slots[b], h), next);
    }
  });
  at::parallel_for(0, T * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      if (slots[job / G] >= 0) L.norm_group(job / G, job % G);
    }
  });
  return out;
}

// Speculative verify: request n's rows [starts[n], starts[n+1]) run in order on its states in
// slot slots[n], each token continuing from the last; after each of its rows but the last, the
// conv window and SSM state are also copied to slot steps[n][j] (steps: [N, width], -1 past a
// request's rows). Reference and contract: kernels/mamba2_step.py `mamba2_verify`.
at::Tensor mamba2_verify(const at::Tensor& zxbcdt, at::Tensor conv_state,
                         const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
                         at::Tensor ssm_state, const at::Tensor& A_log, const at::Tensor& dt_bias,
                         const at::Tensor& D, const std::optional<at::Tensor>& norm_weight,
                         const at::Tensor& slots_t, const at::Tensor& starts_t,
                         const at::Tensor& steps_t, int64_t num_groups, double eps,
                         double dt_min, double dt_max) {
  at::Tensor out;
  Mamba2Layer L = mamba2_layer(zxbcdt, conv_state, conv_weight, conv_bias, ssm_state, A_log,
                               dt_bias, D, norm_weight, num_groups, eps, dt_min, dt_max, out);
  const int64_t N = slots_t.numel(), S = ssm_state.size(0), H = L.H, G = L.G;
  TORCH_CHECK(slots_t.scalar_type() == at::kLong && starts_t.scalar_type() == at::kLong &&
                  steps_t.scalar_type() == at::kLong && slots_t.is_contiguous() &&
                  starts_t.is_contiguous() && steps_t.is_contiguous() &&
                  starts_t.numel() == N + 1 && steps_t.dim() == 2 && steps_t.size(0) == N,
              "mamba2_verify: int64 slots [N], starts [N+1], steps [N, width] expected");
  const int64_t *slots = slots_t.data_ptr<int64_t>(), *starts = starts_t.data_ptr<int64_t>();
  const int64_t *steps = steps_t.data_ptr<int64_t>(), width = steps_t.size(1);
  TORCH_CHECK(starts[0] == 0 && starts[N] == zxbcdt.size(0), "mamba2_verify: starts");
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = starts[n + 1] - starts[n];
    TORCH_CHECK(len >= 1 && len - 1 <= width && slots[n] >= 0 && slots[n] < S,
                "mamba2_verify: rows or slot of request ", n);
    for (int64_t j = 0; j + 1 < len; ++j) {
      TORCH_CHECK(steps[n * width + j] >= 0 && steps[n * width + j] < S, "mamba2_verify: steps");
    }
  }
  const int64_t window = L.conv_dim * (L.W - 1), state = L.P * L.N;
  const auto step_slot = [&](int64_t n, int64_t b) { return steps[n * width + b - starts[n]]; };

  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t b = starts[n]; b < starts[n + 1]; ++b) {
        L.conv_row(b, slots[n]);
        if (b + 1 < starts[n + 1]) {
          std::copy_n(L.window(slots[n]), window, L.window(step_slot(n, b)));
        }
      }
    }
  });
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t n = job / H, h = job % H;
      float* st = L.state(slots[n], h);
      for (int64_t b = starts[n]; b < starts[n + 1]; ++b) {
        L.head_token(b, h, st, nullptr);
        if (b + 1 < starts[n + 1]) std::copy_n(st, state, L.state(step_slot(n, b), h));
      }
    }
  });
  const int64_t T = zxbcdt.size(0);
  at::parallel_for(0, T * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) L.norm_group(job / G, job % G);
  });
  return out;
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("mamba2_decode(Tensor zxbcdt, Tensor(a!) conv_state, Tensor conv_weight, "
        "Tensor? conv_bias, Tensor(b!) ssm_state, Tensor A_log, Tensor dt_bias, Tensor D, "
        "Tensor? norm_weight, Tensor slots, int num_groups, float eps, float dt_min, "
        "float dt_max) -> Tensor");
  m.def("mamba2_verify(Tensor zxbcdt, Tensor(a!) conv_state, Tensor conv_weight, "
        "Tensor? conv_bias, Tensor(b!) ssm_state, Tensor A_log, Tensor dt_bias, Tensor D, "
        "Tensor? norm_weight, Tensor slots, Tensor starts, Tensor steps, int num_groups, "
        "float eps, float dt_min, float dt_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("mamba2_decode", &hs::mamba2_decode);
  m.impl("mamba2_verify", &hs::mamba2_verify);
}
