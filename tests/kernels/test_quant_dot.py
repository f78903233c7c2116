"""The quantized products' int8 activations (`kernels.quant.round_activations`): the rounding
rule, and the C++ GEMV's integer dot products against the dequantized weights times the rounded
activations at random shapes (odd N, K a multiple of the blocks or not, 1-8 rows), element by
element within the fp32 summation-order bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import cpp_ops
from hybrid_serve.kernels.quant import ACT_BLOCK, dequantize, quantize, round_activations
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)

U = 2.0**-24  # fp32's unit round-off


def test_rounding_rule() -> None:
    x = torch.zeros(2, 70)
    x[0, :32] = torch.linspace(-2.0, 1.0, 32)  # peak -2: step 2/127
    x[0, 40] = 0.5  # the second block's only value: it maps to 127 exactly
    x[1, 64:] = torch.tensor([1.0, -3.0, 0.0, 2.5, 1.5, 0.25])  # a short last block
    r = round_activations(x)
    assert r.shape == x.shape and r.dtype == torch.float32
    step = torch.tensor(2.0) / 127
    torch.testing.assert_close(r[0, :32], torch.round(x[0, :32] * (127 / 2.0)) * step)
    assert r[0, 40] == 0.5 and (r[0, 32:40] == 0).all() and (r[0, 41:64] == 0).all()
    assert torch.equal(r[1, :64], torch.zeros(64))  # zero blocks stay zero
    assert r[1, 65] == -3.0 and (r[1, 64:] - x[1, 64:]).abs().max() <= 3.0 / 127 / 2
    # each value within half a step of its block's scale, and no more than 127 steps
    y = torch.randn(5, 100, generator=torch.Generator().manual_seed(0)) * 10
    blocks = F.pad(y, (0, 28)).unflatten(-1, (-1, ACT_BLOCK)).abs().amax(-1)  # [5, 4]
    d = (blocks / 127).repeat_interleave(ACT_BLOCK, dim=-1)[:, :100]
    assert ((round_activations(y) - y).abs() <= d / 2 * (1 + 1e-5)).all()
    assert ((round_activations(y) / d).round().abs() <= 127).all()


@pytest.mark.parametrize("k", [32, 37])
def test_half_way_rounds_to_even(k: int) -> None:
    """Peak 127 makes the scale 1: the halves round to even, in the reference and the GEMV
    (read through int8 identity weights), the vector blocks and a scalar tail alike."""
    x = torch.zeros(1, k)
    x[0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5])
    want = torch.zeros(k)
    want[:6] = torch.tensor([127.0, 0.0, 2.0, 2.0, 0.0, -2.0])
    if k > 32:
        x[0, 32:] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5])
        want[32:] = torch.tensor([127.0, 0.0, 2.0, 2.0, -2.0])
    assert torch.equal(round_activations(x)[0], want)
    got = cpp_ops.linear(x, quantize(torch.eye(k), "int8"))[0]
    assert torch.equal(got.round(), want), got


def bound(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """How far two fp32 sums of the products x[m, k] w[n, k] in different orders may differ:
    each within (K + 4) u of sum |x w| (the kernel's K / 32 block sums are exact integers, then
    scaled and summed; the reference's K products are summed in any order)."""
    K = w.shape[-1]
    return 2 * (K + 4) * U * (x.abs() @ w.abs().T)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("seed", range(6))
def test_gemv_against_rounded_reference(method: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 300, (1,), generator=gen)) | 1  # odd
    blocks = int(torch.randint(1, 40, (1,), generator=gen))
    short = method == "int8" and seed % 2  # int8: a last block shorter than 32 on odd seeds
    k = blocks * ACT_BLOCK + (int(torch.randint(1, 32, (1,), generator=gen)) if short else 0)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    q = quantize(w, method)
    assert q.dtype == (torch.uint8 if method == "int4" else torch.int8)
    for rows in range(1, 9):
        x = torch.randn(rows, k, generator=gen) * 3
        x[:, : min(k, 32)] *= 100  # blocks of very different scales
        xr, wd = round_activations(x), dequantize(q)
        want = F.linear(xr, wd)
        got = cpp_ops.linear(x, q)
        assert ((got - want).abs() <= bound(wd, xr)).all(), (rows, (got - want).abs().max())


def test_zero_and_tiny_activations() -> None:
    """Zero blocks (scale 0) and tiny ones give exact zeros or the rounded values, no NaN."""
    w = quantize(torch.randn(9, 96, generator=torch.Generator().manual_seed(1)), "int4")
    x = torch.zeros(3, 96)
    x[1, 40] = 1e-30
    x[2] = 1.0
    got = cpp_ops.linear(x, w)
    assert torch.equal(got[0], torch.zeros(9)) and torch.isfinite(got).all()
    want = F.linear(round_activations(x), dequantize(w))
    assert ((got - want).abs() <= bound(dequantize(w), round_activations(x))).all()


def test_one_rounding_shared_by_the_products_of_one_input() -> None:
    """The multi-weight GEMV rounds x once for all its quantized weights: each output is the
    product that weight gives alone."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 160, generator=gen)
    ws = [quantize(torch.randn(n, 160, generator=gen), m) for n, m in
          ((21, "int8"), (7, "int4"), (40, "int8"))]  # fmt: skip
    for y, w in zip(cpp_ops.linear_multi(x, ws, [None] * 3), ws, strict=True):
        assert torch.equal(y, cpp_ops.linear(x, w))
