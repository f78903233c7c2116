"""Every ISA level of the C++ kernels, whatever the host (hybrid_serve/kernels/cpu_levels.py).

- Every source compiles at every level of both architectures: x86-64 through the host compiler
  (or x86_64-linux-gnu-g++ on an aarch64 host), aarch64 through aarch64-linux-gnu-g++, which
  `make test` installs where it is missing. A missing cross compiler fails the test: the AVX-512
  build broke unseen while every machine it was built on had AVX2 only.
- Every level this CPU runs is compared with the generic one through a probe library of the
  numeric cores (tests/kernels/level_probe.cpp): the integer products, the tiled GEMM, the
  activations' rounding, exp/silu and the window shuffles bit for bit; the fp32/bf16 GEMV
  within fp32 round-off (its lanes run along k, so its bits follow the vector width: simd.h).
- The other architecture's levels run too, under qemu-user (which `make test` installs with the
  cross compiler): the probe as a standalone program (level_probe_main.cpp, torch_stubs.cpp),
  its results held to the same contract against this host's generic level.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hybrid_serve.kernels import cpp_build, cpu_levels, quant
from hybrid_serve.kernels.bf16_pack import pack_bf16

HERE = Path(__file__).parent
ARCHES = ("x86_64", "aarch64")


def compiler_for(arch: str) -> str | None:
    """The compiler that targets `arch` from this host (None: not installed)."""
    if arch == platform.machine():
        return shutil.which(os.environ.get("CXX", "c++"))
    return shutil.which(f"{arch}-linux-gnu-g++")


def compile_unity(level: cpu_levels.Level, cxx: str, tmp: Path) -> str:
    """Every source of kernels/csrc in one translation unit at `level`, compiled to an object
    at -O0 (the intrinsics' target checks run at every optimisation level); '' or the first
    error."""
    unity = tmp / f"unity-{level.arch}-{level.name}.cpp"
    unity.write_text("".join(f'#include "{src}"\n' for src in cpp_build.sources()))
    flags = [f for f in cpp_build.compile_flags(level) if f != "-O3"]
    out = subprocess.run(
        [cxx, *flags, "-O0", "-c", str(unity), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    return "" if out.returncode == 0 else cpp_build.first_error(out.stderr + out.stdout)


@pytest.mark.slow
def test_every_source_compiles_at_every_level_of_both_architectures(tmp_path):
    missing = [arch for arch in ARCHES if compiler_for(arch) is None]
    assert not missing, (
        f"no compiler for {', '.join(missing)}: `make test` installs the cross compiler "
        "(Debian: apt-get install g++-aarch64-linux-gnu, or g++-x86-64-linux-gnu on aarch64)"
    )
    jobs = [(lv, compiler_for(lv.arch)) for arch in ARCHES for lv in cpu_levels.levels(arch)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        errors = list(pool.map(lambda job: compile_unity(job[0], job[1], tmp_path), jobs))
    failed = {f"{lv.arch}/{lv.name}": err for (lv, _), err in zip(jobs, errors, strict=True) if err}
    assert not failed, failed
    assert {(lv.arch, lv.name) for lv, _ in jobs} >= {
        ("x86_64", "generic"), ("x86_64", "x86-64-v3"), ("x86_64", "x86-64-v4"),
        ("x86_64", "sapphirerapids"), ("aarch64", "armv8.2-a+dotprod"),
    }  # fmt: skip


# ---- the levels this CPU runs, against the generic one ----------------------------------------

RUNNABLE = [lv for lv in cpu_levels.levels() if lv.runs_on(cpu_levels.host_features())]


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    cxx = compiler_for(platform.machine())
    if cxx is None:
        pytest.fail(f"the level probes need a C++ compiler ({os.environ.get('CXX', 'c++')!r})")
    tmp = tmp_path_factory.mktemp("probes")

    def build(level: cpu_levels.Level) -> Path:
        lib = tmp / f"probe-{level.name}.so"
        flags = [f for f in cpp_build.compile_flags(level) if f != "-O3"]
        cmd = [cxx, *flags, "-O2", f"-I{cpp_build.CSRC}", str(HERE / "level_probe.cpp")]
        subprocess.run([*cmd, *cpp_build.link_flags(), "-o", str(lib)], check=True)
        return lib

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        libs = dict(zip([lv.name for lv in RUNNABLE], pool.map(build, RUNNABLE), strict=True))
    out = {}
    for name, path in libs.items():
        lib = ctypes.CDLL(str(path))
        lib.probe_features.restype = ctypes.c_char_p
        lib.probe_quantize.restype = ctypes.c_float
        lib.probe_exp1.restype = ctypes.c_float
        lib.probe_exp1.argtypes = [ctypes.c_float]
        lib.probe_routed.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 3,
                                     ctypes.c_void_p, ctypes.c_float]  # fmt: skip
        lib.probe_delta_pass.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_double] * 2 + [
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        lib.probe_delta_pass_channels.argtypes = [ctypes.c_void_p] * 7 + [
            ctypes.c_double, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        lib.probe_delta_token_channels.argtypes = [ctypes.c_void_p] * 5 + [
            ctypes.c_float, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 3,
        ]  # fmt: skip
        out[name] = lib
    return out


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def linear(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    code = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}[w.dtype]
    M, K, N = x.shape[0], x.shape[1], w.shape[0]
    y = torch.empty(M, N)
    i64 = ctypes.c_int64
    lib.probe_linear(code, ptr(x), ptr(w), ptr(y), i64(M), i64(N), i64(K))
    return y


OTHERS = [lv.name for lv in RUNNABLE if lv.name != "generic"]


def test_each_level_compiled_to_its_features(probes):
    for name, lib in probes.items():
        assert lib.probe_features().decode() == cpu_levels.get(name).features, name


@pytest.mark.parametrize("level", OTHERS)
def test_integer_products_and_the_gemm_are_the_generic_levels_bit_for_bit(probes, level):
    g = torch.Generator().manual_seed(0)
    for M, N, K in [(1, 7, 96), (2, 50, 64), (3, 9, 100), (5, 33, 256), (8, 13, 160),
                    (9, 50, 96), (12, 21, 100), (16, 40, 256), (17, 13, 100), (40, 48, 288),
                    (33, 7, 300), (70, 61, 544)]:  # fmt: skip
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)
        weights = [quant.quantize(w, "int8")]
        if K % quant.GROUP == 0:
            weights.append(quant.quantize(w, "int4"))
        if M > 8:  # the tiled GEMM: one fused chain per output at every width
            weights += [w, w.bfloat16()]
        for wq in weights:
            want = linear(probes["generic"], x, wq)
            got = linear(probes[level], x, wq)
            assert torch.equal(got, want), (level, M, N, K, wq.dtype)
            xr = quant.round_activations(x) if quant.is_quantized(wq) else x
            ref = xr @ quant.widen(wq, torch.float32).T
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def routed(lib: ctypes.CDLL, xs, gate_up, down, counts, limit: float) -> torch.Tensor:
    code = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}[down.dtype]
    E, H, I = gate_up.shape[0], xs.shape[1], quant.in_features(down)
    y = torch.empty_like(xs)
    i64 = ctypes.c_int64
    lib.probe_routed(code, ptr(xs), ptr(gate_up), ptr(down), ptr(counts), i64(E), i64(H),
                     i64(I), ptr(y), ctypes.c_float(limit))  # fmt: skip
    return y


@pytest.mark.parametrize("level", OTHERS)
def test_routed_experts_keep_the_levels_contract(probes, level):
    """The routed experts (routed_experts.h) past the GEMV's 8 rows: int8 and int4 experts the
    generic level's bits, fp32 and bf16 ones within round-off; the clamped SwiGLU too."""
    g = torch.Generator().manual_seed(2)
    E, H, I = 4, 96, 64
    counts = torch.tensor([9, 0, 20, 3])
    xs = torch.randn(int(counts.sum()), H, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * 0.1
    down = torch.randn(E, H, I, generator=g) * 0.1
    for fmt in ("int8", "int4", "float32", "bfloat16"):
        q = quant.quantize if fmt.startswith("int") else lambda w, f: w.to(getattr(torch, f))
        gu, dn = q(gate_up, fmt), q(down, fmt)
        for limit in (0.0, 0.3):
            want = routed(probes["generic"], xs, gu, dn, counts, limit)
            got = routed(probes[level], xs, gu, dn, counts, limit)
            if fmt.startswith("int"):
                assert torch.equal(got, want), (level, fmt, limit)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", OTHERS)
def test_the_gemv_agrees_within_round_off(probes, level):
    """fp32/bf16 rows up to 8: lanes along k, so the bits follow the width (simd.h); levels of
    one width agree bit for bit."""
    g = torch.Generator().manual_seed(1)
    width = {lv: cpu_levels.get(lv).features.startswith("avx512") for lv in OTHERS}
    for M, N, K in [(1, 20, 300), (4, 17, 64), (8, 5, 1000)]:
        x = torch.randn(M, K, generator=g)
        for w in (torch.randn(N, K, generator=g), torch.randn(N, K, generator=g).bfloat16()):
            got = linear(probes[level], x, w)
            torch.testing.assert_close(got, linear(probes["generic"], x, w), rtol=1e-5, atol=1e-5)
            for other in OTHERS:
                if width[other] == width[level]:
                    assert torch.equal(linear(probes[other], x, w), got), (level, other)


def panels(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The bf16 panel product (bpanel.h) of x and w packed in K-pair panels."""
    (M, K), N = x.shape, w.shape[0]
    y, packed = torch.empty(M, N), pack_bf16(w)
    i64 = ctypes.c_int64
    lib.probe_bf16_panels(ptr(x), ptr(packed), ptr(y), i64(M), i64(N), i64(K))
    return y


PANEL_SHAPES = [(1, 37, 33), (3, 16, 64), (9, 70, 300), (20, 5, 7), (40, 33, 129), (6, 150, 520),
                (1, 130, 517)]  # fmt: skip


@pytest.mark.parametrize("level", ["generic", *OTHERS])
def test_the_panel_product_keeps_its_contract_at_every_level(probes, level):
    """bpanel.h sums every output in one chain, lanes along N: at each level a row is the same
    bits at every row count; the levels whose pair dot is two FMAs (all but AVX512-BF16's) are
    the generic level bit for bit, whatever their width; vdpbf16ps levels agree among
    themselves and within one bf16 rounding of the generic level."""
    g = torch.Generator().manual_seed(11)
    dot = "bf16" in cpu_levels.get(level).features
    for M, N, K in PANEL_SHAPES:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
        got, want = panels(probes[level], x, w), panels(probes["generic"], x, w)
        for m in {1, 2, M // 2 + 1, M - 1} - {0}:
            assert torch.equal(panels(probes[level], x[:m].contiguous(), w), got[:m]), (M, m)
        if not dot:
            assert torch.equal(got, want), (level, M, N, K)
            continue
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * scale)
        for other in OTHERS:
            if "bf16" in cpu_levels.get(other).features:
                assert torch.equal(panels(probes[other], x, w), got), (level, other)


def routed_panels(lib, xs, gate_up, down, counts, limit=0.0) -> torch.Tensor:
    """routed_experts.h on bf16 experts packed in K-pair panels (`pack_bf16` per expert)."""
    (E, H, I), T = down.shape, xs.shape[0]
    y, gu, dn = torch.empty(T, H), pack_bf16(gate_up), pack_bf16(down)
    i64 = ctypes.c_int64
    lib.probe_routed_panels(ptr(xs), ptr(gu), ptr(dn), ptr(counts), i64(E), i64(H), i64(I),
                            ptr(y), ctypes.c_float(limit))  # fmt: skip
    return y


@pytest.mark.parametrize("level", ["generic", *OTHERS])
def test_routed_experts_read_the_panels_to_the_panel_contract(probes, level):
    """Panel-packed bf16 experts (a short last panel and an odd K in both matrices): each row is
    the same bits routed alone as in its batch; the expert's products are the panel product's
    (within a rounding of the torch composition); FMA levels equal the generic level bit for
    bit, vdpbf16ps levels within one bf16 rounding."""
    g = torch.Generator().manual_seed(5)
    E, H, I = 4, 100, 37
    counts = torch.tensor([9, 0, 20, 3])
    xs = torch.randn(int(counts.sum()), H, generator=g)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    lib = probes[level]
    for limit in (0.0, 0.3):
        got = routed_panels(lib, xs, gate_up, down, counts, limit)
        start = 0
        for e, c in enumerate(counts.tolist()):
            for t in range(start, start + c, 4):
                alone = torch.zeros(E, dtype=torch.int64)
                alone[e] = 1
                one = routed_panels(lib, xs[t : t + 1].contiguous(), gate_up, down, alone, limit)
                assert torch.equal(one, got[t : t + 1]), (level, e, t)
            rows = xs[start : start + c]
            if c:
                gate, up = panels(lib, rows, gate_up[e]).chunk(2, dim=-1)
                act = torch.nn.functional.silu(gate)
                if limit:  # the clamped SwiGLU (kernels/experts.py `swiglu`)
                    act, up = act.clamp(max=limit), up.clamp(-limit, limit)
                want = panels(lib, (act * up).contiguous(), down[e])
                scale = want.abs().max().item()
                torch.testing.assert_close(got[start : start + c], want, rtol=2**-6,
                                           atol=2**-6 * scale)  # fmt: skip
            start += c
        ref = routed_panels(probes["generic"], xs, gate_up, down, counts, limit)
        if "bf16" not in cpu_levels.get(level).features:
            assert torch.equal(got, ref), (level, limit)
        else:
            scale = ref.abs().max().item()
            torch.testing.assert_close(got, ref, rtol=2**-6, atol=2**-6 * scale)


@pytest.mark.parametrize("level", OTHERS)
def test_rounding_exp_silu_and_windows_are_the_generic_levels(probes, level):
    g = torch.Generator().manual_seed(2)
    lib, ref = probes[level], probes["generic"]
    for x in (torch.randn(32, generator=g) * 3, torch.randn(17, generator=g), torch.zeros(32)):
        n = x.numel()
        qa, qb = torch.empty(n, dtype=torch.int8), torch.empty(n, dtype=torch.int8)
        sa = lib.probe_quantize(ptr(x), ctypes.c_int64(n), ptr(qa))
        sb = ref.probe_quantize(ptr(x), ctypes.c_int64(n), ptr(qb))
        assert sa == sb and torch.equal(qa, qb)
    y = torch.cat([torch.linspace(-90, 90, 61), torch.randn(40, generator=g) * 8])
    a, b = y.clone(), y.clone()
    lib.probe_silu(ptr(a), ctypes.c_int64(a.numel()))
    ref.probe_silu(ptr(b), ctypes.c_int64(b.numel()))
    assert torch.equal(a, b)
    torch.testing.assert_close(a, torch.nn.functional.silu(y), rtol=1e-6, atol=1e-30)
    for v in (-87.0, -1.5, 0.0, 0.3, 10.0, 88.0):
        assert lib.probe_exp1(v) == ref.probe_exp1(v)
    window = torch.randn(25, generator=g)
    xs = torch.randn(8, generator=g)
    wa, wb, ha, hb = window.clone(), window.clone(), torch.empty(24), torch.empty(24)
    lib.probe_window(ptr(wa), ptr(xs), ptr(ha))
    ref.probe_window(ptr(wb), ptr(xs), ptr(hb))
    assert torch.equal(ha, hb) and torch.equal(wa, wb)
    assert torch.equal(ha.view(3, 8), window[:24].view(8, 3).T)
    assert torch.equal(wa[:24].view(8, 3), torch.stack([window[1:24:3], window[2:24:3], xs], 1))


@pytest.mark.parametrize("level", OTHERS)
def test_the_delta_rule_pass_is_the_same_at_every_vector_level(probes, level):
    g = torch.Generator().manual_seed(3)
    dk = 24
    s0 = torch.randn(dk, 16, dtype=torch.float64, generator=g)
    k, q, kn = (torch.randn(dk, dtype=torch.float64, generator=g) for _ in range(3))
    v, a0 = (torch.randn(16, dtype=torch.float64, generator=g) for _ in range(2))

    def run(lib: ctypes.CDLL) -> tuple[torch.Tensor, ...]:
        s, a, o = s0.clone(), a0.clone(), torch.empty(16, dtype=torch.float64)
        lib.probe_delta_pass(ptr(s), ptr(k), ptr(q), ptr(kn), ptr(v), 0.9, 0.5, dk, ptr(a), ptr(o))
        return s, a, o

    got = run(probes[level])
    delta = (v - 0.9 * a0) * 0.5
    s_ref = 0.9 * s0 + k[:, None] * delta
    for t, want in zip(got, (s_ref, s_ref.T @ kn, s_ref.T @ q), strict=True):
        torch.testing.assert_close(t, want, rtol=1e-12, atol=1e-12)
    for other in OTHERS:  # elementwise along the columns: no width in the sums
        assert all(torch.equal(a, b) for a, b in zip(run(probes[other]), got, strict=True)), (
            level,
            other,
        )


def delta_channels_inputs() -> tuple[torch.Tensor, ...]:
    """s0 [24, 16], k, q, kn, d, dn [24], v, a0 [16] (double) for the per-channel pass."""
    g = torch.Generator().manual_seed(5)
    dk = 24
    s0 = torch.randn(dk, 16, dtype=torch.float64, generator=g)
    k, q, kn = (torch.randn(dk, dtype=torch.float64, generator=g) for _ in range(3))
    d, dn = (torch.rand(dk, dtype=torch.float64, generator=g) for _ in range(2))
    v, a0 = (torch.randn(16, dtype=torch.float64, generator=g) for _ in range(2))
    return s0, k, q, kn, d, dn, v, a0


def delta_channels_want(s0, k, q, kn, d, dn, v, a0) -> tuple[torch.Tensor, ...]:
    """(s, a, o) of the per-channel pass: rows decay by d, a' = S^T (dn * kn)."""
    s_ref = d[:, None] * s0 + k[:, None] * ((v - a0) * 0.5)
    return s_ref, s_ref.T @ (dn * kn), s_ref.T @ q


@pytest.mark.parametrize("level", OTHERS)
def test_the_per_channel_delta_rule_pass_is_the_same_at_every_vector_level(probes, level):
    s0, k, q, kn, d, dn, v, a0 = inputs = delta_channels_inputs()

    def run(lib: ctypes.CDLL) -> tuple[torch.Tensor, ...]:
        s, a, o = s0.clone(), a0.clone(), torch.empty(16, dtype=torch.float64)
        lib.probe_delta_pass_channels(ptr(s), ptr(k), ptr(q), ptr(kn), ptr(v), ptr(d), ptr(dn),
                                      0.5, len(k), ptr(a), ptr(o))  # fmt: skip
        return s, a, o

    got = run(probes[level])
    for t, want in zip(got, delta_channels_want(*inputs), strict=True):
        torch.testing.assert_close(t, want, rtol=1e-12, atol=1e-12)
    for other in OTHERS:  # elementwise along the columns: no width in the sums
        assert all(torch.equal(a, b) for a, b in zip(run(probes[other]), got, strict=True)), (
            level,
            other,
        )


@pytest.mark.parametrize("level", OTHERS)
def test_the_per_channel_fp32_token_step_keeps_the_contract_at_every_vector_level(probes, level):
    """The decode step with one decay per state row (KDA): within fp32 round-off of the float64
    formula and of the generic level (its loops run along the value columns: no width in the
    sums), and the same bits at every vector level."""
    g = torch.Generator().manual_seed(6)
    dk, dv = 40, 24
    s0 = torch.randn(dk, dv, generator=g)
    k, q = (torch.nn.functional.normalize(torch.randn(dk, generator=g), dim=0) for _ in range(2))
    v, d = torch.randn(dv, generator=g), torch.rand(dk, generator=g)

    def run(lib: ctypes.CDLL) -> tuple[torch.Tensor, torch.Tensor]:
        s, o, acc, delta = s0.clone(), torch.empty(dv), torch.empty(dv), torch.empty(dv)
        lib.probe_delta_token_channels(ptr(s), ptr(k), ptr(q), ptr(v), ptr(d), 0.5, dk, dv,
                                       ptr(acc), ptr(delta), ptr(o))  # fmt: skip
        return s, o

    got = run(probes[level])
    s_dec = d.double()[:, None] * s0.double()
    s_ref = s_dec + k.double()[:, None] * ((v.double() - s_dec.T @ k.double()) * 0.5)
    for t, want, generic in zip(got, (s_ref, s_ref.T @ q.double()), run(probes["generic"]),
                                strict=True):  # fmt: skip
        torch.testing.assert_close(t.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t, generic, rtol=1e-5, atol=1e-5)
    for other in OTHERS:
        assert all(torch.equal(a, b) for a, b in zip(run(probes[other]), got, strict=True)), (
            level,
            other,
        )


# ---- the other architecture's levels, under emulation ------------------------------------------

OTHER = "aarch64" if platform.machine() == "x86_64" else "x86_64"
EMULATED = [
    lv
    for lv in cpu_levels.levels(OTHER)
    if OTHER == "aarch64" or lv.name in ("generic", "x86-64-v3")
]  # fmt: skip  (qemu emulates AVX2, not AVX-512)


class Emulated:
    """The probe of one level of the other architecture, run under qemu-user, file in file out."""

    def __init__(self, exe: Path, tmp: Path) -> None:
        self.exe, self.tmp = exe, tmp
        sysroot = Path(f"/usr/{OTHER}-linux-gnu")
        self.cmd = [f"qemu-{OTHER}", "-L", str(sysroot), "-cpu", "max", str(exe)]

    def run(self, *args: object) -> str:
        out = subprocess.run([*self.cmd, *map(str, args)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def file(self, name: str, t: torch.Tensor | None = None) -> Path:
        path = self.tmp / name
        if t is not None:
            path.write_bytes(t.contiguous().view(torch.uint8).numpy().tobytes())
        return path

    def read(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        data = bytearray((self.tmp / name).read_bytes())
        return torch.frombuffer(data, dtype=dtype).view(shape).clone()

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        code = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}[w.dtype]
        (M, K), N = x.shape, w.shape[0]
        self.run("linear", code, M, N, K, self.file("x", x), self.file("w", w), self.file("y"))
        return self.read("y", torch.float32, (M, N))

    def panels(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        (M, K), N = x.shape, w.shape[0]
        self.run("panels", M, N, K, self.file("x", x), self.file("w", pack_bf16(w)),
                 self.file("y"))  # fmt: skip
        return self.read("y", torch.float32, (M, N))


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> dict[str, Emulated]:
    cxx = compiler_for(OTHER)
    missing = [n for n, p in ((f"{OTHER} compiler", cxx), ("qemu", shutil.which(f"qemu-{OTHER}")))
               if p is None]  # fmt: skip
    assert not missing, f"no {', '.join(missing)}: `make test` installs them (Debian: qemu-user)"
    tmp = tmp_path_factory.mktemp("emulated")

    def build(level: cpu_levels.Level) -> Path:
        exe = tmp / f"probe-{level.name}"
        flags = [f for f in cpp_build.compile_flags(level) if f not in ("-O3", "-fPIC")]
        srcs = [HERE / "level_probe_main.cpp", HERE / "torch_stubs.cpp"]
        cmd = [cxx, *flags, "-O2", f"-I{cpp_build.CSRC}", f"-I{HERE}", *map(str, srcs)]
        subprocess.run([*cmd, "-o", str(exe)], check=True)
        return exe

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        exes = list(pool.map(build, EMULATED))
    return {
        lv.name: Emulated(exe, tmp_path_factory.mktemp(lv.name))
        for lv, exe in zip(EMULATED, exes, strict=True)
    }


@pytest.mark.slow
@pytest.mark.parametrize("level", [lv.name for lv in EMULATED])
def test_the_other_architecture_keeps_the_contract(probes, emulated, level):
    emu, host = emulated[level], probes["generic"]
    assert emu.run("features") == cpu_levels.get(level, OTHER).features
    g = torch.Generator().manual_seed(4)
    for M, N, K in [(1, 7, 96), (3, 9, 100), (8, 13, 160), (16, 40, 256), (17, 13, 100),
                    (40, 20, 288)]:  # fmt: skip
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        exact = [quant.quantize(w, "int8")] + ([quant.quantize(w, "int4")] if K % 32 == 0 else [])
        if M > 8:
            exact += [w, w.bfloat16()]
        for wq in exact:  # integer products and the tiled GEMM: the host's generic bits
            assert torch.equal(emu.linear(x, wq), linear(host, x, wq)), (level, M, N, K, wq.dtype)
        if M <= 8:
            for wf in (w, w.bfloat16()):
                torch.testing.assert_close(emu.linear(x, wf), linear(host, x, wf), rtol=1e-5,
                                           atol=1e-5)  # fmt: skip
    for M, N, K in PANEL_SHAPES:  # the panel product's FMA form: the host's generic bits
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).bfloat16()
        assert torch.equal(emu.panels(x, w), panels(host, x, w)), (level, M, N, K)
    x = torch.randn(32, generator=g) * 3
    emu.run("quantize", 32, emu.file("qx", x), emu.file("q"))
    q_host = torch.empty(32, dtype=torch.int8)
    scale = host.probe_quantize(ptr(x), ctypes.c_int64(32), ptr(q_host))
    got = (emu.tmp / "q").read_bytes()
    assert got[4:] == q_host.numpy().tobytes()
    assert torch.frombuffer(bytearray(got[:4]), dtype=torch.float32).item() == scale
    y = torch.cat([torch.linspace(-90, 90, 61), torch.randn(40, generator=g) * 8])
    emu.run("silu", y.numel(), emu.file("s", y))
    host_y = y.clone()
    host.probe_silu(ptr(host_y), ctypes.c_int64(y.numel()))
    assert torch.equal(emu.read("s", torch.float32, (y.numel(),)), host_y)
    window, xs = torch.randn(25, generator=g), torch.randn(8, generator=g)
    emu.run("window", emu.file("p", window), emu.file("wx", xs), emu.file("h"))
    hw, hh = window.clone(), torch.empty(24)
    host.probe_window(ptr(hw), ptr(xs), ptr(hh))
    assert torch.equal(emu.read("h", torch.float32, (24,)), hh)
    assert torch.equal(emu.read("p", torch.float32, (25,))[:24], hw[:24])
    s0, k, q, kn, d, dn, v, a0 = inputs = delta_channels_inputs()  # the per-channel pass
    args = [emu.file(f"d{i}", t) for i, t in enumerate((s0, k, q, kn, v, d, dn, a0))]
    emu.run("deltac", len(k), *args, emu.file("do"))
    got = (emu.read("d0", torch.float64, tuple(s0.shape)), emu.read("d7", torch.float64, (16,)),
           emu.read("do", torch.float64, (16,)))  # fmt: skip
    for t, want in zip(got, delta_channels_want(*inputs), strict=True):
        torch.testing.assert_close(t, want, rtol=1e-12, atol=1e-12)
