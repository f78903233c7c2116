"""What the C++ kernels' tests need: the kernels built at this host's level. A test module
imports `built`, an autouse fixture over the whole module
(`from tests.kernels.cpp_required import built`); a single test calls `require_cpp()`. Where the
kernels are unavailable, both fail the test with the build's error and never skip it: a broken
source, a broken toolchain and a machine without a compiler must not pass as skipped tests."""

from __future__ import annotations

from typing import Any

import pytest

from hybrid_serve.kernels import cpp_build


def require_cpp() -> Any:
    """`torch.ops.hybrid_serve` with this host's level of the C++ kernels loaded; a test failure
    naming the build's error (`cpp_build.load_error`) where they are unavailable."""
    ops = cpp_build.load()
    if ops is not None:
        return ops
    err = cpp_build.load_error()  # NoCompiler's message names the compiler it looked for
    pytest.fail(f"this test needs the C++ kernels, unavailable here: {type(err).__name__}: {err}")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    require_cpp()
