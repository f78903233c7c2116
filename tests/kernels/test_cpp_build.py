"""The build of the C++ kernels: the level table, which level a host gets, the library's name,
and that a failed build is loud (kernels/cpp_build.py, kernels/cpu_levels.py, kernels/prebuild.py).
"""

from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest

from hybrid_serve.kernels import KernelSettings, choose, cpp_build, cpu_levels, prebuild
from tests.kernels.cpp_required import require_cpp

AVX2_EPYC = "fpu sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c lahf_lm abm bmi1 avx2 bmi2"  # noqa: E501
ZEN4 = AVX2_EPYC + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
SKYLAKE_SP = AVX2_EPYC + " avx512f avx512dq avx512cd avx512bw avx512vl"
SAPPHIRE = ZEN4 + " avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8"
ALDER_LAKE = AVX2_EPYC + " avx_vnni"
GRAVITON3 = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm asimddp sve"
)


def cpuinfo(arch: str, flags: str) -> str:
    key = "flags" if arch == "x86_64" else "Features"
    return f"processor\t: 0\nmodel name\t: a CPU\n{key}\t\t: {flags}\n\nprocessor\t: 1\n"


@pytest.mark.parametrize(
    "arch, flags, level",
    [
        ("x86_64", "fpu sse sse2", "generic"),
        ("x86_64", AVX2_EPYC, "x86-64-v3"),
        ("x86_64", ALDER_LAKE, "x86-64-v3-vnni"),
        ("x86_64", SKYLAKE_SP, "x86-64-v4"),
        ("x86_64", ZEN4, "x86-64-v4-bf16"),
        ("x86_64", SAPPHIRE, "sapphirerapids"),
        ("aarch64", "fp asimd evtstrm", "generic"),
        ("aarch64", GRAVITON3, "armv8.2-a+dotprod"),
    ],
)
def test_the_best_level_a_cpu_runs(arch, flags, level):
    features = cpu_levels.host_features(cpuinfo(arch, flags))
    assert cpu_levels.best(features, arch).name == level


@pytest.mark.parametrize(
    "arch, flags, bf16",
    [
        ("x86_64", AVX2_EPYC, False),
        ("x86_64", SKYLAKE_SP, False),
        ("x86_64", ZEN4, True),
        ("x86_64", SAPPHIRE, True),
        ("aarch64", GRAVITON3, False),
    ],
)
def test_which_cpus_multiply_bf16_in_hardware(arch, flags, bf16):
    """The bf16 products at batch go by the CPU's features, not by the level loaded."""
    assert cpu_levels.multiplies_bf16(cpu_levels.host_features(cpuinfo(arch, flags))) is bf16


def test_levels_only_add_features_and_never_use_native():
    for arch in ("x86_64", "aarch64"):
        levels = cpu_levels.levels(arch)
        assert len({lv.name for lv in levels}) == len(levels)
        for lower, higher in zip(levels, levels[1:], strict=False):
            if higher.name != "x86-64-v4":  # v4 need not have AVX-VNNI (v3-vnni's)
                assert lower.requires <= higher.requires, (lower.name, higher.name)
        assert not any("native" in f for lv in levels for f in lv.flags)


def test_sapphirerapids_says_it_is_the_bf16_code_and_no_amx_path(monkeypatch, caplog):
    """The sapphirerapids level compiles x86-64-v4-bf16's vocabulary with other flags, and its
    description, which the start-up line prints, says so (a library that loads is faked here:
    no build, whatever the host)."""
    spr = cpu_levels.get("sapphirerapids", "x86_64")
    assert spr.features == cpu_levels.get("x86-64-v4-bf16", "x86_64").features
    assert "x86-64-v4-bf16's AVX-512 + VNNI + BF16 code" in spr.summary
    assert "no AMX tiles" in spr.summary and "+ AMX" not in spr.summary
    library = SimpleNamespace(features=lambda: spr.features)
    ops = SimpleNamespace(load_library=lambda path: None, hybrid_serve=library)
    monkeypatch.setattr(cpp_build, "_state", {})
    monkeypatch.setattr(cpp_build, "torch", SimpleNamespace(ops=ops))
    monkeypatch.setattr(cpu_levels, "choose", lambda want: spr)
    monkeypatch.setattr(cpp_build, "build", lambda level, cache: "/a/sapphirerapids.so")
    with caplog.at_level(logging.INFO, logger="hybrid_serve.kernels.cpp_build"):
        assert cpp_build.load("sapphirerapids") is library
    assert f"level sapphirerapids ({spr.summary}; avx512 avx512-vnni avx512-bf16)" in caplog.text


