"""The machine's limits for `benchmarks.roofline`: read bandwidth and register-resident peak rates.

Two kinds of ceiling, each named by what exactly it runs:

- read bandwidth (`read_bandwidth`): `torch.sum` over one fp32 buffer of `mib` MiB (filled once
  before timing, so no page faults in the clock) on the threads torch has, bytes read over wall
  time, median of `repeats`. Meant for a buffer far larger than the last-level cache
  (`last_level_cache_bytes`); the caller warns when it is not.
- peak rates (`measure_peaks`): a tiny C++ probe (`PROBE_SOURCE`, compiled once per source and
  compiler into the kernel cache, loaded with ctypes: no torch headers) runs, on each of
  `threads` std::threads, `CHAINS` independent register accumulators through one instruction
  in a loop: no memory traffic, so the rate is the core's issue rate for that instruction, the
  hardware peak of that instruction and width (not of our kernels). The probes:

      fp32_fma:avx512        vfmadd on zmm (16 fp32 lanes)          needs avx512f
      fp32_fma:avx2          vfmadd on ymm (8 lanes)                needs avx2, fma
      fp32_fma:generic       a*b+c on 4-lane GCC vectors (NEON fmla on aarch64, SSE mul+add
                             on baseline x86): every CPU
      bf16_dot:avx512_bf16   vdpbf16ps on zmm (32 bf16 products)    needs avx512f, avx512_bf16
      int8_dot:avx512_vnni   vpdpbusd on zmm (64 u8 x s8 products)  needs avx512f, avx512_vnni
      int8_dot:avx_vnni      vpdpbusd on ymm, VEX (32 products)     needs avx2, avx_vnni
      int8_dot:avx2          vpmaddubsw + vpmaddwd + vpaddd on ymm (32 products per 3
                             instructions, our x86-64-v3 kernels' int8 dot): needs avx2

  A product counts 2 operations (its multiply and its add) in every probe, as a FLOP of fp32
  FMA does. Per kind the widest probe the host's features (`cpu_levels.host_features`) allow
  runs; a kind with none is reported as not measured, with the reason. x86 probes are compiled
  only on x86-64 (function-level target attributes, no -march), so aarch64 builds only the
  generic one. AMX (tdpbf16ps, tdpbssd) has no probe: on an AMX host the bf16 and int8
  ceilings are the AVX-512 instructions' rates, which AMX exceeds (the note says so).

Without a C++ compiler, or where the probe fails to build, every peak is not measured and the
reason is the compiler's; the bandwidth needs only torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybrid_serve.kernels import cpp_build, cpu_levels

logger = logging.getLogger("benchmarks.roofline_peaks")

CHAINS = 12  # independent accumulators per thread: above FMA latency x ports on current cores
KINDS = ("fp32_fma", "bf16_dot", "int8_dot")
# probe name -> the /proc/cpuinfo features it needs, widest first within a kind
PROBES: dict[str, frozenset[str]] = {
    "fp32_fma:avx512": frozenset({"avx512f"}),
    "fp32_fma:avx2": frozenset({"avx2", "fma"}),
    "fp32_fma:generic": frozenset(),
    "bf16_dot:avx512_bf16": frozenset({"avx512f", "avx512_bf16"}),
    "int8_dot:avx512_vnni": frozenset({"avx512f", "avx512_vnni"}),
    "int8_dot:avx_vnni": frozenset({"avx2", "avx_vnni"}),
    "int8_dot:avx2": frozenset({"avx2"}),
}
DESCRIBE = {
    "fp32_fma:avx512": "vfmadd231ps zmm (16 fp32 lanes)",
    "fp32_fma:avx2": "vfmadd231ps ymm (8 fp32 lanes)",
    "fp32_fma:generic": "a*b+c on 4-lane compiler vectors",
    "bf16_dot:avx512_bf16": "vdpbf16ps zmm (32 bf16 products)",
    "int8_dot:avx512_vnni": "vpdpbusd zmm (64 u8 x s8 products)",
    "int8_dot:avx_vnni": "vpdpbusd ymm, AVX-VNNI (32 u8 x s8 products)",
    "int8_dot:avx2": "vpmaddubsw+vpmaddwd+vpaddd ymm (32 u8 x s8 products)",
}
AMX = frozenset({"amx_bf16", "amx_int8"})

PROBE_SOURCE = r"""
// Register-resident peak-rate probes (benchmarks/roofline_peaks.py). Each probe runs CHAINS
// independent accumulators through one instruction `iters` times on every thread; no memory
// is touched in the loop. x86 bodies carry their own target attributes and are called only
// where the host has the features (the Python side checks /proc/cpuinfo).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
constexpr int kChains = CHAINS_VALUE;
volatile double g_sink = 0;  // keeps every probe's result alive
// every chain in its own register: without the unrolling the array lives on the stack
#define UNROLLED _Pragma("GCC unroll 64")

typedef float v4f __attribute__((vector_size(16)));

