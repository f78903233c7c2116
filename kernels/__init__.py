"""Kernels: each op has a pure-torch reference (`kernels/<family>.py`), a Triton version
(`kernels/<family>_triton.py`) and for some a C++ CPU version (`kernels/<family>_cpp.py`), all
with the same signature. `choose` picks one implementation per op once, when a model is built
(`kernels.kernel_set`); nothing here dispatches per call, and kernels/ imports nothing else of
this project."""

from kernels.kernel_set import KernelSet, choose, reference_set
from kernels.settings import KernelSettings

__all__ = ["KernelSet", "KernelSettings", "choose", "reference_set"]
