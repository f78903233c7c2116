"""What a user gets without `make`: the wheel carries the C++ kernels' sources and builds them at
first use from site-packages, and the CPU image installs as the Makefile does (the tested set of
constraints.txt included) and prebuilds every x86 level (no Docker daemon here: its steps are
read and checked against the Makefile's). Every version bound in pyproject.toml and every pin
of a direct dependency in constraints.txt says why.
"""

from __future__ import annotations

import fnmatch
import importlib.util
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
from tests import constraints

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
    # `make install` builds them (kernels/prebuild.py): no library here is an error, not a skip
    assert cpp_build.load() is not None, f"the C++ kernels did not load: {cpp_build.load_error()}"
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


def docker_runs(dockerfile: str) -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    joined = dockerfile.replace("\\\n", " ")
    return [ln for ln in joined.splitlines() if ln.startswith("RUN ")]


def test_make_install_installs_the_tested_set():
    """The project's install line applies constraints.txt, and the stamp is redone when the file
    changes."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^CONSTRAINTS\s*:=\s*constraints\.txt\s*$", makefile, re.M)
    assert (ROOT / "constraints.txt").is_file()
    stamp = re.search(r"^\$\(STAMP\)\s*:(.*)$", makefile, re.M)
    assert stamp and "$(CONSTRAINTS)" in stamp.group(1).split()
    (project,) = [
        ln for ln in recipe(makefile, "$(STAMP)") if "pip install" in ln and ".[dev]" in ln
    ]
    assert "-c $(CONSTRAINTS)" in project


def test_the_cpu_image_installs_as_the_makefile_and_prebuilds_every_level():
    makefile = (ROOT / "Makefile").read_text()
    docker = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    install = recipe(makefile, "$(STAMP)")
    assert any(
        "-m hybrid_serve.kernels.prebuild" in ln for ln in install
    )  # make install builds the kernels
    assert any("pip install" in ln and "$(TORCH_SPEC)" in ln for ln in install)
    runs = docker_runs(docker)
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


@pytest.mark.parametrize("image", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_each_image_installs_the_tested_set(image):
    """`make install` in the image, with constraints.txt copied in before it (.dockerignore
    keeps it) and not overridden: the image's packages are the tested set."""
    docker = (ROOT / "docker" / image).read_text()
    runs = docker_runs(docker)
    (make,) = [ln for ln in runs if "make install" in ln]
    assert "CONSTRAINTS" not in make
    copy = re.search(r"^COPY \. (\S+)$", docker, re.M)
    workdir = re.search(r"^WORKDIR (\S+)$", docker, re.M)
    assert copy and workdir and copy.group(1) == workdir.group(1)
    assert docker.index(copy.group(0)) < docker.index(make)
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    assert not any(
        fnmatch.fnmatch("constraints.txt", p) for p in ignored if p and not p.startswith("#")
    )


def test_every_python_m_in_the_images_names_one_of_our_modules():
    """Each `python -m MODULE` an image runs is a module of this checkout's hybrid_serve with a
    command line (its --help exits 0)."""
    commands = [
        m.groups()
        for image in ("Dockerfile.cpu", "Dockerfile.cuda")
        for ln in docker_runs((ROOT / "docker" / image).read_text())
        for m in re.finditer(r"python3? -m ([\w.]+)((?: --?[\w-]+)*)", ln)
    ]
    assert commands  # the CPU image prebuilds the kernels
    for module, _ in commands:
        spec = importlib.util.find_spec(module)
        assert spec and spec.origin, module
        assert Path(spec.origin).resolve().is_relative_to(ROOT / "hybrid_serve"), spec.origin
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        for flag in re.findall(r"--?[\w-]+", _):
            assert flag in out.stdout, f"python -m {module}: no {flag} in its --help"


def requirements(pyproject: str) -> list[tuple[int, str, str]]:
    """(line index, array, requirement) for every requirement string of build-system.requires
    ("requires"), project.dependencies ("dependencies") and each optional-dependencies array
    (the extra's name); the file writes one quoted string a line there."""
    lines = pyproject.splitlines()
    out, table, array = [], "", None
    for i, ln in enumerate(lines):
        stripped = ln.strip()
        if re.fullmatch(r"\[[^\]]+\]", stripped):
            table, array = stripped, None
        elif table not in ("[build-system]", "[project]", "[project.optional-dependencies]"):
            continue
        elif opens := re.fullmatch(r"([\w-]+)\s*=\s*\[(.*)", stripped):
            if table != "[project]" or opens.group(1) == "dependencies":
                assert '"' not in opens.group(2), f"pyproject.toml:{i + 1}: one string a line"
                array = opens.group(1)
        elif array and stripped.startswith("]"):
            array = None
        elif array and (m := re.fullmatch(r'"([^"]+)",?\s*(#.*)?', stripped)):
            out.append((i, array, m.group(1)))
    return out


def requirement_name(requirement: str) -> str:
    return constraints.canonical(re.match(r"[\w.-]+", requirement).group(0))


def test_every_version_bound_in_pyproject_says_why():
    """A bounded requirement has a comment on its line or directly above it, and that comment
    names each version its bounds name (so a changed bound needs a new reason)."""
    text = (ROOT / "pyproject.toml").read_text()
    lines = text.splitlines()
    reqs = requirements(text)
    arrays = {array for _, array, _ in reqs}
    assert {"requires", "dependencies", "dev", "gpu"} <= arrays, arrays
    for i, _, req in reqs:
        versions = re.findall(r"(?:[<>=!~]=?|===)\s*([\w.*+!]+)", req.split(";")[0])
        comment = lines[i].partition("#")[2]
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            comment = lines[j] + "\n" + comment
            j -= 1
        for version in versions:
            assert version in comment, f"pyproject.toml:{i + 1}: no reason names {version}"


def test_constraints_pin_every_direct_dependency_exactly_with_a_reason():
    """constraints.txt: exact pins only (tests/constraints.py reads it), a header that says
    what it is and how to regenerate it, torch / triton / ourselves left out, and each
    dependency `make install` installs by name (the project's and the dev extra's) pinned,
    with a reason on its line."""
    text = (ROOT / "constraints.txt").read_text()
    pins = constraints.read_pins(ROOT / "constraints.txt")
    assert "last passed with" in text and "make constraints" in text
    assert not set(constraints.UNPINNED) & set(pins)
    reqs = requirements((ROOT / "pyproject.toml").read_text())
    direct = {requirement_name(r) for _, array, r in reqs if array in ("dependencies", "dev")}
    direct -= set(constraints.UNPINNED)
    assert {"transformers", "pytest"} <= direct
    for name in sorted(direct):
        assert name in pins, f"constraints.txt does not pin {name}"
        assert pins[name].reason, f"constraints.txt: {name}'s pin has no reason"