def test_a_forced_level_must_exist_and_run_here():
    features = cpu_levels.host_features(cpuinfo("x86_64", AVX2_EPYC))
    with pytest.raises(ValueError, match="needs avx512bw, avx512cd, avx512dq, avx512f, avx512vl"):
        cpu_levels.choose("x86-64-v4", features, "x86_64")
    with pytest.raises(ValueError, match="unknown CPU level 'nonsense'"):
        cpu_levels.choose("nonsense", features, "x86_64")
    assert cpu_levels.choose("generic", features, "x86_64").name == "generic"
    assert cpu_levels.choose("auto", features, "x86_64").name == "x86-64-v3"


def test_the_library_is_named_by_its_sources_flags_and_level(monkeypatch, tmp_path):
    """Content, not place: a second checkout of the same sources shares the library."""
    cxx = cpp_build.compiler() if shutil.which("c++") else "c++"
    generic, best = cpu_levels.levels()[0], cpu_levels.levels()[-1]
    here = cpp_build.tag(generic, cxx)
    assert cpp_build.tag(best, cxx) != here
    for src in cpp_build.CSRC.iterdir():
        if src.is_file():
            (tmp_path / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path)
    assert cpp_build.tag(generic, cxx) == here
    first = cpp_build.sources()[0]
    first.write_bytes(first.read_bytes() + b"\n// changed\n")
    assert cpp_build.tag(generic, cxx) != here
    first.write_bytes(first.read_bytes()[: -len(b"\n// changed\n")])
    (tmp_path / "gemv.h").write_text("// a changed header\n")
    assert cpp_build.tag(generic, cxx) != here


@pytest.fixture
def broken_sources(monkeypatch, tmp_path):
    """A source tree whose one file does not compile, and a fresh process state and cache (a
    failure where there is no compiler to fail on it)."""
    try:
        cpp_build.compiler()
    except cpp_build.NoCompiler as e:
        pytest.fail(f"a failed build needs a C++ compiler to fail: {e}")
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "broken.cpp").write_text("int f() { return undeclared_name; }\n")
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path / "csrc")
    monkeypatch.setattr(cpp_build, "_state", {})
    monkeypatch.setenv("HYBRID_SERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_a_failed_build_names_the_first_compiler_error(broken_sources, caplog, capsys):
    with caplog.at_level(logging.ERROR, logger="hybrid_serve.kernels.cpp_build"):
        assert cpp_build.load("generic") is None
    err = cpp_build.load_error()
    assert isinstance(err, cpp_build.BuildError)
    assert "broken.cpp" in err.first_error and "undeclared_name" in err.first_error
    assert err.first_error in caplog.text
    # `make install` runs the prebuild command: it fails with that error
    cpp_build._state.clear()
    assert prebuild.main(["--level", "generic"]) == 1
    assert "undeclared_name" in capsys.readouterr().err


def test_the_server_does_not_start_on_a_failed_build(broken_sources):
    with pytest.raises(RuntimeError, match="HYBRID_SERVE_KERNELS=torch") as info:
        choose("cpu", settings=KernelSettings(cpu_level="generic"))
    assert "undeclared_name" in str(info.value)
    # asking for the references is how to serve anyway
    assert choose("cpu", settings=KernelSettings("torch", cpu_level="generic")).backend == "torch"


def test_no_compiler_warns_once_and_serves_the_references(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpp_build, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="hybrid_serve.kernels.cpp_build"):
        assert choose("cpu", settings=KernelSettings()).backend == "torch"
        assert cpp_build.load() is None
    assert caplog.text.count("using the torch references") == 1
    assert "install a C++ compiler (g++, or name one in CXX)" in caplog.text
    assert isinstance(cpp_build.load_error(), cpp_build.NoCompiler)
    assert prebuild.main([]) == 0  # make install goes on: the references serve
    with pytest.raises(RuntimeError, match="cannot be built"):
        choose("cpu", settings=KernelSettings("cpp"))


def test_one_level_per_process():
    require_cpp()
    loaded = cpp_build.loaded_level()
    assert loaded.name == cpu_levels.best().name  # the suite runs at the host's best level
    other = next(lv for lv in cpu_levels.levels() if lv.name != loaded.name)
    with pytest.raises(ValueError, match="this process loaded"):
        cpp_build.load(other.name)
    ops = choose("cpu")
    assert f"CPU level {loaded.name}" in ops.table().splitlines()[0]
    assert ops.info()["cpu_level"] == loaded.name
