// Slot conventions of the state pools, shared by the kernels that update them in place.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace hs {

// Rows whose slot is negative, or repeats a slot of an earlier row, are padding: they read and
// write nothing (zero output). A repeated slot can only be the reserved padding slot 0; skipping
// it keeps two threads from updating one state at once. Checks live slots against the pool size.
inline std::vector<int64_t> live_slots(const at::Tensor& indices, int64_t pool_size) {
  const int64_t B = indices.size(0);
  const int64_t* idx = indices.data_ptr<int64_t>();
  std::vector<int64_t> slots(idx, idx + B);
  for (int64_t b = 0; b < B; ++b) {
    if (slots[b] < 0) continue;
    TORCH_CHECK(slots[b] < pool_size, "slot ", slots[b], " out of range for a pool of ",
                pool_size);
    for (int64_t p = 0; p < b; ++p) {
      if (slots[p] == slots[b]) {
        slots[b] = -1;
        break;
      }
    }
  }
  return slots;
}

}  // namespace hs