double fp32_generic(int64_t iters) {
  v4f acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = v4f{} + 0.01f * i;
  const v4f a = v4f{} + 0.999999f, b = v4f{} + 1e-6f;
  for (int64_t n = 0; n < iters; ++n)
    UNROLLED for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * a + b;
  double s = 0;
  for (int i = 0; i < kChains; ++i) s += acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3];
  return s;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) double fp32_avx512(int64_t iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.01f * i);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
  for (int64_t n = 0; n < iters; ++n)
    UNROLLED for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) double fp32_avx2(int64_t iters) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(0.01f * i);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);
  for (int64_t n = 0; n < iters; ++n)
    UNROLLED for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  float out[8];
  __m256 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_ps(s, acc[i]);
  _mm256_storeu_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

__attribute__((target("avx512f,avx512bf16"))) double bf16_avx512(int64_t iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.01f * i);
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(2e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(3e-3f), _mm512_set1_ps(1e-3f));
  for (int64_t n = 0; n < iters; ++n)
    UNROLLED for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f,avx512vnni"))) double int8_avx512(int64_t iters) {
  __m512i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int64_t n = 0; n < iters; ++n)
    UNROLLED for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  __m512i s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s);
}

__attribute__((target("avx2,avxvnni"))) double int8_avxvnni(int64_t iters) {
  __m256i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  for (int64_t n = 0; n < iters; ++n)
    UNROLLED for (int i = 0; i < kChains; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
  int32_t out[8];
  __m256i s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_epi32(s, acc[i]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), s);
  return double(out[0]) + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

__attribute__((target("avx2"))) double int8_avx2(int64_t iters) {
  __m256i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  for (int64_t n = 0; n < iters; ++n)
    UNROLLED for (int i = 0; i < kChains; ++i)
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
  int32_t out[8];
  __m256i s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_epi32(s, acc[i]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), s);
  return double(out[0]) + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}
#endif

struct Probe {
  const char* name;
  double (*body)(int64_t);
  double ops_per_iter;  // per thread: chains x products (or lanes) x 2
};

const Probe kProbes[] = {
#if defined(__x86_64__)
    {"fp32_fma:avx512", fp32_avx512, kChains * 16.0 * 2},
    {"fp32_fma:avx2", fp32_avx2, kChains * 8.0 * 2},
#endif
    {"fp32_fma:generic", fp32_generic, kChains * 4.0 * 2},
#if defined(__x86_64__)
    {"bf16_dot:avx512_bf16", bf16_avx512, kChains * 32.0 * 2},
    {"int8_dot:avx512_vnni", int8_avx512, kChains * 64.0 * 2},
    {"int8_dot:avx_vnni", int8_avxvnni, kChains * 32.0 * 2},
    {"int8_dot:avx2", int8_avx2, kChains * 32.0 * 2},
#endif
};
}  // namespace

extern "C" {
// The probes this build has, space-separated.
const char* roofline_probes() {
  static std::string names = [] {
    std::string s;
    for (const Probe& p : kProbes) s += std::string(s.empty() ? "" : " ") + p.name;
    return s;
  }();
  return names.c_str();
}

// Runs probe `name` for `iters` iterations on each of `threads` threads started together;
// writes the operations done (all threads) to *ops and returns the wall seconds from the
// common start to the last thread's end; -1 for an unknown name.
double roofline_run(const char* name, int threads, int64_t iters, double* ops) {
  const Probe* probe = nullptr;
  for (const Probe& p : kProbes)
    if (std::strcmp(p.name, name) == 0) probe = &p;
  if (probe == nullptr || threads < 1) return -1;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> sinks(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      sinks[t] = probe->body(iters);
    });
  while (ready.load() < threads) std::this_thread::yield();
  const auto start = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  for (std::thread& th : pool) th.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (double s : sinks) g_sink = g_sink + s;
  *ops = probe->ops_per_iter * double(iters) * threads;
  return seconds;
}
}
"""
FLAGS = ("-std=gnu++17", "-O2", "-fPIC", "-shared", "-pthread")


@dataclass
class Ceiling:
    """One measured limit: `rate` in bytes/s (bandwidth) or operations/s (peaks), None when not
    measured (`note` says why); `what` names exactly what ran; `runs` every repeat's rate."""

    name: str
    what: str
    rate: float | None
    unit: str
    runs: list[float] = field(default_factory=list)
    note: str = ""

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "what", "rate", "unit", "runs", "note")}


def n_threads(n: int) -> str:
    """ "`n` threads" for a report, singular for one."""
    return f"{n} thread{'s' * (n != 1)}"


def last_level_cache_bytes(cpu: int = 0) -> int | None:
    """Size of the highest cache level sysfs lists for `cpu` (None where unreadable)."""
    best: tuple[int, int] | None = None
    for index in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit() and (best is None or level > best[0]):
            best = (level, int(digits) * scale)
    return None if best is None else best[1]


