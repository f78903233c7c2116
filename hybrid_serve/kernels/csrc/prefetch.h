// Software prefetch of a block of memory spread over the steps of the work that runs meanwhile.
// On the 2-core Xeons these kernels are measured on, one core's hardware prefetchers keep too
// few lines in flight for a stream to reach the memory's speed, and runs shorter than a few KB
// (a state fetched beside another) get little from them at all. The kernel asking for its next
// block a few cache lines per step keeps the loads ahead of it: delta_rule.h (the next
// recurrent state).
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace hs {

// `rows` rows of `row_bytes` bytes from `base` (row stride `stride` bytes) into L2, over `steps`
// calls of step(), in address order. Default-constructed, step() does nothing.
struct Fetch {
  const char* base = nullptr;
  int64_t stride = 0, lines_per_row = 0, line = 0, end = 0, per = 0;

  Fetch(const void* base_, int64_t rows, int64_t row_bytes, int64_t stride_, int64_t steps)
      : base(static_cast<const char*>(base_)), stride(stride_),
        lines_per_row((row_bytes + 63) / 64), end(rows * lines_per_row),
        per((end + steps - 1) / std::max<int64_t>(1, steps)) {}
  Fetch() = default;

  void step() {
    for (const int64_t stop = std::min(end, line + per); line < stop; ++line)
      simd::prefetch_l2(base + line / lines_per_row * stride + line % lines_per_row * 64);
  }
};

}  // namespace hs
