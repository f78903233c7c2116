// The gated delta rule on the recurrent-state pool, in place: the recurrent form (one token or a
// few per row: decode and verify) and the prefill's varlen form over packed sequences, which
// also writes the states at tracked offsets for the prefix cache. References:
// kernels/gated_delta_rule.py (`fused_recurrent_gated_delta_rule`, `chunk_gated_delta_rule`);
// wrappers and contracts: kernels/cpp_ops.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "delta_rule.h"
#include "decode_ops.h"
#include "pool_slots.h"
#include "simd.h"

namespace {

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

// Whether g is a per-channel gate ([..., HV, K]: one decay per key row of the state) rather than
// a scalar one ([..., HV]), given tokens x value heads and the key dim; an error for any other.
bool per_channel_gate(const at::Tensor& g, int64_t tokens_heads, int64_t K, const char* op) {
  TORCH_CHECK(g.numel() == tokens_heads || g.numel() == tokens_heads * K, op,
              ": g must hold one decay per token and value head, or one per key channel too");
  return g.numel() != tokens_heads;
}

}  // namespace

namespace hs {

// q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV] or [B,T,HV,K] (per key channel); beta [B,T,HV]
// (all fp32); pool [S,HV,K,V] fp32 (in place); indices [B] int64. Returns o [B,T,HV,V] fp32.
// Per (row, value head), token by token, with D = diag(exp(g)) (a scalar gate: exp(g) I):
//   S = D S;  S += k (beta (v - S^T k))^T;  o = S^T q
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
  TORCH_CHECK(beta.numel() == B * T * HV, "gdr_recurrent_pool: beta [B, T, HV]");
  const bool channels = per_channel_gate(g, B * T * HV, K, "gdr_recurrent_pool");
  auto out = at::zeros({B, T, HV, V}, q.options());
  const std::vector<int64_t> slots = hs::live_slots(indices, S);

  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *pp = pool.data_ptr<float>(), *op = out.data_ptr<float>();

  at::parallel_for(0, B * HV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(K), ks(K), delta(V), acc(V), decays(channels ? K : 0);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / HV, hv = job % HV, hk = hv / ratio;
      if (slots[b] < 0) continue;
      float* state = pp + (slots[b] * HV + hv) * K * V;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t qk_off = ((b * T + t) * H + hk) * K;
        const int64_t vh = (b * T + t) * HV + hv;
        load_qk(qp + qk_off, qs.data(), K, l2norm, static_cast<float>(scale));
        load_qk(kp + qk_off, ks.data(), K, l2norm, 1.f);
        const float bt = bp[vh];
        const float* vt = vp + vh * V;
        if (channels) {
          for (int64_t i = 0; i < K; ++i) decays[i] = std::exp(gp[vh * K + i]);
          hs::delta_rule_token(state, ks.data(), qs.data(), vt, decays.data(), bt, K, V,
                               acc.data(), delta.data(), op + vh * V);
        } else {
          hs::delta_rule_token(state, ks.data(), qs.data(), vt, std::exp(gp[vh]), bt, K, V,
                               acc.data(), delta.data(), op + vh * V);
        }
      }
    }
  });
  return out;
}

}  // namespace hs

