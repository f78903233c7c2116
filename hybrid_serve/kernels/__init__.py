"""Kernels: each op has a pure-torch reference (`kernels/<family>.py`), a Triton version
(`kernels/<family>_triton.py`) and for some a C++ CPU version (`kernels.cpp_ops`,
`kernels.cpp_fused`), all with the same signature. `choose` picks one implementation per op
once, when a model is built (`kernels.kernel_set`); nothing here dispatches per call, and
hybrid_serve/kernels/ imports nothing else of this project. The names below load on first use, so a
torch-free module of the package (`hybrid_serve.kernels.weight_formats`) imports without torch."""

from __future__ import annotations

from typing import Any

__all__ = ["KernelSet", "KernelSettings", "choose", "reference_set"]


def __getattr__(name: str) -> Any:
    if name in ("KernelSet", "choose", "reference_set"):
        from hybrid_serve.kernels import kernel_set

        return getattr(kernel_set, name)
    if name == "KernelSettings":
        from hybrid_serve.kernels.settings import KernelSettings

        return KernelSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
