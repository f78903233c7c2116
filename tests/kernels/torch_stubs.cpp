// The few libtorch symbols the probe's numeric cores reference (at::parallel_for's bookkeeping
// and TORCH_CHECK's failure path), defined for one thread, so the probe links as a standalone
// executable for an architecture whose libtorch is not here (tests/kernels/test_cpu_levels.py
// runs it under qemu-user).

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/ParallelGuard.h>

#include <cstdio>
#include <cstdlib>

namespace at {
int get_num_threads() { return 1; }
int get_thread_num() { return 0; }
bool in_parallel_region() { return false; }
void init_num_threads() {}
namespace internal {
void set_thread_num(int) {}
}  // namespace internal
}  // namespace at

namespace c10 {
ParallelGuard::ParallelGuard(bool) : previous_state_(false) {}
ParallelGuard::~ParallelGuard() = default;
namespace detail {
[[noreturn]] void torchCheckFail(const char* func, const char* file, unsigned line,
                                 const char* msg) {
  std::fprintf(stderr, "%s:%u %s: %s\n", file, line, func, msg);
  std::abort();
}
}  // namespace detail
}  // namespace c10
