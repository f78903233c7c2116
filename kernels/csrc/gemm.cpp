// GEMM for the decode batches above the GEMV's 8 rows, and the MoE experts in one call.
//
// y[m, n] = sum_k x[m, k] w[n, k]: fp32 activations, fp32 or bf16 weights (widened in registers),
// fp32 accumulation. The weight keeps its [N, K] row-major layout (no packed copy): a register
// tile of MR rows of x by NR weight rows holds MR * NR 8-wide accumulators along k, summed
// horizontally once per tile. Rows of x come in blocks kept in L2 (all of x at decode sizes) and
// the weight rows in blocks that stay in L2 beside them while every register tile of the x block
// passes over them (the x tile in L1): at decode sizes each weight row comes from memory once per
// call. Threads split the weight rows (at::parallel_for; nested inside another parallel region it
// runs on the calling thread). Each output is summed in the same order whatever M is, so a row's
// result does not depend on the rows beside it. Measured: benchmarks/gemm_shapes.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gemv.h"

namespace {

using hs::load1;

constexpr int MR = 4;  // rows of x per register tile
constexpr int NR = 3;  // weight rows per register tile
constexpr int64_t W_BLOCK_BYTES = 128 << 10;  // weight bytes per cache block
constexpr int64_t X_BLOCK_BYTES = 192 << 10;  // bytes of x per cache block

#ifdef HS_AVX2
// The sums of four 8-wide vectors, in order, as one 4-wide vector.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 s = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

// y[i, j] = x[i, :] . w[j, :] for i < R rows of x and j < C weight rows (R <= MR, C <= NR).
template <typename W, int R, int C>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y, int64_t ldy,
                 int64_t K) {
  float out[R][C];
  int64_t k = 0;
#ifdef HS_AVX2
  __m256 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[C];
    for (int j = 0; j < C; ++j) wv[j] = hs::load8(w + j * ldw + k);
    // keep the loaded vectors in registers: otherwise the compiler reloads them as FMA memory
    // operands (R * C loads per step instead of R + C)
    for (int j = 0; j < C; ++j) asm("" : "+x"(wv[j]));
    for (int i = 0; i < R; ++i) {
      __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      asm("" : "+x"(xv));
      for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  for (int i = 0; i < R; ++i) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = j < C ? acc[i][j] : zero;
    alignas(16) float s[4];
    _mm_store_ps(s, hsum4(v[0], v[1], v[2], v[3]));
    for (int j = 0; j < C; ++j) out[i][j] = s[j];
  }
#else
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) out[i][j] = 0.f;
#endif
  for (; k < K; ++k) {
    float wk[C];
    for (int j = 0; j < C; ++j) wk[j] = load1(w + j * ldw + k);
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) out[i][j] += x[i * ldx + k] * wk[j];
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) y[i * ldy + j] = out[i][j];
}

// One tile of up to MR x NR: the compile-time shape for the rows and columns left.
template <typename W, int R>
inline void tile_cols(int c, const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                      int64_t ldy, int64_t K) {
  static_assert(NR == 3, "tile_cols lists the column counts 1..NR");
  switch (c) {
    case 3: return tile<W, R, 3>(x, ldx, w, ldw, y, ldy, K);
    case 2: return tile<W, R, 2>(x, ldx, w, ldw, y, ldy, K);
    default: return tile<W, R, 1>(x, ldx, w, ldw, y, ldy, K);
  }
}

template <typename W>
inline void any_tile(int r, int c, const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                     int64_t ldy, int64_t K) {
  static_assert(MR == 4, "any_tile lists the row counts 1..MR");
  switch (r) {
    case 4: return tile_cols<W, 4>(c, x, ldx, w, ldw, y, ldy, K);
    case 3: return tile_cols<W, 3>(c, x, ldx, w, ldw, y, ldy, K);
    case 2: return tile_cols<W, 2>(c, x, ldx, w, ldw, y, ldy, K);
    default: return tile_cols<W, 1>(c, x, ldx, w, ldw, y, ldy, K);
  }
}

