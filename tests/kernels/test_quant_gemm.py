"""The tiled integer GEMM (int8 and int4 weights past the GEMV's 8 rows: kernels/csrc/qgemm.h)
against the dequantized weights times the rounded activations at odd sizes (rows not a multiple
of the panel, odd N, K with a short last block or past a cache block, more panels than one m
block), against the GEMV row by row (both within the fp32 summation-order bound), exactly on
integer-valued inputs at the formats' extremes, and each row's bits independent of its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import cpp_ops
from hybrid_serve.kernels.quant import ACT_BLOCK, GROUP, dequantize, quantize, round_activations
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)
from tests.kernels.test_quant_dot import bound

ops = torch.ops.hybrid_serve


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


@pytest.mark.parametrize(
    ("M", "N", "K", "method"),
    [
        (9, 1, 20, "int8"),  # one short block, one weight row
        (9, 7, 32, "int4"),
        (13, 50, 100, "int8"),  # a short last block
        (17, 13, 300, "int8"),  # past a 256-column cache block, then a short block
        (33, 61, 544, "int4"),  # groups past two cache blocks, a 1-row last panel
        (47, 97, 96, "int4"),
        (70, 49, 801, "int8"),
        (129, 100, 64, "int4"),  # more panels than one m block
        (40, 3, 1000, "int8"),  # too few weight rows to share: the panels split instead
        (64, 131, 256, "int8"),
    ],
)
def test_gemm_against_rounded_reference(M: int, N: int, K: int, method: str) -> None:
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen) * 3
    x[:, : min(K, ACT_BLOCK)] *= 100  # blocks of very different scales
    x[M // 2] = 0.0  # a zero row: zero scales, exact zeros
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen)
    q = quantize(w, method)
    assert q.dtype == (torch.uint8 if method == "int4" else torch.int8)
    xr, wd = round_activations(x), dequantize(q)
    got = ops.tiled_linear(x, q)
    assert torch.equal(cpp_ops.linear(x, q), got)  # GEMV or GEMM: the same bits
    assert torch.equal(got[M // 2], torch.zeros(N))
    limit = bound(wd, xr)
    assert ((got - F.linear(xr, wd)).abs() <= limit).all(), (got - F.linear(xr, wd)).abs().max()
    gemv = torch.cat([ops.skinny_linear(x[i : i + 8].contiguous(), q) for i in range(0, M, 8)])
    assert ((got - gemv).abs() <= limit).all(), (got - gemv).abs().max()


def integer_inputs(M: int, N: int, K: int, method: str, gen: torch.Generator):
    """x and w whose rounding and quantization are the identity: every activation block peaks at
    127 (scale 1) and every weight row at 127 (int8) or every group at -8 (int4, scale 1); with
    rows of the extremes (all -127 or 127, all -8 or 7) where pairs of products are largest."""
    x = torch.randint(-127, 128, (M, K), generator=gen).float()
    x[:, ::ACT_BLOCK] = 127.0
    x[1], x[2] = -127.0, 127.0
    if method == "int8":
        w = torch.randint(-127, 128, (N, K), generator=gen).float()
        w[:, 0] = 127.0
        w[1], w[2] = -127.0, 127.0
    else:
        w = torch.randint(-8, 8, (N, K), generator=gen).float()
        w[2] = 7.0
        w[1] = -8.0
        w[:, ::GROUP] = -8.0
    return x, w


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_integer_sums_are_exact(method: str) -> None:
    """On integer-valued inputs every scale is 1 and the result is the exact integer product
    (below 2^24 here), whatever form the dot takes at this ISA level (signed, or unsigned bytes
    offset by 8 or 128 and corrected)."""
    gen = torch.Generator().manual_seed(7)
    M, N, K = 21, 11, 512
    x, w = integer_inputs(M, N, K, method, gen)
    q = quantize(w, method)
    assert torch.equal(dequantize(q), w) and torch.equal(round_activations(x), x)
    want = (x.double() @ w.double().T).float()
    assert torch.equal(ops.tiled_linear(x, q), want)
    assert torch.equal(ops.skinny_linear(x[:8].contiguous(), q), want[:8])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_gemm_row_does_not_depend_on_its_batch(method: str) -> None:
    """Each output is one fixed sum: a row's result is bit-identical among 9 rows (the GEMM's
    fewest), at any position of 150 (in any panel, any lane), and beside different rows."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(150, 320, generator=gen)
    q = quantize(torch.randn(70, 320, generator=gen), method)
    full = ops.tiled_linear(x, q)
    for lo in (0, 5, 31, 40, 141):
        assert torch.equal(ops.tiled_linear(x[lo : lo + 9].contiguous(), q), full[lo : lo + 9])
    other = torch.cat([x[:1], torch.randn(20, 320, generator=gen)])
    assert torch.equal(ops.tiled_linear(other, q)[0], full[0])
