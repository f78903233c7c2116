"""The multi-weight op (C++) against its reference (one torch `linear` per weight): fp32 and
bf16 weights, with and without biases, within and past the GEMV's row limit. Skips where the C++
kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels import cpp_ops, multi_linear
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
    ys = cpp_ops.linear_multi(x, weights, biases)
    refs = multi_linear.linear_multi(x, weights, biases)
    assert [y.shape for y in ys] == [(*lead, n) for n in Ns]
    for y, ref in zip(ys, refs, strict=True):
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_rows_past_the_gemv_limit_run_the_linear_op_per_weight() -> None:
    """Beyond the GEMV's 8 rows each weight takes the C++ linear op's product (the tiled GEMM):
    the same bits as `hybrid_serve.kernels.cpp_ops.linear` weight by weight."""
    torch.manual_seed(0)
    x = torch.randn(9, 16)
    weights = [torch.randn(4, 16), torch.randn(3, 16).to(torch.bfloat16)]
    ys = cpp_ops.linear_multi(x, weights, [None, None])
    for y, w in zip(ys, weights, strict=True):
        assert torch.equal(y, cpp_ops.linear(x, w))


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_one_region_equals_each_weight_alone(rows) -> None:
    """`skinny_linear_multi` runs all its weights in one parallel region, split in blocks across
    the threads (`hs::skinny_linear_jobs`); every output is still bit for bit what the GEMV gives
    each weight alone, for mixed fp32 / bf16 weights, sizes that do not fill a block and one big
    enough to be split."""
    from hybrid_serve.kernels import cpp_build

    ops = cpp_build.load()
    torch.manual_seed(rows)
    K = 200
    x = torch.randn(rows, K)
    weights = [
        torch.randn(3000, K),
        torch.randn(7, K).to(torch.bfloat16),
        torch.randn(1, K),
        torch.randn(517, K).to(torch.bfloat16),
    ]
    together = ops.skinny_linear_multi(x, weights)
    for y, w in zip(together, weights, strict=True):
        assert torch.equal(y, ops.skinny_linear(x, w))
