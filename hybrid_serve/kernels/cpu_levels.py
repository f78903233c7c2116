"""The named ISA levels the C++ CPU kernels are compiled for, and which one a host runs.

The kernels are never compiled with `-march=native`: each level is a fixed set of compiler
flags and the CPU features those flags let the compiler use, so a build made on one machine runs
on every machine that has the level's features, and a cache or an image can hold every level
(ggml's CPU variants, ATen's CPU_CAPABILITY). Start-up takes the best level the host supports
(`best`), or the one `KernelSettings.cpu_level` names (`choose`), and builds only that one.

A level's `requires` are feature names as Linux writes them in /proc/cpuinfo (`flags` on x86,
`Features` on aarch64); `host_features` reads them. The flags name each extension the level may
use and nothing more (`-march=x86-64-v4` plus extensions rather than `-march=sapphirerapids`, which
would also let the compiler use ones the requirements do not list).

`x86-64-v4-bf16` adds AVX512-BF16: simd.h's `bpairs` are then `vdpbf16ps` (the panel product
of the bf16 route, bpanel.h). `sapphirerapids` has no code of its own and is no AMX path: simd.h
compiles it to the x86-64-v4-bf16 vocabulary (the same `features`, the same sources), with flags
that add the other Sapphire Rapids extensions (AVX512-FP16, AMX) as compiler targets and
`-mtune=sapphirerapids`. The compiler schedules that code for Sapphire Rapids and may use
AVX512-FP16 instructions where it chooses; no source uses AMX tiles, and compilers do not emit
them unasked. Code of its own (AMX tiles) would be a new vocabulary in simd.h.

`multiplies_bf16` says whether the host multiplies bf16 in hardware, whatever level is loaded:
the bf16 route (kernels/kernel_set.py) is taken on such hosts; below x86-64-v4-bf16 its GEMM
widens the pairs and uses FMAs.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"


@dataclass(frozen=True)
class Level:
    name: str
    arch: str  # platform.machine() of the hosts it runs on
    flags: tuple[str, ...]  # compiler flags beyond the common ones
    requires: frozenset[str]  # /proc/cpuinfo feature names
    summary: str
    features: str  # what simd.h compiles to at this level (its `features()`, the library's op)
    vector: bool = True  # simd.h has vector bodies here (x86's generic level runs the scalar ones)

    def runs_on(self, features: Iterable[str]) -> bool:
        return self.requires <= set(features)


_V3 = frozenset(
    "pni ssse3 sse4_1 sse4_2 popcnt cx16 lahf_lm avx avx2 bmi1 bmi2 f16c fma movbe abm "
    "xsave".split()
)
_V4 = _V3 | frozenset("avx512f avx512bw avx512cd avx512dq avx512vl".split())

# Best last within an architecture: `best` takes the last level a host runs.
LEVELS: tuple[Level, ...] = (
    Level(
        "generic",
        "x86_64",
        ("-march=x86-64", "-mtune=generic"),
        frozenset(),
        "x86-64 baseline, scalar",
        "scalar",
        vector=False,
    ),
    Level(
        "x86-64-v3",
        "x86_64",
        ("-march=x86-64-v3",),
        _V3,
        "AVX2 + FMA (Haswell, Zen 1-3)",
        "avx2 fma",
    ),  # fmt: skip
    Level(
        "x86-64-v3-vnni",
        "x86_64",
        ("-march=x86-64-v3", "-mavxvnni"),
        _V3 | {"avx_vnni"},
        "AVX2 + AVX-VNNI (Alder Lake, Sierra Forest)",
        "avx2 fma avx-vnni",
    ),
    Level("x86-64-v4", "x86_64", ("-march=x86-64-v4",), _V4, "AVX-512 (Skylake-SP)", "avx512"),
    Level(
        "x86-64-v4-vnni",
        "x86_64",
        ("-march=x86-64-v4", "-mavx512vnni"),
        _V4 | {"avx512_vnni"},
        "AVX-512 + VNNI (Cascade Lake, Ice Lake, Zen 4/5)",
        "avx512 avx512-vnni",
    ),
    Level(
        "x86-64-v4-bf16",
        "x86_64",
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
        _V4 | {"avx512_vnni", "avx512_bf16"},
        "AVX-512 + VNNI + BF16 (Cooper Lake, Zen 4/5)",
        "avx512 avx512-vnni avx512-bf16",
    ),
    Level(
        "sapphirerapids",
        "x86_64",
        (
            "-march=x86-64-v4",
            "-mavx512vnni",
            "-mavx512bf16",
            "-mavx512fp16",
            "-mamx-tile",
            "-mamx-int8",
            "-mamx-bf16",
            "-mtune=sapphirerapids",
        ),
        _V4 | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"},
        "x86-64-v4-bf16's AVX-512 + VNNI + BF16 code tuned for Sapphire Rapids and later Xeons: "
        "FP16 instructions where the compiler chooses them, no AMX tiles",
        "avx512 avx512-vnni avx512-bf16",  # x86-64-v4-bf16's: no vocabulary of its own here
    ),
    Level(
        "generic", "aarch64", ("-march=armv8-a",), frozenset({"asimd"}), "ARMv8-A with NEON", "neon"
    ),  # fmt: skip
    Level(
        "armv8.2-a+dotprod",
        "aarch64",
        ("-march=armv8.2-a+dotprod",),
        frozenset({"asimd", "asimddp"}),
        "NEON + dot product (Graviton 2+, Ampere, Apple M, Neoverse)",
        "neon dotprod",
    ),
)


def levels(arch: str | None = None) -> list[Level]:
    """The levels of `arch` (default: this machine's), worst first."""
    arch = arch or platform.machine()
    return [lv for lv in LEVELS if lv.arch == arch]


def names(arch: str | None = None) -> list[str]:
    return [lv.name for lv in levels(arch)]


def get(name: str, arch: str | None = None) -> Level:
    for lv in levels(arch):
        if lv.name == name:
            return lv
    arch = arch or platform.machine()
    raise ValueError(
        f"unknown CPU level {name!r} for {arch}; expected {AUTO} or one of "
        f"{', '.join(names(arch)) or '(none: no C++ kernels for this architecture)'}"
    )


def host_features(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU features Linux reports for this host (x86 `flags`, aarch64 `Features`, of the
    first processor); empty where /proc/cpuinfo is unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


BF16_PRODUCTS = frozenset({"avx512_bf16", "amx_bf16"})  # bf16 dot products in hardware


def multiplies_bf16(features: Iterable[str] | None = None) -> bool:
    """Whether the host (`features`, default `host_features()`) has bf16 dot products in
    hardware: avx512_bf16's `vdpbf16ps` or AMX's `tdpbf16ps`, which oneDNN uses for torch's bf16
    products."""
    features = host_features() if features is None else frozenset(features)
    return not BF16_PRODUCTS.isdisjoint(features)


def best(features: Iterable[str] | None = None, arch: str | None = None) -> Level | None:
    """The best level of `arch` whose features the host has (None: no level for `arch`)."""
    features = host_features() if features is None else frozenset(features)
    runnable = [lv for lv in levels(arch) if lv.runs_on(features)]
    return runnable[-1] if runnable else None


def choose(
    name: str = AUTO, features: Iterable[str] | None = None, arch: str | None = None
) -> Level | None:
    """The level to build and load: `best` for "auto", else the named one, which must run here
    (an unknown or unsupported name is a ValueError that says what the host has)."""
    features = host_features() if features is None else frozenset(features)
    if name == AUTO:
        return best(features, arch)
    level = get(name, arch)
    missing = sorted(level.requires - features)
    if missing:
        raise ValueError(
            f"CPU level {name!r} needs {', '.join(missing)}, which this CPU lacks; "
            f"it runs: {', '.join(lv.name for lv in levels(arch) if lv.runs_on(features))}"
        )
    return level
