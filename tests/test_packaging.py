"""What a user gets without `make`: the wheel carries the C++ kernels' sources and builds them at
first use from site-packages, and the CPU image installs as the Makefile does and prebuilds
every x86 level (no Docker daemon here: its steps are read and checked against the Makefile's).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from hybrid_serve.kernels import cpp_build

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"  # a copy: setuptools writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", "checkpoints",
    ))  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(src)],
        check=True, cwd=out,
    )  # fmt: skip
    (path,) = out.glob("hybrid_serve-*.whl")
    return path


def test_the_wheel_carries_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        f"hybrid_serve/kernels/csrc/{p.name}"
        for p in cpp_build.CSRC.iterdir()
        if p.suffix in (".cpp", ".h")
    }
    assert sources and sources <= names, sorted(sources - names)
    for package in ("server", "scheduler", "models", "kernels", "mem_cache", "make_model"):
        assert f"hybrid_serve/{package}/__init__.py" in names


def test_the_wheel_installs_one_top_level_name(wheel):
    """RECORD lists every installed file: the package `hybrid_serve` and its dist-info, nothing
    else, so no generic name (`kernels`, `server`, `models`) can shadow another distribution's."""
    archive = zipfile.ZipFile(wheel)
    (record,) = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
    rows = archive.read(record).decode().splitlines()
    tops = {row.split(",")[0].split("/")[0] for row in rows if row}
    assert tops == {"hybrid_serve", record.split("/")[0]}, sorted(tops)


def test_a_non_editable_install_loads_the_kernels_from_its_own_sources(wheel, tmp_path):
    """Installed into a scratch environment that reuses this one's site-packages (torch) but not
    its editable install, run from a directory outside the checkout: it finds the kernels'
    sources in site-packages and loads the library this checkout's sources built. A library is
    named by the hash of every source and header (kernels/cpp_build.py), so that library is the
    one it loads only when the wheel carries them all, byte for byte; one file short, it would
    build from its own incomplete tree and fail."""
    if cpp_build.load() is None:
        pytest.skip(f"no C++ kernels on this machine: {cpp_build.load_error()}")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--target", str(site), str(wheel)],
        check=True,
    )  # fmt: skip
    # a plain path entry: the venv's packages, without running its .pth files (the editable
    # install's finder is one of them)
    (site / "venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    script = (
        "import sys, torch; from hybrid_serve.kernels import cpp_build, cpu_levels;"
        "ops = cpp_build.load(); assert ops is not None, cpp_build.load_error();"
        "x = torch.randn(3, 64); w = torch.randn(5, 64);"
        "torch.testing.assert_close(ops.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5);"
        "print(cpp_build.CSRC, cpp_build._state['path'], cpp_build.loaded_level().name)"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1", "HOME": os.environ.get("HOME", "/")}
    env.update({k: v for k, v in os.environ.items() if k.startswith("HYBRID_SERVE_")})
    out = subprocess.run(
        [sys.executable, "-S", "-c", f"import site; site.addsitedir({str(site)!r}); {script}"],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    csrc, library, level = out.stdout.split()
    assert Path(csrc).is_relative_to(site)
    assert Path(library) == cpp_build._state["path"] and level == cpp_build.loaded_level().name


def recipe(makefile: str, target: str) -> list[str]:
    """The command lines of `target`'s recipe."""
    lines = makefile.splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(rf"^{re.escape(target)}\s*:", ln))
    out = []
    for ln in lines[start + 1 :]:
        if not ln.startswith("\t"):
            break
        if not ln.strip().startswith("#"):
            out.append(ln.strip())
    return out


def test_the_cpu_image_installs_as_the_makefile_and_prebuilds_every_level():
    makefile = (ROOT / "Makefile").read_text()
    docker = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    install = recipe(makefile, "$(STAMP)")
    assert any(
        "-m hybrid_serve.kernels.prebuild" in ln for ln in install
    )  # make install builds the kernels
    assert any("pip install" in ln and "$(TORCH_SPEC)" in ln for ln in install)
    joined = docker.replace("\\\n", " ")  # continuation lines
    runs = [ln for ln in joined.splitlines() if ln.startswith("RUN ")]
    apt = next(ln for ln in runs if "apt-get install" in ln)
    assert re.search(r"\sg\+\+\s", apt) and re.search(r"\smake\s", apt)  # a compiler, and make
    make = [ln for ln in runs if "make install" in ln]
    assert len(make) == 1 and "TORCH_SPEC" not in make[0]  # the Makefile's torch pin
    prebuild = [i for i, ln in enumerate(runs) if "-m hybrid_serve.kernels.prebuild --all" in ln]
    assert prebuild and prebuild[0] > runs.index(make[0])
    cache = re.search(r"HYBRID_SERVE_KERNEL_CACHE=(\S+)", docker)
    volumes = re.findall(r"-v \S+:(\S+)", docker)
    assert cache and volumes and not any(cache.group(1).startswith(v) for v in volumes)
    assert docker.index("ENV HYBRID_SERVE_KERNEL_CACHE") < docker.index("RUN make install")
