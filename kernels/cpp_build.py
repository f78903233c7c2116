"""Build and load the C++ CPU kernels (`kernels/csrc/cpu_kernels.cpp`) once per process.

The source is compiled at first use with torch's extension tooling (`-O3 -march=native`,
OpenMP through ATen's `parallel_for`) and cached under torch's extensions directory
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); later processes load the cached
library in well under a second. The build is keyed by this machine's CPU flags as well, since
`-march=native` code may not run on another CPU sharing the cache. The ops are registered as
`torch.ops.hybrid_serve.*`.

A machine where the build fails (no compiler, no ninja) gets one warning and `load()` returns
None from then on: callers fall back to the torch references.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ops" when loaded, "error" when the build failed


def _cpu_tag() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _ninja_on_path() -> None:
    """torch's build runs `ninja` from PATH; the `ninja` wheel (a dependency) installs it beside
    the interpreter, which is not on PATH when a venv's python is run directly."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load() -> Any | None:
    """`torch.ops.hybrid_serve` with the kernels registered, or None where they cannot be built."""
    ops = _state.get("ops")
    if ops is not None or "error" in _state:
        return ops
    with _lock:
        if "ops" in _state or "error" in _state:
            return _state.get("ops")
        try:
            from torch.utils import cpp_extension

            _ninja_on_path()
            start = time.perf_counter()
            cpp_extension.load(
                name=f"hybrid_serve_cpu_{_cpu_tag()}",
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            logger.info("C++ CPU kernels ready in %.1f s", time.perf_counter() - start)
            _state["ops"] = torch.ops.hybrid_serve
        except Exception as e:  # no compiler, no ninja, a broken toolchain: torch fallback
            _state["error"] = e
            logger.warning("C++ CPU kernels unavailable, using the torch references: %s", e)
    return _state.get("ops")


def available() -> bool:
    return load() is not None


def load_error() -> BaseException | None:
    return _state.get("error")
