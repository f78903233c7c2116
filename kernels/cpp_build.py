"""Build and load the C++ CPU kernels (every `kernels/csrc/*.cpp`) once per process.

The sources are compiled into one library at first use with torch's extension tooling (`-O3
-march=native`, OpenMP through ATen's `parallel_for`) and cached under torch's extensions directory
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); later processes load the cached
library in well under a second. The build is named by a hash of the sources and this machine's
CPU flags (`-march=native` code may not run on another CPU sharing the cache), so checkouts with
different sources never rebuild each other's copy. A build lock left by a process killed while
compiling (torch's builder would wait on it forever) is removed once it is older than
`STALE_LOCK_S`. The ops are registered as `torch.ops.hybrid_serve.*`.

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

CSRC = Path(__file__).parent / "csrc"


def sources() -> list[Path]:
    """One file per concern: `cpu_kernels.cpp` defines the `hybrid_serve` op library
    (TORCH_LIBRARY), every other file adds its ops with TORCH_LIBRARY_FRAGMENT; shared C++
    (`gemv.h`) lives in headers beside them, which the build name hashes too."""
    return sorted(CSRC.glob("*.cpp"))


_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ops" when loaded, "error" when the build failed
STALE_LOCK_S = 900.0  # a cold build takes 20-400 s here; a lock this old has no live builder


def _build_tag() -> str:
    """Hash of the sources and headers (names and text) and this machine's CPU flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    h = hashlib.sha1(flags.encode())
    for src in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:12]


def _clear_stale_lock(name: str) -> None:
    from torch.utils import cpp_extension

    lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale C++ kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


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
            name = f"hybrid_serve_cpu_{_build_tag()}"
            _clear_stale_lock(name)
            start = time.perf_counter()
            cpp_extension.load(
                name=name,
                sources=[str(src) for src in sources()],
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