def read_bandwidth(mib: int, repeats: int) -> Ceiling:
    """`torch.sum` read rate over one fp32 buffer of `mib` MiB on torch's current threads:
    median of `repeats` timed sums after one untimed sum (module docstring)."""
    buf = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        runs.append(buf.nbytes / (time.perf_counter() - start))
    threads = torch.get_num_threads()
    what = f"torch.sum over a {mib} MiB fp32 buffer, {n_threads(threads)}, median of {repeats}"
    llc = last_level_cache_bytes()
    note = ""
    if llc is not None and buf.nbytes < 4 * llc:
        note = f"buffer under 4x the {llc >> 20} MiB last-level cache: partly a cache rate"
        logger.warning("read bandwidth: %s", note)
    del buf
    return Ceiling("read bandwidth", what, statistics.median(runs), "B/s", runs, note)


def source_tag(cxx: str) -> str:
    """Hash of what the probe library is a function of: its source, flags and compiler."""
    h = hashlib.sha1(PROBE_SOURCE.encode())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    for part in (*FLAGS, str(CHAINS), cxx, version.stdout):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:12]


def build_probe(cache: Path | None = None) -> Path:
    """The probe library in the kernel cache (`cpp_build.cache_dir`), compiled now unless there
    (published by an atomic rename). `cpp_build.NoCompiler` without a compiler; RuntimeError
    with the compiler's first error where it fails."""
    cxx = cpp_build.compiler()
    cache = cache or cpp_build.cache_dir()
    lib = cache / f"roofline-probe-{platform.machine()}-{source_tag(cxx)}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=cache, prefix="roofline-probe.build-") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(PROBE_SOURCE.replace("CHAINS_VALUE", str(CHAINS)))
        out = Path(tmp) / "probe.so"
        done = subprocess.run(
            [cxx, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"roofline probe failed to build: {cpp_build.first_error(done.stderr)}"
            )
        os.replace(out, lib)
    logger.info("built %s", lib)
    return lib


class Probes:
    """The loaded probe library: `names` it has, `run` one of them."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.roofline_probes.restype = ctypes.c_char_p
        self.lib.roofline_run.restype = ctypes.c_double
        self.lib.roofline_run.argtypes = [
            ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_double)
        ]  # fmt: skip
        self.names = tuple(self.lib.roofline_probes().decode().split())

    def run(self, name: str, threads: int, iters: int) -> tuple[float, float]:
        """(seconds, operations) of one run of probe `name`; the caller checked the features."""
        ops = ctypes.c_double()
        seconds = self.lib.roofline_run(name.encode(), threads, iters, ctypes.byref(ops))
        if seconds < 0:
            raise ValueError(f"no probe {name!r} in this build")
        return seconds, ops.value

    def rate(self, name: str, threads: int, seconds: float, repeats: int) -> list[float]:
        """Operations/s of `repeats` runs of `name`, each sized (iterations doubled from 4096)
        to last at least `seconds`."""
        iters = 1 << 12
        while True:
            took, _ = self.run(name, threads, iters)
            if took >= seconds or iters >= 1 << 40:
                break
            iters *= 2 if took <= 0 else max(2, min(64, int(seconds / took * 1.2) + 1))
        runs = []
        for _ in range(repeats):
            took, ops = self.run(name, threads, iters)
            runs.append(ops / took)
        return runs


def choose_probes(names: Iterable[str], features: Iterable[str]) -> dict[str, str | None]:
    """Per kind (`KINDS`), the first probe of `names` (widest first, as `PROBES` orders them)
    whose features are all in `features`; None where none is."""
    have, built = frozenset(features), set(names)
    out: dict[str, str | None] = {}
    for kind in KINDS:
        out[kind] = next(
            (p for p, need in PROBES.items()
             if p.startswith(kind + ":") and p in built and need <= have),
            None,
        )  # fmt: skip
    return out


def measure_peaks(
    threads: int, seconds: float, repeats: int, features: Iterable[str] | None = None
) -> dict[str, Ceiling]:
    """Per kind (`KINDS`) a `Ceiling` in operations/s: the median of `repeats` runs of the
    widest probe the host runs on `threads` threads, or not measured with the reason."""
    features = cpu_levels.host_features() if features is None else frozenset(features)
    amx = sorted(AMX & features)
    amx_note = f"; this host has {', '.join(amx)}, which has no probe here (AMX is faster)"
    try:
        probes = Probes(build_probe())
    except (cpp_build.NoCompiler, RuntimeError, OSError) as e:
        logger.warning("peak rates not measured: %s", e)
        return {k: Ceiling(k, "", None, "op/s", note=f"not measured: {e}") for k in KINDS}
    out = {}
    for kind, name in choose_probes(probes.names, features).items():
        note = amx_note if amx and kind != "fp32_fma" else ""
        if name is None:
            why = f"not measured: no {kind} probe for this CPU ({platform.machine()})"
            out[kind] = Ceiling(kind, "", None, "op/s", note=why + note)
            continue
        runs = probes.rate(name, threads, seconds, repeats)
        what = (
            f"{DESCRIBE[name]}, {CHAINS} register chains x {n_threads(threads)}, "
            f"median of {repeats} (2 ops per product)"
        )
        out[kind] = Ceiling(kind, what, statistics.median(runs), "op/s", runs, note.lstrip("; "))
        logger.info("%s (%s): %.1f Gop/s", kind, name, out[kind].rate / 1e9)
    return out
