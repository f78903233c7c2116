"""The kernel switches: one typed object, the only place kernels/ reads the environment.

- `HYBRID_SERVE_KERNELS` picks the backend: `auto` (the default: Triton for CUDA, the C++ kernels
  on CPU where they build, else the torch references), `triton` (Triton everywhere, on CPU
  tensors in triton's interpreter), `cpp` (the C++ kernels on CPU, an error where they do not
  build), `torch` (the references; also the way to serve where the C++ build fails).
- `HYBRID_SERVE_FUSIONS=off` keeps the fused decode ops (residual add + RMSNorm, the
  multi-weight GEMV, the Gated DeltaNet, Mamba2, attention and MoE decode blocks) on their
  compositions of the unfused kernels, so a benchmark can compare the fusions alone.
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
CPU_LEVEL_ENV = "HYBRID_SERVE_CPU_LEVEL"
CACHE_ENV = "HYBRID_SERVE_KERNEL_CACHE"
DEFAULT_CACHE = "~/.cache/hybrid-serve/kernels"


@dataclass(frozen=True)
class KernelSettings:
    backend: str = "auto"
    fusions: bool = True
    cpu_level: str = "auto"
    cache_dir: str = DEFAULT_CACHE

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"{KERNELS_ENV}={self.backend!r}; expected one of {', '.join(BACKENDS)}"
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
            cpu_level=env.get(CPU_LEVEL_ENV, "auto").strip() or "auto",
            cache_dir=env.get(CACHE_ENV, "").strip() or DEFAULT_CACHE,
        )
