"""Build and load the C++ CPU kernels (every `kernels/csrc/*.cpp`) once per process.

The sources are compiled into one library at first use with torch's extension tooling (`-O3
-march=native`, OpenMP through ATen's `parallel_for`) and cached under torch's extensions directory
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); later processes load the cached
library in well under a second. The build is named by a hash of the sources, their directory
and this machine's CPU flags (`-march=native` code may not run on another CPU sharing the cache),
so two checkouts never rebuild each other's copy. Builders take an exclusive `flock` on the
build directory first (the kernel drops it when a process dies), so once a process holds it, any
baton file torch's builder left behind (a process killed while compiling; torch would wait on it
forever) is stale and is removed. The ops are registered as `torch.ops.hybrid_serve.*`.

A machine where the build fails (no compiler, no ninja) gets one warning and `load()` returns
None from then on: callers fall back to the torch references.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def _build_tag() -> str:
    """Hash of the sources and headers (names and text), where they are (two checkouts of the
    same sources would otherwise share one build whose ninja file names the other's paths, and
    rebuild it for each other) and this machine's CPU flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    h = hashlib.sha1(flags.encode() + b"\0" + str(CSRC.resolve()).encode())
    for src in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:12]


def _build_directory(name: str) -> Path:
    from torch.utils import cpp_extension

    path = Path(cpp_extension._get_build_directory(name, verbose=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def build_guard(build_dir: Path, wait: bool = True) -> Iterator[bool]:
    """Hold the build directory's `flock` (True): no other live process builds there, so a baton
    file torch's builder left (`lock`) belongs to a dead one and is removed. With `wait=False`
    and another process holding it, yields False at once and touches nothing."""
    with open(build_dir / "builder.flock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        (build_dir / "lock").unlink(missing_ok=True)
        yield True


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
            build_dir = _build_directory(name)
            start = time.perf_counter()
            with build_guard(build_dir):  # waits only for a live builder
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