// Output columns [n0, n1) of y [M, ldy] = x [M, ldx] w[n0:n1, :ldw]^T, on the calling thread:
// a block of rows of x (X_BLOCK_BYTES, kept in L2) meets each block of weight rows
// (W_BLOCK_BYTES, in L2 beside it), which meets every register tile of those rows (in L1).
template <typename W>
void gemm_cols(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y, int64_t ldy,
               int64_t M, int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = std::max<int64_t>(NR, W_BLOCK_BYTES / std::max<int64_t>(1, K * sizeof(W)) / NR * NR);
  const int64_t mb = std::max<int64_t>(MR, X_BLOCK_BYTES / std::max<int64_t>(1, K * 4) / MR * MR);
  for (int64_t mb0 = 0; mb0 < M; mb0 += mb) {
    const int64_t mb1 = std::min(M, mb0 + mb);
    for (int64_t b0 = n0; b0 < n1; b0 += nb) {
      const int64_t b1 = std::min(n1, b0 + nb);
      for (int64_t m = mb0; m < mb1; m += MR) {
        const int r = int(std::min<int64_t>(MR, mb1 - m));
        const float* xm = x + m * ldx;
        int64_t n = b0;
        if (r == MR) {
          for (; n + NR <= b1; n += NR)
            tile<W, MR, NR>(xm, ldx, w + n * ldw, ldw, y + m * ldy + n, ldy, K);
        }
        for (; n < b1; n += NR) {
          const int c = int(std::min<int64_t>(NR, b1 - n));
          any_tile(r, c, xm, ldx, w + n * ldw, ldw, y + m * ldy + n, ldy, K);
        }
      }
    }
  }
}

// y [M, N] = x [M, K] w [N, K]^T, all contiguous, parallel over weight rows.
template <typename W>
void gemm_into(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M == 0 || N == 0) return;
  const int64_t tiles = (N + NR - 1) / NR;
  if (tiles < 2 * at::get_num_threads() && M >= 8 * MR) {  // a few weight rows (a gate): split x
    at::parallel_for(0, (M + MR - 1) / MR, 1, [&](int64_t t0, int64_t t1) {
      const int64_t m0 = t0 * MR, m1 = std::min(M, t1 * MR);
      gemm_cols(x + m0 * K, K, w, K, y + m0 * N, N, m1 - m0, K, 0, N);
    });
    return;
  }
  // at least ~32 KB of weights per task, in whole tiles
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, K * sizeof(W) * NR));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    gemm_cols(x, K, w, K, y, N, M, K, t0 * NR, std::min(N, t1 * NR));
  });
}

// x [M, K] fp32, w [N, K] fp32 or bf16 -> y [M, N] fp32.
at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& w) {
  return hs::linear_op("tiled_linear", x, w,
                       [](const float* xp, auto* wp, float* yp, int64_t M, int64_t N, int64_t K) {
                         gemm_into(xp, wp, yp, M, N, K);
                       });
}

// ---- routed experts in one call ----------------------------------------------------------

// One piece of work: weight rows [n0, n1) of expert e; cost ~ weight bytes + flops.
struct Task {
  int64_t e, n0, n1;
  double cost;
};

// Tasks of at most `rows` weight rows for every expert with tokens, cut into `parts` runs of
// about equal cost (part p runs tasks [bounds[p], bounds[p + 1])).
std::vector<Task> expert_tasks(const std::vector<int64_t>& counts, int64_t N, int64_t K,
                               int64_t rows, int64_t wbytes) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e < int64_t(counts.size()); ++e) {
    if (counts[e] == 0) continue;
    for (int64_t n0 = 0; n0 < N; n0 += rows) {
      const int64_t n1 = std::min(N, n0 + rows);
      // streaming a weight byte costs about as much as ~4 FMAs from cache here
      tasks.push_back({e, n0, n1, double(n1 - n0) * K * (wbytes * 4.0 + counts[e])});
    }
  }
  return tasks;
}