namespace {

// The same update over a packed batch of whole sequences (prefill): each sequence's tokens in
// order on its pool state, in place, computed in double precision. q, k [1,T,H,K]; v [1,T,HV,V];
// g [1,T,HV] or per key channel [1,T,HV,K], beta [1,T,HV] (fp32); pool [S,HV,K,V] fp32;
// cu_seqlens [N+1], indices [N] int64 (distinct live slots); track_offsets, track_indices [N] int64 or empty: where track_offsets[i] > 0 the
// state after that many tokens of sequence i is also copied to pool[track_indices[i]].
// Returns o [1,T,HV,V] fp32.
at::Tensor gdr_varlen_pool(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& g, const at::Tensor& beta, at::Tensor pool,
                           const at::Tensor& cu_seqlens, const at::Tensor& indices,
                           const at::Tensor& track_offsets, const at::Tensor& track_indices,
                           double scale, bool l2norm) {
  const std::initializer_list<const at::Tensor*> fp32 = {&q, &k, &v, &g, &beta, &pool};
  for (const at::Tensor* t : fp32) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat,
                "gdr_varlen_pool: contiguous fp32 tensors expected");
  }
  for (const at::Tensor* t : {&cu_seqlens, &indices, &track_offsets, &track_indices}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong,
                "gdr_varlen_pool: int64 cu_seqlens, indices and tracks expected");
  }
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1, "gdr_varlen_pool: packed [1, T, H, K] inputs");
  const int64_t T = q.size(1), H = q.size(2), K = q.size(3), HV = v.size(2), V = v.size(3);
  const int64_t S = pool.size(0), N = indices.numel();
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(1) == T && beta.numel() == T * HV && HV % H == 0,
              "gdr_varlen_pool: shapes");
  const bool channels = per_channel_gate(g, T * HV, K, "gdr_varlen_pool");
  TORCH_CHECK(pool.size(1) == HV && pool.size(2) == K && pool.size(3) == V, "pool shape");
  TORCH_CHECK(cu_seqlens.numel() == N + 1, "gdr_varlen_pool: one index per sequence");
  const bool tracking = track_offsets.numel() > 0;
  TORCH_CHECK(!tracking || (track_offsets.numel() == N && track_indices.numel() == N),
              "gdr_varlen_pool: one track offset and index per sequence");
  const int64_t *cu = cu_seqlens.data_ptr<int64_t>(), *idx = indices.data_ptr<int64_t>();
  const int64_t* toff = tracking ? track_offsets.data_ptr<int64_t>() : nullptr;
  const int64_t* tidx = tracking ? track_indices.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(cu[0] == 0 && cu[N] == T, "gdr_varlen_pool: cu_seqlens must span the tokens");
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(cu[i + 1] >= cu[i], "gdr_varlen_pool: cu_seqlens must not decrease");
    TORCH_CHECK(idx[i] >= 0 && idx[i] < S, "gdr_varlen_pool: slot ", idx[i], " out of range");
    for (int64_t j = 0; j < i; ++j) {
      TORCH_CHECK(idx[j] != idx[i], "gdr_varlen_pool: slot ", idx[i], " twice");
    }
    if (tracking && toff[i] > 0) {
      TORCH_CHECK(toff[i] <= cu[i + 1] - cu[i] && tidx[i] >= 0 && tidx[i] < S,
                  "gdr_varlen_pool: track offset past the sequence or track slot out of range");
    }
  }
  for (int64_t i = 0; tracking && i < N; ++i) {  // a track slot is written while others run
    for (int64_t j = 0; toff[i] > 0 && j < N; ++j) {
      TORCH_CHECK(tidx[i] != idx[j], "gdr_varlen_pool: track slot ", tidx[i], " is also a "
                  "sequence's slot");
    }
  }
  const int64_t ratio = HV / H;
  auto out = at::empty({1, T, HV, V}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *pp = pool.data_ptr<float>(), *op = out.data_ptr<float>();

  // in double precision: a prompt's tokens run one after another through the state, and fp32
  // round-off along a sequence grows (the judge, transformers' chunked form, rounds
  // differently); the state is rounded to fp32 only where it is stored, the outputs at the end.
  // q, k normalised and scaled once per token and key head, key head major ([H, T, K]: a job
  // streams its head's tokens from contiguous memory):
  // (left uninitialised: every element is written below)
  const std::unique_ptr<double[]> qn(new double[T * H * K]), kn(new double[T * H * K]);
  auto normalise = [K, l2norm](const float* src, double* dst, double scale) {
    double mult = scale;
    if (l2norm) {
      double ss = 0.0;
      for (int64_t c = 0; c < K; ++c) ss += static_cast<double>(src[c]) * src[c];
      mult /= std::sqrt(ss + 1e-6);
    }
    for (int64_t c = 0; c < K; ++c) dst[c] = src[c] * mult;
  };
  at::parallel_for(0, T * H, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t r = b0; r < b1; ++r) {  // r = t * H + h
      const int64_t dst = (r % H * T + r / H) * K;
      normalise(qp + r * K, qn.get() + dst, scale);
      normalise(kp + r * K, kn.get() + dst, 1.0);
    }
  });
  // A per-channel gate's decays exp(g), in double, value head major ([HV, T, K]) likewise
  // (computed once here, not in every block's pass)
  const std::unique_ptr<double[]> dn(channels ? new double[T * HV * K] : nullptr);
  if (channels) {
    at::parallel_for(0, T * HV, 64, [&](int64_t b0, int64_t b1) {
      for (int64_t r = b0; r < b1; ++r) {  // r = t * HV + hv
        double* dst = dn.get() + (r % HV * T + r / HV) * K;
        for (int64_t c = 0; c < K; ++c) dst[c] = std::exp(static_cast<double>(gp[r * K + c]));
      }
    });
  }
  // The state of a (sequence, value head) is split into blocks of kBlock columns, each copied
  // out of the pool into a dense [K, kBlock] double buffer (16 KB at K = 128, zero-padded past
  // V) that stays in L1 through all of the sequence's tokens, one pass over it per token
  // (hs::delta_rule_pass). A job is a whole head (its state read and written as one sequential
  // run of the pool) where there are enough heads to share out, else one block.
  constexpr int kBlock = hs::kBlockCols;
  const int64_t nb = (V + kBlock - 1) / kBlock;
  const int64_t per_job = N * HV >= 4 * at::get_num_threads() ? nb : 1;  // blocks per job
  const int64_t jobs_per_head = nb / per_job;
  at::parallel_for(0, N * HV * jobs_per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> blocks(per_job * K * kBlock);
    double vt[kBlock], ot[kBlock], a[kBlock];
    // blocks [b0, b0 + per_job) of the head's state at `src` <-> the buffers, row by row
    auto load = [&](const float* src, int64_t b0) {
      if (V % kBlock != 0) std::fill(blocks.begin(), blocks.end(), 0.0);  // the padding columns
      for (int64_t r = 0; r < K; ++r)
        for (int64_t b = 0; b < per_job; ++b) {
          const int64_t j0 = (b0 + b) * kBlock, n = std::min<int64_t>(kBlock, V - j0);
          for (int64_t j = 0; j < n; ++j) blocks[(b * K + r) * kBlock + j] = src[r * V + j0 + j];
        }
    };
    auto store_block = [&](float* dst, int64_t b, int64_t j0) {
      const int64_t n = std::min<int64_t>(kBlock, V - j0);
      for (int64_t r = 0; r < K; ++r)
        for (int64_t j = 0; j < n; ++j)
          dst[r * V + j0 + j] = static_cast<float>(blocks[(b * K + r) * kBlock + j]);
    };
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / (HV * jobs_per_head), hv = job / jobs_per_head % HV;
      const int64_t hk = hv / ratio, b0 = job % jobs_per_head * per_job;
      if (cu[i] == cu[i + 1]) continue;
      float* state = pp + (idx[i] * HV + hv) * K * V;
      float* tracked = tracking && toff[i] > 0 ? pp + (tidx[i] * HV + hv) * K * V : nullptr;
      load(state, b0);
      // Whole-head jobs: the next job's state (64 KB at 128 x 128) is fetched into L2 a few
      // lines per token pass, so its load need not wait on memory (short prompts load and
      // store a state every few dozen passes).
      const char* pf = nullptr;  // bytes [pf_done, pf_len) of it are still to fetch
      int64_t pf_done = 0, pf_len = 0, pf_step = 0;
      if (per_job == nb && job + 1 < end) {  // jobs are then (sequence, head) in order
        const int64_t ni = (job + 1) / HV, nhv = (job + 1) % HV;
        pf = reinterpret_cast<const char*>(pp + (idx[ni] * HV + nhv) * K * V);
        pf_len = K * V * int64_t(sizeof(float));
        const int64_t passes = per_job * (cu[i + 1] - cu[i]);  // > 0: empty ones were skipped
        pf_step = (pf_len / 64 + passes - 1) / passes * 64;
      }
      for (int64_t b = 0; b < per_job; ++b) {
        double* block = blocks.data() + b * K * kBlock;
        const int64_t j0 = (b0 + b) * kBlock, n = std::min<int64_t>(kBlock, V - j0);
        std::fill(vt, vt + kBlock, 0.0);
        const double* d0 = channels ? dn.get() + (hv * T + cu[i]) * K : nullptr;
        if (channels) {
          hs::block_dot_rows(block, kn.get() + (hk * T + cu[i]) * K, K,
                             [d0](int64_t c) { return d0[c]; }, a);
        } else {
          hs::block_dot(block, kn.get() + (hk * T + cu[i]) * K, K, a);
        }
        for (int64_t t = cu[i]; t < cu[i + 1]; ++t) {
          const int64_t vh = t * HV + hv, qk = (hk * T + t) * K;
          const int64_t qk_next = t + 1 < cu[i + 1] ? qk + K : qk;
          if (t + 2 < cu[i + 1]) {  // this head's rows of v and o lie HV V floats apart per
            // token: the prefetcher misses them, and a pass is too long for the next load to
            // start early
            hs::simd::prefetch(vp + (vh + 2 * HV) * V + j0);
            hs::simd::prefetch_w(op + (vh + 2 * HV) * V + j0);
          }
          for (int64_t j = 0; j < n; ++j) vt[j] = vp[vh * V + j0 + j];
          if (channels) {
            const double* dt = dn.get() + (hv * T + t) * K;
            hs::delta_rule_pass_channels(block, kn.get() + qk, qn.get() + qk,
                                         kn.get() + qk_next, vt, dt,
                                         t + 1 < cu[i + 1] ? dt + K : dt,
                                         static_cast<double>(bp[vh]), K, a, ot);
          } else {
            hs::delta_rule_pass(block, kn.get() + qk, qn.get() + qk, kn.get() + qk_next, vt,
                                std::exp(static_cast<double>(gp[vh])),
                                static_cast<double>(bp[vh]), K, a, ot);
          }
          for (int64_t j = 0; j < n; ++j) op[vh * V + j0 + j] = static_cast<float>(ot[j]);
          if (tracked != nullptr && t + 1 == cu[i] + toff[i]) store_block(tracked, b, j0);
          for (const int64_t e = std::min(pf_done + pf_step, pf_len); pf_done < e; pf_done += 64)
            hs::simd::prefetch_l2(pf + pf_done);
        }
      }
      for (int64_t b = 0; b < per_job; ++b) store_block(state, b, (b0 + b) * kBlock);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("gdr_recurrent_pool(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, "
        "Tensor indices, float scale, bool l2norm) -> Tensor");
  m.def("gdr_varlen_pool(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, "
        "Tensor cu_seqlens, Tensor indices, Tensor track_offsets, Tensor track_indices, "
        "float scale, bool l2norm) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) {
  m.impl("gdr_recurrent_pool", &hs::gdr_recurrent_pool);
  m.impl("gdr_varlen_pool", &gdr_varlen_pool);
}
