// The `hybrid_serve` op library: every other file adds its ops with TORCH_LIBRARY_FRAGMENT, and
// each op's contract is in that file and in its Python wrapper (kernels/*_cpp.py), beside a
// pure-torch reference with the same meaning. Built by kernels/cpp_build.py at the CPU's ISA
// level (kernels/cpu_levels.py); `features` names what simd.h compiled to at that level.

#include <torch/library.h>

#include <string>

#include "simd.h"

TORCH_LIBRARY(hybrid_serve, m) {
  m.def("features() -> str", []() -> std::string { return hs::simd::features(); });
}
