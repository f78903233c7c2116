"""The C++ kernels' test modules import `built`, an autouse fixture that skips the whole module
where no C++ compiler is installed, and fails it where one is but the kernels do not build (a
broken source must not pass as skipped tests): `from tests.kernels.cpp_required import built`."""

from __future__ import annotations

import shutil

import pytest

from hybrid_serve.kernels import cpp_build


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if cpp_build.available():
        return
    if shutil.which("c++") or shutil.which("g++"):
        pytest.fail(f"a C++ compiler is here, the kernels do not build: {cpp_build.load_error()}")
    pytest.skip(f"C++ kernels cannot be built here (no compiler): {cpp_build.load_error()}")
