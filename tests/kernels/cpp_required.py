"""The C++ kernels' test modules import `built`, an autouse fixture that skips the whole module
where the kernels cannot be built (no compiler): `from tests.kernels.cpp_required import built`."""

from __future__ import annotations

import pytest

from kernels import cpp_build


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not cpp_build.available():
        pytest.skip(f"C++ kernels cannot be built here: {cpp_build.load_error()}")
