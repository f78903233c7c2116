"""The multi-weight GEMV (C++) against its reference (one `kernels.linear` per weight): fp32 and
bf16 weights, with and without biases, within and past the GEMV's row limit. Skips where the C++
kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from kernels import multi_linear, multi_linear_cpp
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)


@pytest.mark.parametrize(
    ("lead", "dtype", "bias"),
    [((1,), torch.float32, False), ((3, 2), torch.float32, True), ((5,), torch.bfloat16, False)],
)
def test_linear_multi_matches_reference(lead, dtype, bias) -> None:
    torch.manual_seed(len(lead))
    K, Ns = 72, (40, 8, 1)
    x = torch.randn(*lead, K)
    weights = [torch.randn(n, K).to(dtype) for n in Ns]
    biases = [torch.randn(n) if bias else None for n in Ns]
    ys = multi_linear_cpp.linear_multi(x, weights, biases)
    refs = multi_linear.linear_multi(x, weights, biases)
    assert [y.shape for y in ys] == [(*lead, n) for n in Ns]
    for y, ref in zip(ys, refs, strict=True):
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_rows_past_the_gemv_limit_run_the_reference() -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 16)  # fp32 weights: the GEMV takes at most 8 rows
    weights = [torch.randn(4, 16), torch.randn(3, 16)]
    ys = multi_linear_cpp.linear_multi(x, weights, [None, None])
    for y, ref in zip(ys, multi_linear.linear_multi(x, weights, [None, None]), strict=True):
        assert torch.equal(y, ref)