// Runs fn(task) for every task, the tasks split among the threads by cost.
template <typename F>
void run_balanced(const std::vector<Task>& tasks, const F& fn) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<size_t> bounds(parts + 1, tasks.size());
  double total = 0;
  for (const Task& t : tasks) total += t.cost;
  double acc = 0;
  int64_t p = 0;
  bounds[0] = 0;
  for (size_t i = 0; i < tasks.size() && p + 1 < parts; ++i) {
    acc += tasks[i].cost;
    if (acc >= total * double(p + 1) / double(parts)) bounds[++p] = i + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t q = p0; q < p1; ++q)
      for (size_t i = bounds[q]; i < bounds[q + 1]; ++i) fn(tasks[i]);
  });
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// xs [T, H] rows sorted by expert, counts[e] each; gate_up [E, 2I, H]; down [E, H, I].
template <typename W>
void experts_into(const float* xs, const W* gate_up, const W* down, const std::vector<int64_t>& counts,
                  float* h, float* act, float* y, int64_t H, int64_t I) {
  const int64_t E = int64_t(counts.size());
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  const auto rows_for = [](int64_t K) {  // ~32 KB of weights per task, whole tiles
    return std::max<int64_t>(NR, (32 << 10) / std::max<int64_t>(1, K * int64_t(sizeof(W))) / NR * NR);
  };
  // gate and up rows [n0, n1) of an expert, then act = silu(gate) * up on those columns
  run_balanced(expert_tasks(counts, I, 2 * H, rows_for(2 * H), sizeof(W)), [&](const Task& t) {
    const int64_t m0 = start[t.e], M = counts[t.e];
    const W* w = gate_up + t.e * 2 * I * H;
    float* hm = h + m0 * 2 * I;
    gemm_cols(xs + m0 * H, H, w, H, hm, 2 * I, M, H, t.n0, t.n1);
    gemm_cols(xs + m0 * H, H, w + I * H, H, hm + I, 2 * I, M, H, t.n0, t.n1);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = t.n0; n < t.n1; ++n)
        act[(m0 + m) * I + n] = silu(hm[m * 2 * I + n]) * hm[m * 2 * I + I + n];
  });
  run_balanced(expert_tasks(counts, H, I, rows_for(I), sizeof(W)), [&](const Task& t) {
    const int64_t m0 = start[t.e];
    gemm_cols(act + m0 * I, I, down + t.e * H * I, I, y + m0 * H, H, counts[t.e], I, t.n0, t.n1);
  });
}

// xs [T, H] fp32 sorted by expert; gate_up [E, 2I, H], down [E, H, I] (fp32 or bf16, alike);
// counts [E] int64 summing to T -> [T, H] fp32: row t is down_e(silu(gate_e x_t) * up_e x_t)
// for the expert e whose slice holds t.
at::Tensor routed_experts(const at::Tensor& xs, const at::Tensor& gate_up, const at::Tensor& down,
                          const at::Tensor& counts) {
  TORCH_CHECK(xs.is_contiguous() && gate_up.is_contiguous() && down.is_contiguous() &&
                  counts.is_contiguous(),
              "routed_experts: contiguous inputs");
  TORCH_CHECK(xs.scalar_type() == at::kFloat && counts.scalar_type() == at::kLong,
              "routed_experts: fp32 rows and int64 counts expected");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type() &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "routed_experts: fp32 or bf16 weights, both alike");
  TORCH_CHECK(xs.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && counts.dim() == 1,
              "routed_experts: ranks");
  const int64_t T = xs.size(0), H = xs.size(1), E = gate_up.size(0), I = down.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(0) == E &&
                  down.size(1) == H && counts.size(0) == E,
              "routed_experts: shapes");
  const int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<int64_t> cnt(cp, cp + E);
  int64_t sum = 0;
  for (int64_t c : cnt) {
    TORCH_CHECK(c >= 0, "routed_experts: negative count");
    sum += c;
  }
  TORCH_CHECK(sum == T, "routed_experts: counts sum to ", sum, " for ", T, " rows");
  auto y = at::empty({T, H}, xs.options());
  if (T == 0) return y;
  auto h = at::empty({T, 2 * I}, xs.options());
  auto act = at::empty({T, I}, xs.options());
  if (gate_up.scalar_type() == at::kFloat) {
    experts_into(xs.data_ptr<float>(), gate_up.data_ptr<float>(), down.data_ptr<float>(), cnt,
                 h.data_ptr<float>(), act.data_ptr<float>(), y.data_ptr<float>(), H, I);
  } else {
    experts_into(xs.data_ptr<float>(), gate_up.data_ptr<at::BFloat16>(),
                 down.data_ptr<at::BFloat16>(), cnt, h.data_ptr<float>(), act.data_ptr<float>(),
                 y.data_ptr<float>(), H, I);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("tiled_linear(Tensor x, Tensor w) -> Tensor");
  m.def("routed_experts(Tensor xs, Tensor gate_up, Tensor down, Tensor counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("tiled_linear", &tiled_linear);
  m.impl("routed_experts", &routed_experts);
}
