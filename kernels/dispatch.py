"""Pick the Triton kernel, the C++ CPU kernel or the pure-torch reference for each call.

`HYBRID_SERVE_KERNELS` chooses (read once per process; each op's choice is then cached per
device type, since it sits on the decode path of every linear layer: a test or benchmark that
changes the variable calls `reset()` afterwards):

- ``auto`` (default): Triton for CUDA tensors when triton imports; on CPU tensors the C++ kernel
  where the op has one and the kernels build (`kernels.cpp_build`), else the torch reference;
- ``triton``: always Triton. On CPU tensors that means Triton's interpreter, which only works
  when ``TRITON_INTERPRET=1`` was set before triton itself was first imported. If triton is not
  imported yet, the first such call sets the variable for the process and imports it; if it was
  already imported for the GPU, the call raises RuntimeError saying so. (The test suite sets the
  variable in `tests/conftest.py` on machines without CUDA.)
- ``cpp``: the C++ kernel for CPU tensors where the op has one (RuntimeError when they cannot be
  built), the torch reference for everything else;
- ``torch``: always the reference.

`HYBRID_SERVE_FUSIONS` (``on`` by default, ``off``): the fused decode ops (`fusion=True`: residual
add + RMSNorm, the Gated DeltaNet decode, the small-batch MoE, the multi-weight GEMV) run their
torch references when ``off``, which compose the unfused kernels, so a benchmark can compare the
fusions alone with every other kernel choice unchanged.

Triton is imported lazily, only when a Triton kernel is about to run, so the CPU path works on
machines where triton is missing or broken. In ``auto`` mode such a machine silently uses torch;
in ``triton`` mode it raises ImportError with the original reason.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "HYBRID_SERVE_KERNELS"
MODES = ("auto", "triton", "cpp", "torch")
FUSIONS_ENV = "HYBRID_SERVE_FUSIONS"

_import_error: list[BaseException] = []  # first failure importing triton, if any
_mode: list[str] = []  # the mode read from ENV_VAR, once
_fusions: list[bool] = []  # FUSIONS_ENV, once
_choices: dict[tuple[str, str], Callable] = {}  # (op name, device type) -> implementation


def reset() -> None:
    """Forget the mode read from `HYBRID_SERVE_KERNELS` and every op's cached choice, so the next
    call reads the variable again (for tests and benchmarks that change it)."""
    _mode.clear()
    _choices.clear()
    _fusions.clear()


def kernel_mode() -> str:
    if _mode:
        return _mode[0]
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}; expected one of {', '.join(MODES)}")
    _mode.append(mode)
    return mode


def fusions_enabled() -> bool:
    """Whether the fused decode ops run their fast kernels (`FUSIONS_ENV`, read once)."""
    if not _fusions:
        value = os.environ.get(FUSIONS_ENV, "on").strip().lower() or "on"
        if value not in ("on", "off", "1", "0"):
            raise ValueError(f"{FUSIONS_ENV}={value!r}; expected on or off")
        _fusions.append(value in ("on", "1"))
    return _fusions[0]


def triton_available() -> bool:
    """True when `import triton` succeeds (tried once per process)."""
    if _import_error:
        return False
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken install can raise more than ImportError
        _import_error.append(e)
        logger.info("triton unavailable, using torch kernels: %s", e)
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """Whether a call whose main input is `x` runs the Triton kernel."""
    mode = kernel_mode()
    if mode in ("torch", "cpp"):
        return False
    if mode == "auto":
        return x.is_cuda and triton_available()
    if not x.is_cuda and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
    if not triton_available():
        reason = _import_error[0] if _import_error else None
        raise ImportError(f"{ENV_VAR}=triton but triton cannot be imported") from reason
    return True


def use_cpp(x: torch.Tensor) -> bool:
    """Whether a call whose main input is `x` runs the C++ kernel (for ops that have one)."""
    mode = kernel_mode()
    if mode not in ("auto", "cpp") or x.device.type != "cpu":
        return False
    from kernels import cpp_build

    if cpp_build.available():
        return True
    if mode == "cpp":
        raise RuntimeError(f"{ENV_VAR}=cpp but the C++ kernels cannot be built") from (
            cpp_build.load_error()
        )
    return False


def interpreter_ready() -> bool:
    """True when triton was imported in interpreter mode (its own helpers such as `tl.sum` are
    then interpreted functions), so kernels can run on CPU tensors."""
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


def triton_module(name: str, device: torch.device) -> ModuleType:
    """Import `kernels.<name>` (a Triton module) for use on `device`, in interpreter mode if
    `device` is not CUDA (see the module docstring). Every Triton module records whether its
    kernels were defined for the interpreter in its `INTERPRETED` attribute."""
    interpret = device.type != "cuda"
    full_name = f"kernels.{name}"
    if interpret and full_name not in sys.modules:
        if "triton" in sys.modules and not interpreter_ready():
            raise RuntimeError(_NO_INTERPRETER.format(device=device))
        os.environ["TRITON_INTERPRET"] = "1"  # our kernels are defined at import
    module = importlib.import_module(full_name)
    if interpret and not (module.INTERPRETED and interpreter_ready()):
        raise RuntimeError(_NO_INTERPRETER.format(device=device))
    return module


_NO_INTERPRETER = (
    "Triton kernels on {device} tensors need triton's interpreter, but triton (or the kernel "
    "module) was imported without TRITON_INTERPRET=1; set it before anything imports triton"
)


def dispatching(
    reference: Callable,
    module: str | None,
    cpp_module: str | None = None,
    fusion: bool = False,
) -> Callable:
    """Wrap a torch reference op so that each call runs the same-named function of Triton
    module `kernels.<module>` instead when `use_triton` says so for its first tensor argument,
    or that of C++ wrapper module `kernels.<cpp_module>` when `use_cpp` does. The choice is made
    at an op's first call per device type and cached (`reset()` forgets it). Arguments are
    passed through unchanged: all implementations share the signature. A `fusion` op runs its
    reference while `fusions_enabled()` is False."""
    first = next(iter(inspect.signature(reference).parameters))
    name = reference.__name__
    key = f"{reference.__module__}.{name}"

    def choose(x: torch.Tensor) -> Callable:
        if fusion and not fusions_enabled():
            return reference
        if module is not None and use_triton(x):
            return getattr(triton_module(module, x.device), name)
        if cpp_module is not None and use_cpp(x):
            return getattr(importlib.import_module(f"kernels.{cpp_module}"), name)
        return reference

    @functools.wraps(reference)
    def run(*args, **kwargs):
        x = args[0] if args else kwargs[first]
        impl = _choices.get((key, x.device.type))
        if impl is None:
            impl = _choices[(key, x.device.type)] = choose(x)
        return impl(*args, **kwargs)

    return run
