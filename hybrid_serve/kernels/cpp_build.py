"""Build and load the C++ CPU kernels (every `kernels/csrc/*.cpp`) at one named ISA level.

The sources are compiled once per level (`hybrid_serve/kernels/cpu_levels.py`: fixed flags, never
`-march=native`) into one shared library, `<cache>/<level>-<tag>.so`, where the tag hashes the
sources and headers, the level's flags, the compiler and the torch version: a library is a pure
function of those, so checkouts, processes and images share it safely, and a CPU never loads a
build whose features it lacks. A process loads one level, the first one asked for (`load`);
later processes load the cached library in well under a second. Builders take an exclusive
`flock` on `<name>.lock` (the kernel drops it when a process dies) and publish the library by an
atomic rename, so a half-written library is never loaded. The ops are registered as
`torch.ops.hybrid_serve.*`.

Failures: where there is no C++ compiler, `load()` logs one WARNING, which names what to
install, and returns None (callers use the torch references). Where the compiler runs and
fails, that is a bug or a broken toolchain, never a silent fallback: `load()` returns None,
logs the compiler's first error, and `load_error()` is a `BuildError` that the kernel set
refuses to start on unless the torch references were asked for (kernels/kernel_set.py).
`python -m hybrid_serve.kernels.prebuild` is the command line (`make install`, the CPU image).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hybrid_serve.kernels import cpu_levels
from hybrid_serve.kernels.cpu_levels import Level
from hybrid_serve.kernels.settings import KernelSettings

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
LIBRARY = "hybrid_serve_cpu"
COMMON_FLAGS = ("-std=c++20", "-fPIC", "-O3", "-fopenmp")


class BuildError(RuntimeError):
    """The compiler ran and failed; `first_error` is its first `error:` line."""

    def __init__(self, level: str, first_error: str, output: str) -> None:
        super().__init__(f"C++ kernels ({level}) failed to build: {first_error}")
        self.first_error = first_error
        self.output = output


class NoCompiler(RuntimeError):
    """No C++ compiler on this machine: the torch references serve."""


def sources() -> list[Path]:
    """One file per concern: `library.cpp` defines the `hybrid_serve` op library
    (TORCH_LIBRARY), every other file adds its ops with TORCH_LIBRARY_FRAGMENT; shared C++ lives
    in headers beside them, which the tag hashes too."""
    return sorted(CSRC.glob("*.cpp"))


def compiler() -> str:
    """The C++ compiler (`CXX`, else `c++`), as an absolute path; NoCompiler where absent."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        raise NoCompiler(f"no C++ compiler ({cxx!r} is not on PATH)")
    return path


def include_flags() -> list[str]:
    from torch.utils import cpp_extension

    return [f for p in cpp_extension.include_paths() for f in ("-isystem", p)]


def abi_flags() -> list[str]:
    return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]


def compile_flags(level: Level) -> list[str]:
    return [*COMMON_FLAGS, *level.flags, *abi_flags(), *include_flags()]


def link_flags() -> list[str]:
    from torch.utils import cpp_extension

    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    return ["-shared", "-fopenmp", *libs, "-lc10", "-ltorch_cpu"]


def _compiler_id(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    return (out.stdout.splitlines() or [""])[0]


def tag(level: Level, cxx: str) -> str:
    """Hash of what the library is a function of: sources and headers (names and text), the
    level's flags, the compiler and torch."""
    h = hashlib.sha1()
    for part in (level.name, *level.flags, *COMMON_FLAGS, _compiler_id(cxx), torch.__version__):
        h.update(part.encode() + b"\0")
    for src in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:12]


