// bf16 linear layers on AMX tiles (amx.h), for `--dtype bfloat16` on CPUs with AMX-BF16:
// y [M, N] fp32 = bf16(x) [M, K] w [N, K]^T, w bf16 as stored, fp32 sums. Where it runs (beyond
// the GEMV's rows, kernels/linear_cpp.py and hs::decode_product) it replaces the tiled and
// packed GEMMs, which widen bf16 weights to fp32 and run at the fp32 FMA rate
// (`benchmarks/gemm_shapes.py` times the three side by side).
//
// `amx_ready` is false where the build does not target AMX, where the OS refuses the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process), where HYBRID_SERVE_CPU_AMX=off (read
// once) or after `set_amx(False)` (tests and benchmarks compare the two paths in one process):
// then bf16 weights keep the AVX GEMMs and their fp32 activations.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "amx.h"
#include "decode_ops.h"

#ifdef HS_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifdef HS_AMX
bool env_allows() {
  const char* v = std::getenv("HYBRID_SERVE_CPU_AMX");
  if (v == nullptr) return true;
  std::string s(v);
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s != "off" && s != "0" && s != "false";
}

bool request_tile_state() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

}  // namespace

namespace hs {

namespace {
bool amx_supported() {
#ifdef HS_AMX
  static const bool granted = request_tile_state();
  return granted;
#else
  return false;
#endif
}

std::atomic<bool>& amx_on() {
#ifdef HS_AMX
  static std::atomic<bool> on{env_allows() && amx_supported()};
#else
  static std::atomic<bool> on{false};
#endif
  return on;
}
}  // namespace

bool amx_ready() { return amx_on().load(std::memory_order_relaxed); }

// Turns the AMX products on (where supported) or off; returns whether they are on now.
bool set_amx(bool on) {
  amx_on().store(on && amx_supported());
  return amx_ready();
}

bool amx_linear_fits(const at::Tensor& x, const at::Tensor& w) {
  return w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kFloat && w.dim() == 2 &&
         x.dim() == 2 && x.size(1) == w.size(1) && w.size(1) % 32 == 0 && w.size(0) % 16 == 0 &&
         amx_ready();
}

at::Tensor amx_linear(const at::Tensor& x_, const at::Tensor& w_) {
  TORCH_CHECK(amx_linear_fits(x_, w_), "amx_linear: needs an AMX-BF16 CPU, x [M, K] fp32, "
              "w [N, K] bf16, K % 32 == 0, N % 16 == 0");
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef HS_AMX
  if (M == 0 || K == 0 || N == 0) return y.zero_();
  namespace a = hs::amx;
  const int64_t Mp = a::padded(M);
  const at::Tensor xb_t = at::empty({Mp, K}, w.options());
  auto* xb = xb_t.data_ptr<at::BFloat16>();
  std::memset(xb + M * K, 0, (Mp - M) * K * sizeof(at::BFloat16));  // padding rows, read only
  at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
    a::convert_rows(x.data_ptr<float>() + r0 * K, K, r1 - r0, K, xb + r0 * K);
  });
  const auto* wd = w.data_ptr<at::BFloat16>();
  float* yd = y.data_ptr<float>();
  const int64_t pairs = N / (2 * a::TR) + N % (2 * a::TR) / a::TR;
  at::Tensor xt_t;  // few rows: x in the pair layout, the weights read as stored
  if (a::few(M)) {
    xt_t = at::empty({Mp, K}, w.options());
    a::pack_rows(xb, M, K, xt_t.data_ptr<at::BFloat16>());
  }
  const auto* x_in = a::few(M) ? xt_t.data_ptr<at::BFloat16>() : xb;
  at::parallel_for(0, pairs, 1, [&](int64_t b0, int64_t b1) {
    a::configure();
    a::any_cols(x_in, M, K, wd, yd, N, b0 * 2 * a::TR, std::min(N, b1 * 2 * a::TR));
    a::release();
  });
#endif
  return y;
}

}  // namespace hs

TORCH_LIBRARY_FRAGMENT(hybrid_serve, m) {
  m.def("amx_linear(Tensor x, Tensor w) -> Tensor");
  m.def("amx_available() -> bool", [] { return hs::amx_ready(); });
  m.def("set_amx(bool on) -> bool", [](bool on) { return hs::set_amx(on); });
}

TORCH_LIBRARY_IMPL(hybrid_serve, CPU, m) { m.impl("amx_linear", &hs::amx_linear); }
