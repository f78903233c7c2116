// Dot products summed in 8 lanes (vectorised by the compiler), then the tail, then the lanes:
// one fixed order, so every op that norms or scores with it rounds alike.
#pragma once

#include <cstdint>

namespace hs {

inline float dot8(const float* a, const float* b, int64_t n) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < 8; ++l) s += lanes[l];
  return s;
}

}  // namespace hs