def cache_dir(settings: KernelSettings | None = None) -> Path:
    settings = settings or KernelSettings.from_env()
    path = Path(settings.cache_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def first_error(output: str) -> str:
    """The compiler's first error line (or its last line where none says `error`)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        if "error:" in ln or "Error:" in ln:
            return ln
    return lines[-1] if lines else "(no output)"


def build(level: Level, cache: Path, jobs: int | None = None) -> Path:
    """The library of `level` in `cache`, compiled now unless already there (NoCompiler,
    BuildError). Does not load it."""
    cxx = compiler()
    name = f"{level.name}-{tag(level, cxx)}"
    lib = cache / f"{name}.so"
    if lib.exists():
        return lib
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits only for a live builder
        if lib.exists():  # built meanwhile
            return lib
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=cache, prefix=f"{name}.build-") as tmp:
            flags = compile_flags(level)

            def compile_one(src: Path) -> Path:
                obj = Path(tmp) / f"{src.stem}.o"
                _run([cxx, *flags, "-c", str(src), "-o", str(obj)], level)
                return obj

            with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
                objects = list(pool.map(compile_one, sources()))
            part = Path(tmp) / f"{LIBRARY}.so"
            _run([cxx, *map(str, objects), *link_flags(), "-o", str(part)], level)
            os.replace(part, lib)
        logger.info("C++ kernels (%s) built in %.1f s", level.name, time.perf_counter() - start)
    return lib


def _run(cmd: list[str], level: Level) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        text = out.stderr + out.stdout
        raise BuildError(level.name, first_error(text), text)


# The one WARNING of a process whose C++ kernels cannot be built (`_state` keeps it to one).
UNAVAILABLE = (
    "C++ CPU kernels unavailable, using the torch references: %s; every op of a CPU model runs "
    "the references, which are slower, and there is no CPU decode plan; %s"
)
INSTALL = (
    "install a C++ compiler (g++, or name one in CXX), then python -m hybrid_serve.kernels.prebuild"
)

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ops", "level", "path" once loaded; "error" when it failed


def load(level: str | None = None, settings: KernelSettings | None = None) -> Any | None:
    """`torch.ops.hybrid_serve` with the kernels of `level` (default: the settings' cpu_level,
    "auto" the best this CPU runs) built and registered, or None where they cannot be (the
    module docstring). A process holds one level: asking for another once one is loaded is a
    ValueError. An unknown level, or one this CPU cannot run, is a ValueError too."""
    settings = settings or KernelSettings.from_env()
    want = level or settings.cpu_level
    with _lock:
        if "ops" not in _state and "error" not in _state:
            _load(want, settings)
        if "level" in _state and want not in (cpu_levels.AUTO, _state["level"].name):
            raise ValueError(
                f"CPU level {want!r} asked for, but this process loaded {_state['level'].name!r}"
            )
        return _state.get("ops")


def _load(want: str, settings: KernelSettings) -> None:
    level = cpu_levels.choose(want)  # ValueError: not this CPU's
    if level is None:
        _state["error"] = NoCompiler(f"no C++ kernel level for {platform.machine()}")
        logger.warning(
            UNAVAILABLE, _state["error"], "no install avoids it: the levels are x86_64 and aarch64"
        )
        return
    _state["level"] = level
    try:
        path = build(level, cache_dir(settings))
        torch.ops.load_library(str(path))
        compiled = torch.ops.hybrid_serve.features()
        if compiled != level.features:  # the flags did not give the vocabulary they name
            raise BuildError(level.name, f"compiled to {compiled!r}, not {level.features!r}", "")
    except NoCompiler as e:
        _state["error"] = e
        logger.warning(UNAVAILABLE, e, INSTALL)
        return
    except BuildError as e:
        _state["error"] = e
        logger.error("%s", e)
        return
    _state["ops"], _state["path"] = torch.ops.hybrid_serve, path
    logger.info("C++ CPU kernels: level %s (%s; %s), %s", level.name, level.summary,
                level.features, path)  # fmt: skip


def available(level: str | None = None) -> bool:
    return load(level) is not None


def load_error() -> BaseException | None:
    return _state.get("error")


def loaded_level() -> Level | None:
    """The level this process loaded (or tried to: see `load_error`)."""
    return _state.get("level")
