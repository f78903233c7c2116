"""The kernel switches: one typed object, the only place kernels/ reads the environment.

- `HYBRID_SERVE_KERNELS` picks the backend: `auto` (the default: Triton for CUDA, the C++ kernels
  on CPU where they build, else the torch references), `triton` (Triton everywhere, on CPU
  tensors in triton's interpreter), `cpp` (the C++ kernels on CPU, an error where they do not
  build), `torch` (the references; also the way to serve where the C++ build fails).
- `HYBRID_SERVE_FUSIONS=off` keeps the fused decode ops (residual add + RMSNorm, the
  multi-weight GEMV, the Gated DeltaNet, Mamba2, attention and MoE decode blocks) on their
  compositions of the unfused kernels, so a benchmark can compare the fusions alone.
- `HYBRID_SERVE_BF16_PRODUCTS`: bf16 matrices (`--dtype bfloat16`, and those the quantized
  modes keep in bf16) multiply activations rounded to bf16 in our bf16 products (exact pair
  products, fp32 accumulation, the result rounded to bf16) instead of widening the weights to
  fp32, at every row count: `auto` (the
  default) where the CPU multiplies bf16 in hardware (avx512_bf16 or AMX:
  `kernels.cpu_levels.multiplies_bf16`), `on` on any CPU (emulated where it has neither), `off`
  never (every product exact on the bf16 weights, as the fp32 mode's).
- `HYBRID_SERVE_CPU_LEVEL` forces the ISA level of the C++ kernels (kernels/cpu_levels.py:
  `generic`, `x86-64-v3`, ..., or `auto`, the best this CPU runs).
- `HYBRID_SERVE_KERNEL_CACHE` is where the compiled libraries live (default
  `~/.cache/hybrid-serve/kernels`; the CPU image prebuilds every x86 level into its own).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

BACKENDS = ("auto", "triton", "cpp", "torch")
KERNELS_ENV = "HYBRID_SERVE_KERNELS"
FUSIONS_ENV = "HYBRID_SERVE_FUSIONS"
BF16_PRODUCTS_ENV = "HYBRID_SERVE_BF16_PRODUCTS"
SWITCHES = ("auto", "on", "off")
CPU_LEVEL_ENV = "HYBRID_SERVE_CPU_LEVEL"
CACHE_ENV = "HYBRID_SERVE_KERNEL_CACHE"
DEFAULT_CACHE = "~/.cache/hybrid-serve/kernels"


@dataclass(frozen=True)
class KernelSettings:
    backend: str = "auto"
    fusions: bool = True
    bf16_products: str = "auto"  # SWITCHES
    cpu_level: str = "auto"
    cache_dir: str = DEFAULT_CACHE

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"{KERNELS_ENV}={self.backend!r}; expected one of {', '.join(BACKENDS)}"
            )
        if self.bf16_products not in SWITCHES:
            raise ValueError(
                f"{BF16_PRODUCTS_ENV}={self.bf16_products!r}; expected one of {', '.join(SWITCHES)}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> KernelSettings:
        backend = env.get(KERNELS_ENV, "auto").strip().lower() or "auto"
        fusions = env.get(FUSIONS_ENV, "on").strip().lower() or "on"
        if fusions not in ("on", "off", "1", "0"):
            raise ValueError(f"{FUSIONS_ENV}={fusions!r}; expected on or off")
        return cls(
            backend=backend,
            fusions=fusions in ("on", "1"),
            bf16_products=env.get(BF16_PRODUCTS_ENV, "auto").strip().lower() or "auto",
            cpu_level=env.get(CPU_LEVEL_ENV, "auto").strip() or "auto",
            cache_dir=env.get(CACHE_ENV, "").strip() or DEFAULT_CACHE,
        )
